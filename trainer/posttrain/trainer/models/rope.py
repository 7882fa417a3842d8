"""RoPE as ``config.json`` says it, for Tunix's llama3 and qwen3 attention.

Tunix 0.1.7's llama3 and qwen3 attention ignore ``ModelConfig.rope_theta`` (they always
use 1e6) and know no RoPE scaling. This module computes the inverse frequencies from
``config.json`` exactly as ``transformers`` does and feeds them to those two models: their
``apply_rope`` is wrapped (``_install_rope_patch``, on import) to rotate with the
frequencies of the posttrain model that is running, and ``Llama3`` / ``Qwen3`` are the
Tunix classes that set them while they run.
"""

from __future__ import annotations

import contextvars
import math
from collections.abc import Callable
from typing import Any

import jax.numpy as jnp
import numpy as np
from tunix.models.llama3 import model as llama3_lib
from tunix.models.qwen3 import model as qwen3_lib

_ROPE_INV_FREQ: contextvars.ContextVar[tuple[float, ...] | None] = contextvars.ContextVar(
    "posttrain_rope_inv_freq", default=None
)


def _make_rope_fn(original: Callable[..., Any]) -> Callable[..., Any]:
    """Wraps a Tunix ``apply_rope(inputs, positions, head_dim, rope_theta=1e6)``.

    While a posttrain model runs (``_ROPE_INV_FREQ`` set), it rotates with that model's
    inverse frequencies, computed as ``transformers`` computes them; otherwise it is the
    original function, so other users of Tunix see no change.
    """

    def apply_rope(inputs, positions, head_dim, rope_theta=1_000_000):
        inv_freq = _ROPE_INV_FREQ.get()
        if inv_freq is None:
            return original(inputs, positions, head_dim=head_dim, rope_theta=rope_theta)
        if len(inv_freq) != head_dim // 2:
            raise ValueError(f"RoPE: {len(inv_freq)} frequencies for head_dim {head_dim}")
        freqs = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq, jnp.float32)
        freqs = freqs[..., None, :]  # [B, T, 1, head_dim/2]
        sin = jnp.sin(freqs).astype(inputs.dtype)
        cos = jnp.cos(freqs).astype(inputs.dtype)
        first, second = jnp.split(inputs, 2, axis=-1)
        out = jnp.concatenate([first * cos - second * sin, second * cos + first * sin], axis=-1)
        return out.astype(inputs.dtype)

    apply_rope._posttrain_original = original  # type: ignore[attr-defined]
    return apply_rope


def _install_rope_patch() -> None:
    for lib in (llama3_lib, qwen3_lib):
        if not hasattr(lib.apply_rope, "_posttrain_original"):
            lib.apply_rope = _make_rope_fn(lib.apply_rope)


_install_rope_patch()


class _RopeFromConfig:
    """Mixin: runs the Tunix model with the RoPE frequencies of its HF config."""

    posttrain_rope_inv_freq: tuple[float, ...] | None = None

    def __call__(self, *args, **kwargs):
        token = _ROPE_INV_FREQ.set(self.posttrain_rope_inv_freq)
        try:
            return super().__call__(*args, **kwargs)  # type: ignore[misc]
        finally:
            _ROPE_INV_FREQ.reset(token)


class Llama3(_RopeFromConfig, llama3_lib.Llama3):
    """Tunix Llama3 with the RoPE frequencies of config.json (Tunix ignores rope_theta)."""


class Qwen3(_RopeFromConfig, qwen3_lib.Qwen3):
    """Tunix Qwen3 with the RoPE frequencies of config.json (Tunix ignores rope_theta)."""


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
