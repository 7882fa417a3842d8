"""Model loading for the trainer: Hugging Face safetensors -> Tunix nnx models, and back.

Families: ``llama3``, ``qwen2``, ``qwen3``, ``gemma2``, ``gemma3`` (``auto`` reads the HF
``config.json``). The model code is Tunix's (``tunix.models.<family>.model``); the Tunix
``ModelConfig`` is built from ``config.json`` here, and the weights are loaded by this
module rather than by Tunix's ``create_model_from_safe_tensors``, because that one reads
every tensor whole on every host and ``device_put``s it. Here each parameter is built with
``jax.make_array_from_callback`` on the mesh with the parameter's own sharding, and the
callback reads only the slice that the local device needs (``safe_open(...).get_slice``),
so every host reads only its own shards.

Two Tunix gaps are closed here (see ``_install_rope_patch``): Tunix 0.1.7's llama3 and
qwen3 attention ignore ``ModelConfig.rope_theta`` (they always use 1e6) and know no RoPE
scaling; this module computes the inverse frequencies from ``config.json`` exactly as
``transformers`` does and feeds them to those two models.

LoRA (qwix) and the PEFT adapter format live in ``posttrain.trainer.lora`` and are
re-exported here: ``default_lora_targets``, ``apply_lora``, ``save_peft_adapter``,
``load_peft_adapter``, ``lora_module_paths``.

Nothing here imports Kubernetes code.
"""

from __future__ import annotations

import contextvars
import dataclasses
import json
import logging
import math
import os
import shutil
import struct
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes  # noqa: F401  (registers bfloat16 with numpy for safetensors' numpy reader)
import numpy as np
from flax import nnx
from safetensors import safe_open
from tunix.models.gemma import model as gemma2_lib
from tunix.models.gemma3 import model as gemma3_lib
from tunix.models.llama3 import model as llama3_lib
from tunix.models.qwen2 import model as qwen2_lib
from tunix.models.qwen3 import model as qwen3_lib

from posttrain.trainer import storage
from posttrain.trainer.gcs_safetensors import GcsSafetensors
from posttrain.trainer.mesh import make_mesh, shard_batch_over_slices

log = logging.getLogger(__name__)

FAMILIES = ("llama3", "qwen2", "qwen3", "gemma2", "gemma3")

# HF `model_type` / `architectures` -> family.
_MODEL_TYPES = {
    "llama": "llama3",
    "qwen2": "qwen2",
    "qwen3": "qwen3",
    "gemma2": "gemma2",
    "gemma3_text": "gemma3",
    "gemma3": "gemma3",
}
_ARCHITECTURES = {
    "LlamaForCausalLM": "llama3",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Gemma2ForCausalLM": "gemma2",
    "Gemma3ForCausalLM": "gemma3",
    "Gemma3ForConditionalGeneration": "gemma3",
}
_HF_ARCH_OUT = {
    "llama3": ("LlamaForCausalLM", "llama"),
    "qwen2": ("Qwen2ForCausalLM", "qwen2"),
    "qwen3": ("Qwen3ForCausalLM", "qwen3"),
    "gemma2": ("Gemma2ForCausalLM", "gemma2"),
    "gemma3": ("Gemma3ForCausalLM", "gemma3_text"),
}
# Files copied next to the weights by save_hf.
_TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "generation_config.json",
    "chat_template.jinja",
    "chat_template.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "added_tokens.json",
)


# ---------------------------------------------------------------------------------------
# RoPE: the inverse frequencies of config.json, fed to Tunix's llama3 / qwen3 attention.
# ---------------------------------------------------------------------------------------

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


def _rope_of(hf: dict, layer_type: str | None = None, default_theta: float = 10000.0):
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


# ---------------------------------------------------------------------------------------
# Config: config.json -> Tunix ModelConfig
# ---------------------------------------------------------------------------------------


@dataclasses.dataclass
class ModelInfo:
    """What the loader learnt about a checkpoint; needed to save it back."""

    family: str
    model_dir: str
    hf_config: dict  # the (text) config.json used, as written by save_hf
    config: Any  # the Tunix ModelConfig
    dtype: Any  # of the loaded params
    num_layers: int
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    tie_word_embeddings: bool
    hf_prefix: str = "model."  # prefix of the decoder's tensors in the checkpoint
    layer_types: tuple[str, ...] = ()
    eos_token_ids: tuple[int, ...] = ()
    compute_dtype: Any = None  # of the forward pass (see compute_view)


def read_hf_config(model_dir: str | os.PathLike) -> dict:
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"spec.model.source: no config.json in {model_dir}")
    return json.loads(path.read_text())


def detect_family(model_dir: str | os.PathLike) -> str:
    """Family of a HF checkpoint from config.json ``model_type`` (or ``architectures``)."""
    cfg = read_hf_config(model_dir)
    family = _MODEL_TYPES.get(cfg.get("model_type", ""))
    if family is None:
        for arch in cfg.get("architectures") or ():
            family = _ARCHITECTURES.get(arch)
            if family:
                break
    if family is None:
        raise ValueError(
            f"spec.model.family: cannot detect the family of {model_dir} "
            f"(model_type={cfg.get('model_type')!r}, architectures={cfg.get('architectures')}); "
            f"supported: {', '.join(FAMILIES)}; set spec.model.family explicitly"
        )
    return family


