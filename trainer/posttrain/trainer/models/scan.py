"""Decoder layers stored stacked and run by one ``jax.lax.scan`` (``spec.training.layerLoop:
scan``).

Tunix builds a model's decoder layers as a list of modules, and its forward pass is a
Python loop over them: the compiled step holds every layer's code, so compile time and
the executable grow with the layer count (a 28-layer step: a 108 MB TPU executable,
104-130 s to compile on the chip, half a warm restart spent loading it from the cache).
``stack`` turns the list into one module of the same class whose every Variable holds
all the layers' values on a leading axis (``StackedLayers``); iterated, as Tunix's loop
does, it yields one callable that scans the layer over that axis, so the program holds
one layer's code whatever the depth (MaxText's ``scan_layers``).

Only the storage and the loop change: the layer's own call runs in the scan body (its
remat, posttrain's attention and LoRA included), and its parameters' paths gain the
``stacked`` step in place of the layer index. ``flat_state`` gives them back per layer
(the exports' names), and ``to_layout`` converts a checkpoint's pure-dict tree between
the two layouts, so a job resumes from checkpoints written either way. A KV cache is
stacked too (``init_cache``: one entry, every layer's k/v on a leading axis), so
generation (evaluation samples) scans as well; GRPO's rollouts, whose decoding speed is
their per-layer cache updated in place, keep the list.

Families: Llama 3, Qwen2 and Qwen3, whose layers are alike. Gemma's alternate local and
global attention, a static setting per layer, and stay a list.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Iterator
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from posttrain.trainer.models import remat as remat_lib

FAMILIES = ("llama3", "qwen2", "qwen3")
FIELD = "spec.training.layerLoop"
LOOPS = ("auto", "scan", "unroll")
STACKED = "stacked"  # the path step of the stacked layer: ("layers", "stacked", ...)


class StackedLayers(nnx.Module):
    """A model's ``count`` decoder layers as one module (``stacked``) whose Variables hold
    every layer's value on a leading axis. Iterated (Tunix's loop over ``model.layers``)
    it yields one callable that runs them all."""

    def __init__(self, stacked: nnx.Module, count: int) -> None:
        self.stacked = stacked
        self.count = count

    def __len__(self) -> int:
        return self.count

    def __iter__(self) -> Iterator[_Scan]:
        yield _Scan(self)


class _Scan:
    """The call of one decoder layer, scanned over the stacked layers: the same arguments
    as the layer's, the cache (if any) the stacked one ``init_cache`` makes."""

    def __init__(self, layers: StackedLayers) -> None:
        self.layers = layers

    def __call__(self, x: jax.Array, *args: Any, **kwargs: Any) -> tuple[Any, jax.Array]:
        stacked = self.layers.stacked
        signature = _signature(type(stacked))
        bound = signature.bind(None, x, *args, **kwargs)
        x_name = list(signature.parameters)[1]
        graphdef, state = nnx.split(stacked)
        remat = getattr(stacked.config, "remat_config", None)
        # The layer's remat wraps the whole body, without the barriers that keep a
        # remat's recomputation apart from its neighbours (a scan body has none).
        whole = bound.arguments.get("cache") is None and getattr(remat, "name", "") == "DECODER"

        def run(layer_state, carry, layer_cache):
            arguments = {**bound.arguments, x_name: carry, "cache": layer_cache}
            call = inspect.BoundArguments(signature, arguments)
            layer = nnx.merge(graphdef, layer_state)
            method = type(layer).block if whole else type(layer).__call__
            return method(layer, *call.args[1:], **call.kwargs)

        if whole:
            policy = remat_lib.POLICIES.get(getattr(type(stacked), "posttrain_remat_policy", None))
            run = jax.checkpoint(run, policy=policy, prevent_cse=False)

        def body(carry, xs):
            layer_state, layer_cache = xs
            new_cache, y = run(layer_state, carry, layer_cache)
            return y, new_cache

        x, new_cache = jax.lax.scan(body, x, (state, bound.arguments.get("cache")))
        return new_cache, x


@functools.cache
def _signature(cls: type) -> inspect.Signature:
    """The layer call's parameters (``block``'s: a remat subclass's ``__call__`` takes
    ``*args``)."""
    return inspect.signature(cls.block)


def is_stacked(model: nnx.Module) -> bool:
    return isinstance(getattr(model, "layers", None), StackedLayers)


