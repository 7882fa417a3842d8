"""Decoder-layer rematerialisation that keeps the matmul outputs (``spec.training.remat:
dots``).

Tunix's layer remat (``RematConfig.DECODER``, posttrain's ``layer``) wraps each decoder
layer in ``nnx.remat`` with no policy: the backward pass recomputes the whole layer, every
projection included, so a step costs about 8 rather than 6 forward-matmul FLOPs per
parameter and token. ``dots`` keeps the outputs of the layer's matmuls with no batch
dimension (the q/k/v/o and MLP projections: ``jax.checkpoint_policies.
dots_with_no_batch_dims_saveable``) and recomputes only the cheap element-wise work and
the attention scores (a batched matmul, whose ``[heads, length, length]`` output is the
one that does not fit), as MaxText's ``minimal`` policy does.

Applied by giving each decoder layer a subclass of its Tunix class whose ``__call__``
wraps ``block`` in ``nnx.remat`` with that policy. Parameter paths, checkpoints and LoRA
targets are unchanged (they name attributes, not classes); a decode step (a KV cache)
and a view with remat turned off (``generation.without_remat``) run Tunix's own call.
"""

from __future__ import annotations

import functools
import inspect
from typing import Any

import jax
from flax import nnx

POLICIES = {"dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable}


@functools.cache
def _with_policy(cls: type, name: str) -> type:
    policy = POLICIES[name]
    block = cls.block
    signature = inspect.signature(block)

    def __call__(self, *args: Any, **kwargs: Any):  # noqa: N807 - the module's call
        bound = signature.bind(self, *args, **kwargs)
        bound.apply_defaults()
        remat = getattr(self.config, "remat_config", None)
        cache = bound.arguments.get("cache")
        if remat is None or remat.name != "DECODER" or cache is not None:
            return cls.__call__(self, *args, **kwargs)
        return nnx.remat(block, policy=policy)(*bound.args)

    return type(cls.__name__, (cls,), {"__call__": __call__, "posttrain_remat_policy": name})


def apply_policy(model: nnx.Module, name: str) -> None:
    """Give every decoder layer of ``model`` the remat policy ``name`` (see POLICIES)."""
    for layer in model.layers:
        cls = type(layer)
        if getattr(cls, "posttrain_remat_policy", None):  # given a policy before
            cls = cls.__bases__[0]
        layer.__class__ = _with_policy(cls, name)


def policy_of(model: nnx.Module) -> str | None:
    """The remat policy ``apply_policy`` gave ``model``'s layers, if any."""
    layers = getattr(model, "layers", None)
    first = getattr(layers, "stacked", None) or (layers[0] if layers else None)  # scan's
    return getattr(type(first), "posttrain_remat_policy", None)