def _text_config(cfg: dict) -> dict:
    if cfg.get("model_type") == "gemma3" and isinstance(cfg.get("text_config"), dict):
        text = dict(cfg["text_config"])
        text.setdefault("model_type", "gemma3_text")
        return text
    return cfg


def _unsupported(family: str, what: str) -> ValueError:
    return ValueError(f"spec.model: {family} checkpoint uses {what}, which posttrain cannot load")


def _eos_ids(model_dir: Path, hf: dict) -> tuple[int, ...]:
    eos: Any = None
    gen = model_dir / "generation_config.json"
    if gen.is_file():
        eos = json.loads(gen.read_text()).get("eos_token_id")
    if eos is None:
        eos = hf.get("eos_token_id")
    if eos is None:
        return ()
    return tuple(eos) if isinstance(eos, list) else (int(eos),)


def _layer_types(hf: dict, family: str, n: int) -> tuple[str, ...]:
    types = hf.get("layer_types")
    if types:
        return tuple(types)
    if family == "gemma2":  # sliding on even layers
        return tuple("sliding_attention" if i % 2 == 0 else "full_attention" for i in range(n))
    if family == "gemma3":
        pattern = hf.get("sliding_window_pattern", hf.get("_sliding_window_pattern", 6))
        return tuple(
            "sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(n)
        )
    return ("full_attention",) * n