def resolve(setting: str, *, family: str, platform: str | None = None, grpo: bool = False) -> str:
    """``scan`` or ``unroll`` for spec.training.layerLoop ``setting``, a model of
    ``family`` on ``platform`` (default: JAX's backend). ``auto`` scans on a TPU, where the
    chip measured the scanned step within 1.2% of the unrolled one's time, its compile 6.5x
    shorter and a warm restart half as long (docs/tpu.md); it unrolls elsewhere, for GRPO
    (its rollouts' per-layer KV cache) and for families whose layers differ."""
    if setting not in LOOPS:
        raise ValueError(f"{FIELD}: {setting!r} is not one of {', '.join(LOOPS)}")
    if setting == "scan" and family not in FAMILIES:
        raise ValueError(
            f"{FIELD}: scan, but the {family} family's layers differ from one another "
            f"(scanned families: {', '.join(FAMILIES)}); use auto or unroll"
        )
    if setting == "auto":
        platform = platform or jax.default_backend()
        scans = platform == "tpu" and family in FAMILIES and not grpo
        return "scan" if scans else "unroll"
    return setting


def sharding_metadata_key(var: nnx.Variable) -> str | None:
    """The metadata key under which a Tunix Variable names its sharding, if any (the
    loader reads it; a stacked Variable gets the layer axis in front of it)."""
    meta = var.get_metadata()
    for key in ("out_sharding", "sharding_names", "sharding"):
        if meta.get(key) is not None:
            return key
    return None


def _stacked_spec(var: nnx.Variable) -> dict[str, Any]:
    """The Variable's sharding metadata with the (unsharded) layer axis in front."""
    key = sharding_metadata_key(var)
    return {key: (None, *var.get_metadata()[key])} if key else {}


def _stacked_value(values: list[Any]) -> Any:
    """The values of one parameter (arrays, or shapes of an abstract model) stacked on a
    new leading axis, unsharded, each layer's sharding kept below it."""
    first = values[0]
    sharding = first.sharding
    if isinstance(sharding, jax.sharding.NamedSharding):
        spec = jax.sharding.PartitionSpec(None, *sharding.spec)
        sharding = jax.sharding.NamedSharding(sharding.mesh, spec)
    if isinstance(first, jax.ShapeDtypeStruct):
        return jax.ShapeDtypeStruct((len(values), *first.shape), first.dtype, sharding=sharding)
    return _stacker(sharding)(*values)


@functools.cache
def _stacker(sharding: Any) -> Any:
    return jax.jit(lambda *values: jnp.stack(values), out_shardings=sharding)


def alike(model: nnx.Module) -> bool:
    """Whether the model's decoder layers hold the same parameters (paths, shapes and
    dtypes), as stacking needs: LoRA on only some layers makes them differ."""

    def params(layer: nnx.Module) -> dict:
        flat = nnx.to_flat_state(nnx.state(layer))
        return {p: (v.get_value().shape, v.get_value().dtype) for p, v in flat}

    layers = list(model.layers)
    first = params(layers[0])
    return all(params(layer) == first for layer in layers[1:])


def stack(model: nnx.Module) -> nnx.Module:
    """Replaces ``model.layers`` (in place) by a ``StackedLayers`` of the same layers;
    returns ``model``. The layers are consumed: each parameter's per-layer arrays are
    freed once stacked, so the load holds the weights once plus one parameter's stack
    (the TPU runtime's reservable HBM shrinks by the load's high-water mark)."""
    if is_stacked(model):
        return model
    layers = list(model.layers)
    _name_like_first(layers)
    split = [nnx.split(layer) for layer in layers]
    graphdef = split[0][0]
    if any(g != graphdef for g, _ in split[1:]):
        raise ValueError(
            f"{FIELD}: scan, but this model's decoder layers differ (spec.lora.targetModules "
            "adapting only some of them?); use unroll"
        )
    flats = [dict(nnx.to_flat_state(state)) for _, state in split]
    stacked = {}
    for path, first in flats[0].items():
        values = [flat[path].get_value() for flat in flats]
        stacked[path] = first.copy(_stacked_value(values), **_stacked_spec(first))
        for value in values:
            if isinstance(value, jax.Array):
                value.delete()
    model.layers = StackedLayers(nnx.merge(graphdef, nnx.from_flat_state(stacked)), len(layers))
    return model


