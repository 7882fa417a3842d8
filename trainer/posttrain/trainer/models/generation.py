"""Running a model: its forward pass (in its compute dtype) and greedy generation."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from posttrain.trainer.models import scan


def causal_mask(input_mask: jax.Array) -> jax.Array:
    """[B, T] padding mask -> [B, T, T] causal attention mask."""
    t = input_mask.shape[-1]
    causal = jnp.tril(jnp.ones((t, t), dtype=jnp.bool_))
    return causal[None] & input_mask[:, None, :].astype(jnp.bool_)


def compute_view(model: nnx.Module) -> nnx.Module:
    """``model`` as its forward pass should see it: float params held in another dtype
    than the model's compute dtype (float32 master weights of a bfloat16 run, float32
    LoRA adapters) cast to it. Called inside a traced function, so gradients flow back
    to the params in their own dtype; ``model`` itself when there is nothing to cast."""
    dtype = getattr(model, "posttrain_compute_dtype", None)
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)

    def other(x) -> bool:
        return jnp.issubdtype(x.dtype, jnp.floating) and x.dtype != dtype

    if dtype is None or not any(other(x) for x in jax.tree.leaves(params)):
        return model
    params = jax.tree.map(lambda x: x.astype(dtype) if other(x) else x, params)
    return nnx.merge(graphdef, params, rest)


def without_remat(model: nnx.Module) -> nnx.Module:
    """A view of ``model`` that does not rematerialise, for code that runs it under a
    plain ``jax.jit`` (Tunix's sampler merges the model inside its jitted decoding loop,
    where ``nnx.remat`` fails): its very Variables, so no weight is copied and an update
    of either is the other's, in modules whose Tunix remat setting is none. ``model``
    itself when it does not rematerialise."""
    remat = getattr(model.config, "remat_config", None)
    if remat is None or remat.name == "NONE":
        return model
    none = type(remat)["NONE"]
    view = nnx.merge(*nnx.split(model))  # new modules over the same Variables
    configs: dict[int, Any] = {}
    for _, module in nnx.iter_modules(view):
        config = getattr(module, "config", None)
        if getattr(config, "remat_config", None) is not None:
            if id(config) not in configs:
                configs[id(config)] = dataclasses.replace(config, remat_config=none)
            module.config = configs[id(config)]
        if getattr(module, "remat_config", None) is not None:  # Gemma's attention
            module.remat_config = none
    return view


@nnx.jit
def _forward(model, tokens, positions, mask):
    logits, _ = compute_view(model)(tokens, positions, None, mask)
    return logits.astype(jnp.float32)


def padded_inputs(input_ids: Any, input_mask: Any | None = None) -> tuple[jax.Array, ...]:
    """(tokens int32, mask bool, positions int32) ``[B, T]`` of right-padded ``input_ids``
    (no mask: every token is real)."""
    tokens = jnp.asarray(input_ids, jnp.int32)
    mask = (
        jnp.ones_like(tokens, jnp.bool_)
        if input_mask is None
        else jnp.asarray(input_mask, jnp.bool_)
    )
    positions = jnp.maximum(jnp.cumsum(mask, axis=-1) - 1, 0).astype(jnp.int32)
    return tokens, mask, positions


def forward(model: nnx.Module, input_ids: Any, input_mask: Any | None = None) -> jax.Array:
    """Float32 logits ``[B, T, V]`` for right-padded ``input_ids`` (jit-compiled)."""
    tokens, mask, positions = padded_inputs(input_ids, input_mask)
    return _forward(model, tokens, positions, causal_mask(mask))


def init_cache(model: nnx.Module, batch_size: int, cache_size: int, dtype: Any = None) -> dict:
    """An empty KV cache in the layout Tunix's attention layers update."""
    cfg = model.config
    if dtype is None:
        dtype = getattr(model, "posttrain_compute_dtype", None)
    if dtype is None:
        dtype = model.embedder.input_embedding.get_value().dtype
    shape = (batch_size, cache_size, cfg.num_kv_heads, cfg.head_dim)
    if scan.is_stacked(model):
        return scan.init_cache(cfg.num_layers, shape, batch_size, dtype)
    return {
        f"layer_{i}": {
            "k": jnp.zeros(shape, dtype),
            "v": jnp.zeros(shape, dtype),
            "end_index": jnp.zeros((batch_size,), jnp.int32),
        }
        for i in range(cfg.num_layers)
    }


@nnx.jit
def next_logits(model, tokens, positions, cache, mask):
    """One forward pass over the KV cache (a prefill or a decoding step): float32 logits
    of each row's last position ``[B, V]`` and the updated cache."""
    logits, cache = compute_view(model)(tokens, positions, cache, mask)
    return logits[:, -1].astype(jnp.float32), cache


@dataclasses.dataclass
class Generation:
    token_ids: list[int]
    text: str | None


def greedy_generate(
    model: nnx.Module,
    tokenizer: Any,
    prompt_ids: Sequence[int],
    max_new_tokens: int,
    *,
    eos_token_ids: Iterable[int] = (),
) -> Generation:
    """Greedy decoding of one prompt with Tunix's KV cache (prefill + one token a step).

    ``tokenizer`` (a ``tokenizers.Tokenizer`` or anything with ``decode``) only decodes
    the result; pass None to get ids alone. Stops at ``eos_token_ids``.
    """
    put = beside_params(model)
    prompt = np.asarray(prompt_ids, np.int32)[None]
    length = prompt.shape[1]
    size = length + max_new_tokens
    cache = put(init_cache(model, 1, size))
    slots = np.arange(size)
    step = nnx.cached_partial(next_logits, model)
    mask = (slots[None, :] <= np.arange(length)[:, None])[None]
    logits, cache = step(*put((prompt, np.arange(length, dtype=np.int32)[None])), cache, put(mask))
    token = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    stop = set(eos_token_ids)
    out: list[int] = []
    for i in range(max_new_tokens):
        tok = int(on_host(token)[0])
        out.append(tok)
        if tok in stop or i == max_new_tokens - 1:
            break
        pos = length + i
        mask = (slots <= pos)[None, None, :]
        tokens, positions, mask = put(
            (on_host(token)[:, None], np.full((1, 1), pos, np.int32), mask)
        )
        logits, cache = step(tokens, positions, cache, mask)
        token = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    text = None
    if tokenizer is not None:
        text = tokenizer.decode([t for t in out if t not in stop])
    return Generation(out, text)


def beside_params(model: nnx.Module):
    """Puts host values (a pytree) where the model's params are. One process: as they are.
    Params spanning several processes (a multi-host mesh): replicated over the params'
    mesh, each process giving its own copy (every process decodes the same prompt), so
    one jit runs over every host's devices."""
    leaf = jax.tree.leaves(nnx.state(model, nnx.Param))[0]
    sharding = getattr(leaf, "sharding", None)
    if jax.process_count() == 1 or not isinstance(sharding, NamedSharding):
        return lambda tree: tree
    replicated = NamedSharding(sharding.mesh, PartitionSpec())

    def global_array(value: Any) -> jax.Array:
        host = np.asarray(value)
        return jax.make_array_from_callback(host.shape, replicated, lambda index: host[index])

    return lambda tree: jax.tree.map(global_array, tree)


def on_host(value: jax.Array) -> np.ndarray:
    """A (possibly multi-host) array's whole value on this host."""
    if value.is_fully_addressable or value.is_fully_replicated:
        return np.asarray(value)
    from jax.experimental import multihost_utils

    return np.asarray(multihost_utils.process_allgather(value, tiled=True))