def build_config(
    family: str, hf: dict, dtype: Any = jnp.float32, compute_dtype: Any = None
) -> tuple[Any, dict]:
    """Tunix ``ModelConfig`` for ``family`` from a HF config dict, params in ``dtype``.

    ``compute_dtype`` (default ``dtype``) is the dtype of the forward pass: Qwen's config
    says it (its layers cast params and inputs to it); the other families compute in the
    dtype of what they are given, so ``compute_view`` casts their params.

    Returns (ModelConfig, extras) where extras holds what the Tunix config cannot say
    (RoPE inverse frequencies, per-layer attention types).
    """
    if family not in FAMILIES:
        raise ValueError(f"spec.model.family: {family!r} is not one of {', '.join(FAMILIES)}")
    compute_dtype = dtype if compute_dtype is None else compute_dtype
    n = int(hf["num_hidden_layers"])
    d = int(hf["hidden_size"])
    heads = int(hf["num_attention_heads"])
    kv = int(hf.get("num_key_value_heads") or heads)
    head_dim = int(hf.get("head_dim") or d // heads)
    ffw = int(hf["intermediate_size"])
    vocab = int(hf["vocab_size"])
    eps = float(hf.get("rms_norm_eps", 1e-6))
    tie = bool(hf.get("tie_word_embeddings", family.startswith("gemma")))
    layer_types = _layer_types(hf, family, n)
    extras: dict[str, Any] = {"layer_types": layer_types}

    if family in ("llama3", "qwen2", "qwen3"):
        act = hf.get("hidden_act", "silu")
        if act != "silu":
            raise _unsupported(family, f"hidden_act={act!r}")
        if hf.get("mlp_bias"):
            raise _unsupported(family, "mlp_bias")
        if family != "qwen2" and hf.get("attention_bias"):
            raise _unsupported(family, "attention_bias")
        if any(t != "full_attention" for t in layer_types) or hf.get("use_sliding_window"):
            raise _unsupported(family, "sliding-window attention")
        theta, scaling = _rope_of(hf)
        common = dict(
            num_layers=n,
            vocab_size=vocab,
            embed_dim=d,
            hidden_dim=ffw,
            num_heads=heads,
            head_dim=head_dim,
            num_kv_heads=kv,
            rope_theta=theta,
            norm_eps=eps,
        )
        if family == "llama3":
            cfg = llama3_lib.ModelConfig(**common, weight_tying=tie)
            extras["rope_inv_freq"] = tuple(
                float(x) for x in rope_inv_freq(theta, head_dim, scaling)
            )
        elif family == "qwen2":
            if scaling:
                raise _unsupported(family, f"rope scaling {scaling}")
            cfg = qwen2_lib.ModelConfig(
                **common, use_tied_embedding=tie, dtype=compute_dtype, param_dtype=dtype
            )
        else:
            if hf.get("num_experts"):
                raise _unsupported(family, "mixture of experts")
            cfg = qwen3_lib.ModelConfig(
                **common, use_tied_embedding=tie, dtype=compute_dtype, param_dtype=dtype
            )
            extras["rope_inv_freq"] = tuple(
                float(x) for x in rope_inv_freq(theta, head_dim, scaling)
            )
        return cfg, extras

    # Gemma 2 / 3
    act = hf.get("hidden_activation") or hf.get("hidden_act") or "gelu_pytorch_tanh"
    if act != "gelu_pytorch_tanh":
        raise _unsupported(family, f"hidden_activation={act!r}")
    if not tie:
        raise _unsupported(family, "untied embeddings")
    if abs(eps - 1e-6) > 1e-12:
        raise _unsupported(family, f"rms_norm_eps={eps} (Tunix Gemma uses 1e-6)")
    if hf.get("attention_bias"):
        raise _unsupported(family, "attention_bias")
    scalar = float(hf.get("query_pre_attn_scalar") or head_dim)
    window = hf.get("sliding_window")
    if family == "gemma2":
        theta, scaling = _rope_of(hf)
        if theta != 10000.0 or scaling:
            raise _unsupported(family, f"rope_theta={theta}, scaling={scaling}")
        if scalar != head_dim:
            raise _unsupported(family, f"query_pre_attn_scalar={scalar} != head_dim {head_dim}")
        types = tuple(
            gemma2_lib.AttentionType.LOCAL_SLIDING
            if t == "sliding_attention"
            else gemma2_lib.AttentionType.GLOBAL
            for t in layer_types
        )
        cfg = gemma2_lib.ModelConfig(
            num_layers=n,
            num_embed=vocab,
            embed_dim=d,
            hidden_dim=ffw,
            num_heads=heads,
            head_dim=head_dim,
            num_kv_heads=kv,
            final_logit_softcap=hf.get("final_logit_softcapping"),
            use_post_attn_norm=True,
            use_post_ffw_norm=True,
            attention_types=types,
            attn_logits_soft_cap=hf.get("attn_logit_softcapping"),
            sliding_window_size=window,
        )
        return cfg, extras

    if hf.get("final_logit_softcapping") or hf.get("attn_logit_softcapping"):
        raise _unsupported(family, "logit soft-capping")
    if hf.get("use_bidirectional_attention"):
        raise _unsupported(family, "bidirectional attention")
    qnorm = gemma3_lib.QueryPreAttentionNormalisation
    if scalar == head_dim:
        query_norm = qnorm.BY_ONE_OVER_SQRT_HEAD_DIM
    elif scalar == d // heads:
        query_norm = qnorm.BY_ONE_OVER_SQRT_EMBED_DIM_DIV_NUM_HEADS
    else:
        raise _unsupported(family, f"query_pre_attn_scalar={scalar}")
    local_theta, local_scaling = _rope_of(hf, "sliding_attention")
    global_theta, global_scaling = _rope_of(hf, "full_attention", default_theta=1_000_000.0)

    def _linear_factor(scaling: dict | None) -> float:
        if not scaling:
            return 1.0
        if scaling.get("rope_type", scaling.get("type")) != "linear":
            raise _unsupported(family, f"rope scaling {scaling}")
        return float(scaling["factor"])

    cfg = gemma3_lib.ModelConfig(
        num_layers=n,
        num_embed=vocab,
        embed_dim=d,
        hidden_dim=ffw,
        num_heads=heads,
        head_dim=head_dim,
        num_kv_heads=kv,
        sliding_window_size=window,
        local_base_frequency=local_theta,
        global_base_frequency=global_theta,
        local_scale_factor=_linear_factor(local_scaling),
        global_scale_factor=_linear_factor(global_scaling),
        query_pre_attn_norm=query_norm,
        param_dtype=dtype,
    )
    return cfg, extras


def _model_class(family: str):
    return {
        "llama3": Llama3,
        "qwen2": qwen2_lib.Qwen2,
        "qwen3": Qwen3,
        "gemma2": gemma2_lib.Gemma,
        "gemma3": gemma3_lib.Gemma3,
    }[family]


def _configure(model: nnx.Module, info: ModelInfo, extras: dict) -> None:
    """Static settings the Tunix constructor cannot take (set on the abstract model)."""
    model.posttrain_compute_dtype = info.compute_dtype
    if "rope_inv_freq" in extras:
        model.posttrain_rope_inv_freq = extras["rope_inv_freq"]
    if info.family == "gemma3":  # Tunix hard-codes a 5 local : 1 global pattern
        cfg = info.config
        for layer, kind in zip(model.layers, info.layer_types, strict=True):
            local = kind == "sliding_attention"
            attn = layer.attn
            attn.attn_type = (
                gemma3_lib.AttentionType.LOCAL_SLIDING if local else gemma3_lib.AttentionType.GLOBAL
            )
            attn.rope_base_frequency = (
                cfg.local_base_frequency if local else cfg.global_base_frequency
            )
            attn.rope_scale_factor = cfg.local_scale_factor if local else cfg.global_scale_factor


# ---------------------------------------------------------------------------------------
# Parameter mapping: HF tensor(s) <-> one Tunix parameter
# ---------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class ParamMap:
    """One Tunix param made from HF tensor(s).

    Each source is an HF tensor whose axes split into ``split`` groups (e.g. q_proj
    ``[N*H, D]`` -> ``((N, H), (D,))``); the split tensor is transposed by ``perm`` to the
    Tunix layout. With several sources, the results are stacked on a new leading axis
    (Gemma's ``kv_einsum`` = stack(k, v)).
    """

    path: tuple
    sources: tuple[str, ...]
    split: tuple[tuple[int, ...], ...]
    perm: tuple[int, ...]

    @property
    def hf_shape(self) -> tuple[int, ...]:
        return tuple(math.prod(g) for g in self.split)

    @property
    def split_shape(self) -> tuple[int, ...]:
        return tuple(d for g in self.split for d in g)

    @property
    def shape(self) -> tuple[int, ...]:
        one = tuple(self.split_shape[p] for p in self.perm)
        return (len(self.sources), *one) if len(self.sources) > 1 else one

    def read(self, get: Callable[[str], Any], index: tuple[slice, ...]) -> np.ndarray:
        """The block ``index`` of the Tunix param, reading only what it needs."""
        index = tuple(
            slice(*s.indices(dim))
            for s, dim in zip(_pad_index(index, len(self.shape)), self.shape, strict=True)
        )
        if len(self.sources) > 1:
            names = self.sources[index[0]]
            return np.stack([self._read_one(get(n), index[1:]) for n in names])
        return self._read_one(get(self.sources[0]), index)

    def _read_one(self, tensor: Any, index: tuple[slice, ...]) -> np.ndarray:
        split_index: list[slice] = [slice(None)] * len(self.perm)
        for j, p in enumerate(self.perm):
            split_index[p] = index[j]
        hf_index, block_shape, post = [], [], []
        k = 0
        for group in self.split:
            outer = split_index[k]
            inner = math.prod(group[1:])
            hf_index.append(slice(outer.start * inner, outer.stop * inner))
            block_shape.extend([outer.stop - outer.start, *group[1:]])
            post.extend([slice(None), *split_index[k + 1 : k + len(group)]])
            k += len(group)
        block = np.asarray(tensor[tuple(hf_index)]).reshape(block_shape)
        return block[tuple(post)].transpose(self.perm)

    def to_hf(self, value: np.ndarray) -> dict[str, np.ndarray]:
        """The HF tensor(s) of a full Tunix param value."""
        inverse = tuple(np.argsort(self.perm))
        parts = value if len(self.sources) > 1 else [value]
        return {
            name: np.ascontiguousarray(np.asarray(part).transpose(inverse).reshape(self.hf_shape))
            for name, part in zip(self.sources, parts, strict=True)
        }


def _pad_index(index: tuple, ndim: int) -> tuple:
    index = tuple(index) if isinstance(index, tuple) else (index,)
    return index + (slice(None),) * (ndim - len(index))


def param_maps(info: ModelInfo) -> list[ParamMap]:
    """Every Tunix param of the family and the HF tensor(s) it is made of."""
    p, fam = info.hf_prefix, info.family
    d, n, k, h = info.hidden_size, info.num_heads, info.num_kv_heads, info.head_dim
    f, v = info.intermediate_size, info.vocab_size
    maps = [
        ParamMap(
            ("embedder", "input_embedding"), (f"{p}embed_tokens.weight",), ((v,), (d,)), (0, 1)
        )
    ]
    gemma = fam.startswith("gemma")
    for i in range(info.num_layers):
        hf, t = f"{p}layers.{i}.", ("layers", i)

        def vec(path: tuple, name: str, size: int, hf=hf, t=t) -> ParamMap:
            return ParamMap(t + path, (hf + name,), ((size,),), (0,))

        mlp = [
            ParamMap(
                t + ("mlp", "gate_proj", "kernel"),
                (hf + "mlp.gate_proj.weight",),
                ((f,), (d,)),
                (1, 0),
            ),
            ParamMap(
                t + ("mlp", "up_proj", "kernel"), (hf + "mlp.up_proj.weight",), ((f,), (d,)), (1, 0)
            ),
            ParamMap(
                t + ("mlp", "down_proj", "kernel"),
                (hf + "mlp.down_proj.weight",),
                ((d,), (f,)),
                (1, 0),
            ),
        ]
        q, kk, vv, o = (hf + f"self_attn.{x}_proj.weight" for x in "qkvo")
        if not gemma:
            maps += [
                ParamMap(t + ("attn", "q_proj", "w"), (q,), ((n, h), (d,)), (2, 0, 1)),
                ParamMap(t + ("attn", "k_proj", "w"), (kk,), ((k, h), (d,)), (2, 0, 1)),
                ParamMap(t + ("attn", "v_proj", "w"), (vv,), ((k, h), (d,)), (2, 0, 1)),
                ParamMap(t + ("attn", "o_proj", "w"), (o,), ((d,), (n, h)), (1, 2, 0)),
                *mlp,
                vec(("input_layernorm", "w"), "input_layernorm.weight", d),
                vec(("post_attention_layernorm", "w"), "post_attention_layernorm.weight", d),
            ]
            if fam == "qwen2":
                maps += [
                    vec(("attn", "q_bias"), "self_attn.q_proj.bias", n * h),
                    vec(("attn", "k_bias"), "self_attn.k_proj.bias", k * h),
                    vec(("attn", "v_bias"), "self_attn.v_proj.bias", k * h),
                ]
            if fam == "qwen3":
                maps += [
                    vec(("attn", "q_norm", "w"), "self_attn.q_norm.weight", h),
                    vec(("attn", "k_norm", "w"), "self_attn.k_norm.weight", h),
                ]
            continue
        if n == k:
            maps.append(
                ParamMap(t + ("attn", "qkv_einsum", "w"), (q, kk, vv), ((n, h), (d,)), (0, 2, 1))
            )
        else:
            maps += [
                ParamMap(t + ("attn", "q_einsum", "w"), (q,), ((n, h), (d,)), (0, 2, 1)),
                ParamMap(t + ("attn", "kv_einsum", "w"), (kk, vv), ((k, h), (d,)), (0, 2, 1)),
            ]
        post_attn = "post_attn_norm" if fam == "gemma2" else "post_attention_norm"
        maps += [
            ParamMap(t + ("attn", "attn_vec_einsum", "w"), (o,), ((d,), (n, h)), (1, 2, 0)),
            *mlp,
            vec(("pre_attention_norm", "scale"), "input_layernorm.weight", d),
            vec((post_attn, "scale"), "post_attention_layernorm.weight", d),
            vec(("pre_ffw_norm", "scale"), "pre_feedforward_layernorm.weight", d),
            vec(("post_ffw_norm", "scale"), "post_feedforward_layernorm.weight", d),
        ]
        if fam == "gemma3":
            maps += [
                vec(("attn", "_query_norm", "scale"), "self_attn.q_norm.weight", h),
                vec(("attn", "_key_norm", "scale"), "self_attn.k_norm.weight", h),
            ]
    norm = ("final_norm", "scale") if gemma else ("final_norm", "w")
    maps.append(ParamMap(norm, (f"{p}norm.weight",), ((d,),), (0,)))
    if not info.tie_word_embeddings:
        head = (
            "language_model.lm_head.weight" if p.startswith("language_model.") else "lm_head.weight"
        )
        maps.append(ParamMap(("lm_head", "w"), (head,), ((v,), (d,)), (1, 0)))
    return maps


# ---------------------------------------------------------------------------------------
# Reading safetensors lazily
# ---------------------------------------------------------------------------------------


class _SafetensorsDir:
    """Tensor name -> lazy slice over all ``*.safetensors`` files of a directory (local, or
    gs:// read with ranged requests)."""

    def __init__(self, model_dir: str):
        index = storage.join(model_dir, "model.safetensors.index.json")
        if storage.exists(index):
            weight_map = json.loads(storage.read_text(index))["weight_map"]
            files = sorted({storage.join(model_dir, f) for f in weight_map.values()})
        else:
            files = [
                f
                for f in storage.list_uri(model_dir)
                if f.endswith(".safetensors") and storage.basename(f) != "adapter_model.safetensors"
            ]
        if not files:
            raise FileNotFoundError(f"spec.model.source: no *.safetensors files in {model_dir}")
        self._handles = [
            GcsSafetensors(f) if storage.is_gcs(f) else safe_open(f, framework="numpy")
            for f in files
        ]
        self._where: dict[str, Any] = {}
        for handle in self._handles:
            for name in handle.keys():  # noqa: SIM118 (safe_open is not iterable)
                self._where[name] = handle
        self._slices: dict[str, Any] = {}

    def keys(self) -> set[str]:
        return set(self._where)

    def fetched(self) -> tuple[int, int] | None:
        """(bytes fetched, total bytes) of the files on gs://; None for local files."""
        remote = [h for h in self._handles if isinstance(h, GcsSafetensors)]
        if not remote:
            return None
        return sum(h.bytes_read for h in remote), sum(h.size for h in remote)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.get(name).get_shape())

    def get(self, name: str):
        if name not in self._slices:
            self._slices[name] = self._where[name].get_slice(name)
        return self._slices[name]

    def close(self) -> None:
        self._slices.clear()
        for handle in self._handles:
            exit_ = getattr(handle, "__exit__", None)
            if exit_ is not None:
                exit_(None, None, None)