def _name_like_first(layers: list[nnx.Module]) -> None:
    """qwix names each adapted module by its path (``qwix_path``, a static attribute that
    differs by the layer index); the stacked layer's modules take the first layer's names
    (which LoRA targets a module has is in its Variables, compared apart)."""
    firsts = [m for _, m in nnx.iter_modules(layers[0])]
    for layer in layers[1:]:
        for first, module in zip(firsts, (m for _, m in nnx.iter_modules(layer)), strict=True):
            if hasattr(first, "qwix_path") and hasattr(module, "qwix_path"):
                module.qwix_path = first.qwix_path


class _LayerSlice:
    """Layer ``index`` of a stacked Variable, read as a per-layer Variable is
    (``get_value``), for code that walks parameters by their per-layer paths."""

    def __init__(self, var: nnx.Variable, index: int) -> None:
        self.var, self.index = var, index
        self.shape = tuple(var.get_value().shape[1:])
        self.dtype = var.get_value().dtype

    def get_value(self) -> Any:
        value = self.var.get_value()
        if isinstance(value, jax.ShapeDtypeStruct):
            return jax.ShapeDtypeStruct(self.shape, self.dtype)
        return value[self.index]


def flat_state(model: nnx.Module, *filters: Any) -> dict[tuple, Any]:
    """``nnx.to_flat_state(nnx.state(model, *filters))`` as a dict keyed by per-layer paths
    (``("layers", i, ...)``) whether or not the layers are stacked: a stacked parameter
    appears once per layer, as a ``_LayerSlice`` read when asked."""
    flat = dict(nnx.to_flat_state(nnx.state(model, *filters)))
    if not is_stacked(model):
        return flat
    out: dict[tuple, Any] = {}
    for path, var in flat.items():
        if path[:2] == ("layers", STACKED):
            for i in range(model.layers.count):
                out[("layers", i, *path[2:])] = _LayerSlice(var, i)
        else:
            out[path] = var
    return out


def init_cache(count: int, shape: tuple[int, ...], batch_size: int, dtype: Any) -> dict:
    """The KV cache of stacked layers: one entry whose k/v hold every layer's on a leading
    axis (Tunix's loop hands ``layer_0`` to the one scanned call)."""
    return {
        "layer_0": {
            "k": jnp.zeros((count, *shape), dtype),
            "v": jnp.zeros((count, *shape), dtype),
            "end_index": jnp.zeros((count, batch_size), jnp.int32),
        }
    }


def layout_of(tree: Any) -> bool | None:
    """Whether a pure-dict tree (a checkpoint's, or its target) holds its layers stacked:
    True, False, or None when it holds no ``layers``."""
    if not isinstance(tree, dict):
        return None
    for key, sub in tree.items():
        if key == "layers" and isinstance(sub, dict) and sub:
            return STACKED in sub
        found = layout_of(sub)
        if found is not None:
            return found
    return None


def to_layout(tree: Any, stacked: bool) -> Any:
    """A checkpoint's pure-dict tree (params and optimizer state) with every ``layers``
    subtree in the stacked layout (``{"stacked": ...}``) or the per-layer one
    (``{0: ..., 1: ...}``). Leaves are arrays (stacked or sliced on their devices) or
    ``jax.ShapeDtypeStruct`` (an abstract target, shardings kept)."""
    if not isinstance(tree, dict):
        return tree
    out = {}
    for key, sub in tree.items():
        if key == "layers" and isinstance(sub, dict) and sub:
            out[key] = _stacked_tree(sub) if stacked else _per_layer_tree(sub)
        else:
            out[key] = to_layout(sub, stacked)
    return out


def _stacked_tree(layers: dict) -> dict:
    if STACKED in layers:
        return layers
    per_layer = [layers[k] for k in sorted(layers, key=int)]
    return {STACKED: jax.tree.map(lambda *leaves: _stacked_value(list(leaves)), *per_layer)}


def _per_layer_tree(layers: dict) -> dict:
    if STACKED not in layers:
        return layers
    stacked = layers[STACKED]
    count = jax.tree.leaves(stacked)[0].shape[0]
    return {i: jax.tree.map(lambda leaf, i=i: _slice(leaf, i), stacked) for i in range(count)}


def _slice(leaf: Any, index: int) -> Any:
    if not isinstance(leaf, jax.ShapeDtypeStruct):
        return leaf[index]
    sharding = leaf.sharding
    if isinstance(sharding, jax.sharding.NamedSharding):
        spec = jax.sharding.PartitionSpec(*tuple(sharding.spec)[1:])
        sharding = jax.sharding.NamedSharding(sharding.mesh, spec)
    return jax.ShapeDtypeStruct(leaf.shape[1:], leaf.dtype, sharding=sharding)
