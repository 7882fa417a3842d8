"""RoPE as ``config.json`` says it, for Tunix's llama3 and qwen3 attention.

Tunix 0.1.7's llama3 and qwen3 attention ignore ``ModelConfig.rope_theta`` (they always
use 1e6) and know no RoPE scaling. This module computes the inverse frequencies from
``config.json`` exactly as ``transformers`` does (``rope_inv_freq``) and hands them to each
attention layer of the two models:

- ``Llama3`` and ``Qwen3`` are the Tunix models built with ``rope_inv_freq=``: they make
  each decoder layer's attention a ``Llama3Attention`` / ``Qwen3Attention`` (a subclass
  of Tunix's attention class) holding the frequencies in its static attribute
  ``rope_inv_freq``, part of the model's graph definition, so ``nnx.split``/``merge``,
  LoRA and copies of the model keep them;
- Tunix's ``Attention.block`` rotates with the ``apply_rope`` of its module's globals.
  The subclasses' ``block`` runs Tunix's very ``block`` code from a copy of the function
  whose globals differ in that one name, bound to ``rotate`` with the layer's
  frequencies (``_rotating_block``). Nothing global is patched and no state is read at
  run time: a Tunix model built by anyone else rotates as Tunix does.
"""

from __future__ import annotations

import functools
import math
import types
from collections.abc import Callable
from typing import Any

import jax.numpy as jnp
import numpy as np
from tunix.models.llama3 import model as llama3_lib
from tunix.models.qwen3 import model as qwen3_lib


def rotate(inputs, positions, head_dim, rope_theta=None, *, inv_freq: tuple[float, ...]):
    """RoPE of ``inputs`` [B, T, heads, head_dim] at ``positions`` [B, T] with
    ``inv_freq`` (Tunix's ``apply_rope`` arguments; its ``rope_theta`` is ignored)."""
    if len(inv_freq) != head_dim // 2:
        raise ValueError(f"RoPE: {len(inv_freq)} frequencies for head_dim {head_dim}")
    freqs = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq, jnp.float32)
    freqs = freqs[..., None, :]  # [B, T, 1, head_dim/2]
    sin = jnp.sin(freqs).astype(inputs.dtype)
    cos = jnp.cos(freqs).astype(inputs.dtype)
    first, second = jnp.split(inputs, 2, axis=-1)
    out = jnp.concatenate([first * cos - second * sin, second * cos + first * sin], axis=-1)
    return out.astype(inputs.dtype)


@functools.cache
def _rotating_block(block: Callable[..., Any], inv_freq: tuple[float, ...]) -> Callable:
    """Tunix's ``Attention.block`` with its global ``apply_rope`` bound to ``rotate``."""
    namespace = {**block.__globals__, "apply_rope": functools.partial(rotate, inv_freq=inv_freq)}
    return types.FunctionType(
        block.__code__, namespace, block.__name__, block.__defaults__, block.__closure__
    )


def _rotating(tunix_attention: type) -> Callable[..., Any]:
    """A ``block`` method: Tunix's, rotating with the layer's ``rope_inv_freq``."""

    def block(self, *args, **kwargs):
        rotating = _rotating_block(tunix_attention.block, self.rope_inv_freq)
        return rotating(self, *args, **kwargs)

    return block


class Llama3Attention(llama3_lib.Attention):
    """Tunix's llama3 attention rotating with its ``rope_inv_freq`` (config.json's)."""

    rope_inv_freq: tuple[float, ...]
    block = _rotating(llama3_lib.Attention)


class Qwen3Attention(qwen3_lib.Attention):
    """Tunix's qwen3 attention rotating with its ``rope_inv_freq`` (config.json's)."""

    rope_inv_freq: tuple[float, ...]
    block = _rotating(qwen3_lib.Attention)


for _tunix in (llama3_lib, qwen3_lib):  # a Tunix whose attention rotates otherwise
    if "apply_rope" not in _tunix.Attention.block.__code__.co_names:
        raise ImportError(f"posttrain: {_tunix.__name__}.Attention.block calls no apply_rope")


class _RopeFromConfig:
    """Mixin over a Tunix model: its attention layers rotate with ``rope_inv_freq``
    (None: as Tunix does)."""

    _attention: type

    def __init__(self, config, *, rngs, rope_inv_freq: tuple[float, ...] | None = None):
        super().__init__(config, rngs=rngs)  # type: ignore[call-arg]
        if rope_inv_freq is None:
            return
        for layer in self.layers:  # type: ignore[attr-defined]
            layer.attn.__class__ = self._attention
            layer.attn.rope_inv_freq = tuple(float(f) for f in rope_inv_freq)


class Llama3(_RopeFromConfig, llama3_lib.Llama3):
    """Tunix Llama3 with the RoPE frequencies of config.json (Tunix ignores rope_theta)."""

    _attention = Llama3Attention


class Qwen3(_RopeFromConfig, qwen3_lib.Qwen3):
    """Tunix Qwen3 with the RoPE frequencies of config.json (Tunix ignores rope_theta)."""

    _attention = Qwen3Attention


def rope_inv_freq(theta: float, head_dim: int, scaling: dict | None = None) -> np.ndarray:
    """Inverse RoPE frequencies as ``transformers`` computes them (float32)."""
    exponent = np.arange(0, head_dim, 2, dtype=np.int64).astype(np.float32) / np.float32(head_dim)
    inv = (np.float32(1.0) / (np.float32(theta) ** exponent)).astype(np.float32)
    rope_type = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    if rope_type in (None, "default"):
        return inv
    if rope_type == "linear":
        return (inv / np.float32(scaling["factor"])).astype(np.float32)
    if rope_type == "llama3":
        factor = float(scaling["factor"])
        low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
        old_len = float(scaling["original_max_position_embeddings"])
        low_wavelen, high_wavelen = old_len / low, old_len / high
        wavelen = np.float32(2 * math.pi) / inv
        scaled = np.where(wavelen > low_wavelen, inv / np.float32(factor), inv)
        smooth = (old_len / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * scaled / factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
        return np.where(medium, smoothed, scaled).astype(np.float32)
    raise ValueError(
        f"spec.model: RoPE scaling type {rope_type!r} is not supported "
        "(supported: default, linear, llama3)"
    )


def rope_of(hf: dict, layer_type: str | None = None, default_theta: float = 10000.0):
    """(theta, scaling dict or None) from either config.json layout.

    transformers >= 5 writes ``rope_parameters`` (per layer type for Gemma3); older files
    have ``rope_theta`` + ``rope_scaling`` (+ ``rope_local_base_freq`` for Gemma3).
    """
    params = hf.get("rope_parameters")
    if isinstance(params, dict):
        if layer_type is not None and isinstance(params.get(layer_type), dict):
            params = params[layer_type]
        if params.get("rope_theta") is not None:
            kind = params.get("rope_type", params.get("type", "default"))
            return float(params["rope_theta"]), (None if kind == "default" else dict(params))
    if layer_type == "sliding_attention" and "rope_local_base_freq" in hf:
        return float(hf["rope_local_base_freq"]), None
    scaling = hf.get("rope_scaling")
    if scaling and scaling.get("rope_type", scaling.get("type", "default")) == "default":
        scaling = None
    return float(hf.get("rope_theta", default_theta)), scaling