def _detect_prefix(keys: set[str]) -> str:
    for prefix in ("model.", "model.language_model.", "language_model.model."):
        if f"{prefix}embed_tokens.weight" in keys:
            return prefix
    raise ValueError("spec.model.source: no embed_tokens.weight tensor in the checkpoint")


# ---------------------------------------------------------------------------------------
# Sharding (the mesh: posttrain.trainer.mesh)
# ---------------------------------------------------------------------------------------


def _fit_spec(spec: Sequence[Any], shape: tuple[int, ...], mesh) -> tuple:
    """Drops the mesh axes of dimensions they do not divide (those dims are replicated)."""
    spec = tuple(spec) + (None,) * (len(shape) - len(spec))
    out = []
    for axes, dim in zip(spec, shape, strict=True):
        names = () if axes is None else (axes if isinstance(axes, tuple) else (axes,))
        names = tuple(a for a in names if a in mesh.shape)
        size = math.prod(mesh.shape[a] for a in names)
        if not names or dim % size:
            out.append(None)
        else:
            out.append(names[0] if len(names) == 1 else names)
    return tuple(out)


def _sharding_metadata_key(var: nnx.Variable) -> str | None:
    meta = var.get_metadata()
    for key in ("out_sharding", "sharding_names", "sharding"):
        if meta.get(key) is not None:
            return key
    return None


# ---------------------------------------------------------------------------------------
# Loading
# ---------------------------------------------------------------------------------------


def _np_dtype(dtype: Any) -> np.dtype:
    return np.dtype(jnp.dtype(dtype))


def model_info(
    model_dir: str | os.PathLike,
    *,
    family: str = "auto",
    dtype: Any = jnp.float32,
    compute_dtype: Any = None,
    num_layers: int | None = None,
    layers_field: str = "spec.model.layers",
) -> tuple[ModelInfo, dict]:
    """ModelInfo (and config extras) of a HF checkpoint directory, without loading weights.
    ``num_layers`` keeps only the first decoder layers (``layers_field`` in errors)."""
    model_dir = Path(model_dir)
    if family in (None, "", "auto"):
        family = detect_family(model_dir)
    if family not in FAMILIES:
        raise ValueError(f"spec.model.family: {family!r} is not one of auto, {', '.join(FAMILIES)}")
    hf = _text_config(read_hf_config(model_dir))
    if num_layers is not None:
        hf = _first_layers(hf, num_layers, model_dir, layers_field)
    compute_dtype = dtype if compute_dtype is None else compute_dtype
    config, extras = build_config(family, hf, dtype, compute_dtype)
    config = shard_batch_over_slices(config)
    d, heads = int(hf["hidden_size"]), int(hf["num_attention_heads"])
    info = ModelInfo(
        family=family,
        model_dir=str(model_dir),
        hf_config=hf,
        config=config,
        dtype=jnp.dtype(dtype),
        num_layers=int(hf["num_hidden_layers"]),
        vocab_size=int(hf["vocab_size"]),
        hidden_size=d,
        intermediate_size=int(hf["intermediate_size"]),
        num_heads=heads,
        num_kv_heads=int(hf.get("num_key_value_heads") or heads),
        head_dim=int(hf.get("head_dim") or d // heads),
        tie_word_embeddings=bool(hf.get("tie_word_embeddings", family.startswith("gemma"))),
        layer_types=extras["layer_types"],
        eos_token_ids=_eos_ids(model_dir, hf),
        compute_dtype=jnp.dtype(compute_dtype),
    )
    return info, extras


def _first_layers(hf: dict, num_layers: int, model_dir: Path, field: str) -> dict:
    """A config.json for the first num_layers decoder layers of hf."""
    have = int(hf["num_hidden_layers"])
    if not 1 <= num_layers <= have:
        raise ValueError(f"{field}: {num_layers}, but {model_dir} has {have} decoder layers")
    out = {**hf, "num_hidden_layers": num_layers}
    if isinstance(hf.get("layer_types"), list):  # per-layer attention kinds (Gemma, Qwen)
        out["layer_types"] = hf["layer_types"][:num_layers]
    return out


def abstract_model(info: ModelInfo, extras: dict, mesh=None) -> nnx.Module:
    """The Tunix model with abstract (shape-only) params."""
    cls = _model_class(info.family)
    if mesh is not None:
        with jax.set_mesh(mesh):
            model = nnx.eval_shape(lambda: cls(info.config, rngs=nnx.Rngs(params=0)))
    else:
        model = nnx.eval_shape(lambda: cls(info.config, rngs=nnx.Rngs(params=0)))
    _configure(model, info, extras)
    return model


def load_model(
    model_dir: str | os.PathLike,
    *,
    family: str = "auto",
    mesh=None,
    dtype: Any = jnp.float32,
    compute_dtype: Any = None,
    weights: str | None = None,
    num_layers: int | None = None,
    layers_field: str = "spec.model.layers",
) -> tuple[nnx.Module, ModelInfo]:
    """Loads a HF safetensors checkpoint into the family's Tunix nnx model, params in
    ``dtype``, forward passes (``compute_view``) in ``compute_dtype`` (default ``dtype``).

    Each parameter is created with ``jax.make_array_from_callback`` on ``mesh`` (default:
    one device) with the sharding Tunix annotates (axes that do not divide a dimension
    are dropped for it); every callback reads only its block from the safetensors files.
    ``weights`` is where those files are when not in ``model_dir`` (a gs:// prefix: the
    blocks are then fetched with ranged reads, and ``model_dir`` holds the small files).
    """
    info, extras = model_info(
        model_dir,
        family=family,
        dtype=dtype,
        compute_dtype=compute_dtype,
        num_layers=num_layers,
        layers_field=layers_field,
    )
    mesh = mesh if mesh is not None else make_mesh(1, 1, jax.devices()[:1])
    reader = _SafetensorsDir(str(weights or model_dir))
    try:
        info.hf_prefix = _detect_prefix(reader.keys())
        model = abstract_model(info, extras, mesh)
        graphdef, abs_state = nnx.split(model)
        flat = dict(nnx.to_flat_state(abs_state))
        maps = {m.path: m for m in param_maps(info)}
        missing_maps = sorted(set(flat) - set(maps), key=str)
        if missing_maps:
            raise RuntimeError(f"posttrain bug: no HF mapping for Tunix params {missing_maps}")
        needed = {name for m in maps.values() for name in m.sources}
        absent = sorted(needed - reader.keys())
        if absent:
            raise ValueError(
                f"spec.model.source: {model_dir} lacks tensors {absent[:5]}"
                f"{' ...' if len(absent) > 5 else ''} that a {info.family} model with this "
                "config.json needs"
            )
        unused = sorted(
            k
            for k in reader.keys() - needed
            if not (k.endswith("rotary_emb.inv_freq") or k.endswith("lm_head.weight"))
        )
        if unused and num_layers is None:
            log.warning("ignoring %d checkpoint tensors, e.g. %s", len(unused), unused[:5])
        np_dtype = _np_dtype(dtype)
        new_flat = {}
        for path, var in flat.items():
            m = maps[path]
            for name in m.sources:
                if reader.shape(name) != m.hf_shape:
                    raise ValueError(
                        f"spec.model.source: tensor {name} has shape {reader.shape(name)}, "
                        f"config.json implies {m.hf_shape}"
                    )
            if tuple(var.shape) != m.shape:
                raise RuntimeError(f"posttrain bug: {path} is {var.shape}, mapping gives {m.shape}")
            key = _sharding_metadata_key(var)
            spec = var.get_metadata().get(key) if key else None
            fitted = _fit_spec(spec or (), m.shape, mesh)
            sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(*fitted))

            def callback(index, m=m):
                return m.read(reader.get, index).astype(np_dtype)

            array = jax.make_array_from_callback(m.shape, sharding, callback)
            metadata = {key: fitted} if key and tuple(spec) != fitted else {}
            new_flat[path] = var.copy(array, **metadata)
        state = nnx.from_flat_state(new_flat)
        loaded = nnx.merge(graphdef, state)
        fetched = reader.fetched()
        if fetched:
            log.info("fetched %d of the %d bytes of %s's weights", *fetched, weights)
    finally:
        reader.close()
    return loaded, info


# ---------------------------------------------------------------------------------------
# Running
# ---------------------------------------------------------------------------------------


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


@nnx.jit
def _forward(model, tokens, positions, mask):
    logits, _ = compute_view(model)(tokens, positions, None, mask)
    return logits.astype(jnp.float32)


def forward(model: nnx.Module, input_ids: Any, input_mask: Any | None = None) -> jax.Array:
    """Float32 logits ``[B, T, V]`` for right-padded ``input_ids`` (jit-compiled)."""
    tokens = jnp.asarray(input_ids, jnp.int32)
    mask = (
        jnp.ones_like(tokens, jnp.bool_)
        if input_mask is None
        else jnp.asarray(input_mask, jnp.bool_)
    )
    positions = jnp.maximum(jnp.cumsum(mask, axis=-1) - 1, 0).astype(jnp.int32)
    return _forward(model, tokens, positions, causal_mask(mask))


def init_cache(model: nnx.Module, batch_size: int, cache_size: int, dtype: Any = None) -> dict:
    """An empty KV cache in the layout Tunix's attention layers update."""
    cfg = model.config
    if dtype is None:
        dtype = getattr(model, "posttrain_compute_dtype", None)
    if dtype is None:
        dtype = model.embedder.input_embedding.get_value().dtype
    shape = (batch_size, cache_size, cfg.num_kv_heads, cfg.head_dim)
    return {
        f"layer_{i}": {
            "k": jnp.zeros(shape, dtype),
            "v": jnp.zeros(shape, dtype),
            "end_index": jnp.zeros((batch_size,), jnp.int32),
        }
        for i in range(cfg.num_layers)
    }


@nnx.jit
def _greedy_step(model, tokens, positions, cache, mask):
    logits, cache = compute_view(model)(tokens, positions, cache, mask)
    return jnp.argmax(logits[:, -1], axis=-1).astype(jnp.int32), cache


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
    prompt = jnp.asarray(prompt_ids, jnp.int32)[None]
    length = prompt.shape[1]
    size = length + max_new_tokens
    cache = init_cache(model, 1, size)
    slots = jnp.arange(size)
    step = nnx.cached_partial(_greedy_step, model)
    mask = (slots[None, :] <= jnp.arange(length)[:, None])[None]
    token, cache = step(prompt, jnp.arange(length, dtype=jnp.int32)[None], cache, mask)
    stop = set(eos_token_ids)
    out: list[int] = []
    for i in range(max_new_tokens):
        tok = int(token[0])
        out.append(tok)
        if tok in stop or i == max_new_tokens - 1:
            break
        pos = length + i
        mask = (slots <= pos)[None, None, :]
        token, cache = step(token[:, None], jnp.full((1, 1), pos, jnp.int32), cache, mask)
    text = None
    if tokenizer is not None:
        text = tokenizer.decode([t for t in out if t not in stop])
    return Generation(out, text)


# ---------------------------------------------------------------------------------------
# Saving back to HF
# ---------------------------------------------------------------------------------------


def host_array(x: Any) -> np.ndarray:
    """The full value of a (possibly multi-host) array on this host."""
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
        from jax.experimental import multihost_utils

        return np.asarray(multihost_utils.process_allgather(x, tiled=True))
    return np.asarray(jax.device_get(x))


_ST_DTYPES = {
    np.dtype(np.float32): "F32",
    np.dtype(np.float16): "F16",
    np.dtype(ml_dtypes.bfloat16): "BF16",
    np.dtype(np.float64): "F64",
    np.dtype(np.int32): "I32",
    np.dtype(np.int64): "I64",
}


def write_safetensors(
    path: str | os.PathLike,
    tensors: Iterable[tuple[str, tuple[int, ...], np.dtype, Callable[[], np.ndarray]]],
    metadata: dict[str, str] | None = None,
) -> None:
    """Streams tensors into a safetensors file, one in memory at a time.

    ``tensors``: (name, shape, dtype, produce) with ``produce()`` returning the array.
    """
    entries = list(tensors)
    header: dict[str, Any] = {"__metadata__": dict(metadata or {"format": "pt"})}
    offset = 0
    for name, shape, dtype, _ in entries:
        size = math.prod(shape) * np.dtype(dtype).itemsize
        header[name] = {
            "dtype": _ST_DTYPES[np.dtype(dtype)],
            "shape": list(shape),
            "data_offsets": [offset, offset + size],
        }
        offset += size
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as out:
        out.write(struct.pack("<Q", len(raw)))
        out.write(raw)
        for name, shape, dtype, produce in entries:
            arr = np.ascontiguousarray(produce(), dtype=dtype)
            if tuple(arr.shape) != tuple(shape):
                raise ValueError(f"{name}: produced {arr.shape}, declared {shape}")
            out.write(arr.tobytes())


def _hf_dtype_name(dtype: np.dtype) -> str:
    return {"float32": "float32", "bfloat16": "bfloat16", "float16": "float16"}[
        np.dtype(dtype).name
    ]


def hf_state(
    model: nnx.Module, info: ModelInfo
) -> Iterable[tuple[str, Callable[[], np.ndarray], tuple, np.dtype]]:
    """Lazily, every HF tensor of ``model`` (LoRA merged in): (name, produce, shape, dtype).

    Names use the ``*ForCausalLM`` layout (``model.layers...``) whatever the source was.
    """
    from posttrain.trainer import lora as lora_lib

    info = dataclasses.replace(info, hf_prefix="model.")
    flat = dict(nnx.to_flat_state(nnx.state(model, nnx.Param)))
    deltas = lora_lib.merged_deltas(model, info)
    for m in param_maps(info):
        var = flat[m.path]
        dtype = np.dtype(var.get_value().dtype)
        memo: dict[str, np.ndarray] = {}

        def produce_all(m=m, var=var, memo=memo):
            if not memo:  # a fused param (Gemma's kv_einsum) is gathered once
                memo.update(m.to_hf(host_array(var.get_value())))
            return memo

        for name in m.sources:

            def produce(name=name, produce_all=produce_all, dtype=dtype, memo=memo):
                value = produce_all()[name]
                if name in deltas:
                    value = (value.astype(np.float32) + deltas[name]()).astype(dtype)
                del memo[name]  # freed once every source of the param was produced
                return value

            yield name, produce, m.hf_shape, dtype


def save_hf(
    model: nnx.Module,
    out_dir: str | os.PathLike,
    info: ModelInfo,
    *,
    dtype: Any = None,
    max_shard_bytes: int = 5 * 1024**3,
) -> Path:
    """Writes ``model`` (LoRA merged in) as a HF checkpoint that ``load_model`` reads back.

    ``model*.safetensors`` (+ index when sharded), ``config.json`` and the tokenizer files
    of the source directory. Only process 0 writes; every process must call it.
    """
    out = Path(out_dir)
    tensors = list(hf_state(model, info))
    target = None if dtype is None else np.dtype(jnp.dtype(dtype))
    write = jax.process_index() == 0
    if write:
        out.mkdir(parents=True, exist_ok=True)
    shards: list[list] = [[]]
    size = 0
    for name, produce, shape, src_dtype in tensors:
        dt = target or src_dtype
        nbytes = math.prod(shape) * dt.itemsize
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        size += nbytes
        shards[-1].append((name, shape, dt, produce))
    weight_map = {}
    total = 0
    for i, shard in enumerate(shards):
        fname = (
            "model.safetensors"
            if len(shards) == 1
            else f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        )
        if write:
            write_safetensors(out / fname, shard)
        else:  # other processes still take part in the gathers
            for _, _, _, produce in shard:
                produce()
        for name, shape, dt, _ in shard:
            weight_map[name] = fname
            total += math.prod(shape) * dt.itemsize
    if not write:
        return out
    if len(shards) > 1:
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    cfg = dict(info.hf_config)
    arch, model_type = _HF_ARCH_OUT[info.family]
    cfg["architectures"] = [arch]
    cfg["model_type"] = model_type
    saved = _hf_dtype_name(target or tensors[0][3])
    if "dtype" in cfg or "torch_dtype" not in cfg:
        cfg["dtype"] = saved
    if "torch_dtype" in cfg:
        cfg["torch_dtype"] = saved
    (out / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    src = Path(info.model_dir)
    for fname in _TOKENIZER_FILES:
        if (src / fname).is_file() and src.resolve() != out.resolve():
            shutil.copyfile(src / fname, out / fname)
    return out


# ---------------------------------------------------------------------------------------
# LoRA (implemented in posttrain.trainer.lora)
# ---------------------------------------------------------------------------------------

_LORA_EXPORTS = (
    "default_lora_targets",
    "apply_lora",
    "save_peft_adapter",
    "load_peft_adapter",
    "lora_module_paths",
    "LoraSettings",
)


def __getattr__(name: str):
    if name in _LORA_EXPORTS:
        from posttrain.trainer import lora

        return getattr(lora, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "FAMILIES",
    "Generation",
    "ModelInfo",
    "ParamMap",
    "abstract_model",
    "build_config",
    "causal_mask",
    "compute_view",
    "detect_family",
    "forward",
    "greedy_generate",
    "host_array",
    "init_cache",
    "load_model",
    "make_mesh",
    "model_info",
    "param_maps",
    "read_hf_config",
    "rope_inv_freq",
    "save_hf",
    "write_safetensors",
    *_LORA_EXPORTS,
]
