"""config.json -> the family, the Tunix ``ModelConfig`` and a ``ModelInfo``, no weights read.

``build_config`` maps a Hugging Face config dict to the family's Tunix ``ModelConfig`` and
refuses, naming what, the checkpoints Tunix's model code cannot run (other activations,
biases, sliding windows, soft-capping, RoPE scalings); ``model_info`` reads a checkpoint
directory's config into the ``ModelInfo`` the loader, the saver and LoRA share.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
from tunix.models.gemma import model as gemma2_lib
from tunix.models.gemma3 import model as gemma3_lib
from tunix.models.llama3 import model as llama3_lib
from tunix.models.qwen2 import model as qwen2_lib
from tunix.models.qwen3 import model as qwen3_lib

from posttrain.trainer.mesh import shard_batch_over_slices
from posttrain.trainer.models.families import FAMILIES, HF_ARCHITECTURES, HF_MODEL_TYPES
from posttrain.trainer.models.rope import rope_inv_freq, rope_of


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
    remat: str = "none"  # spec.training.remat as resolved (resolve_remat)
    vision: Any = None  # posttrain.trainer.models.vision.VisionInfo when the vision tower is loaded


# spec.training.remat -> the name of the Tunix RematConfig member every family's model has:
# DECODER wraps a whole decoder layer in nnx.remat, BLOCK its attention and its MLP apart;
# dots is DECODER keeping the layer's matmul outputs (models.remat).
REMAT_CONFIGS = {"none": "NONE", "block": "BLOCK", "layer": "DECODER", "dots": "DECODER"}


def resolve_remat(remat: str) -> str:
    """none, block or layer: ``auto`` (the default) is layer on accelerators (TPU, GPU)
    and none on CPU, where models are small and recomputing only slows the step."""
    remat = str(remat)
    if remat == "auto":
        return "none" if jax.default_backend() == "cpu" else "layer"
    if remat not in REMAT_CONFIGS:
        raise ValueError(
            f"spec.training.remat: {remat!r} is not one of auto, {', '.join(REMAT_CONFIGS)}"
        )
    return remat


def with_remat(config: Any, family: str, remat: str) -> Any:
    """``config`` with the Tunix RematConfig of ``remat`` (none, block or layer)."""
    if remat == "none":
        return config
    current = getattr(config, "remat_config", None)
    if current is None:
        raise ValueError(
            f"spec.training.remat: {remat}, but posttrain's {family} model cannot "
            "rematerialise; use auto or none"
        )
    member = type(current)[REMAT_CONFIGS[remat]]
    return dataclasses.replace(config, remat_config=member)


def read_hf_config(model_dir: str | os.PathLike) -> dict:
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"spec.model.source: no config.json in {model_dir}")
    return json.loads(path.read_text())


def detect_family(model_dir: str | os.PathLike) -> str:
    """Family of a HF checkpoint from config.json ``model_type`` (or ``architectures``)."""
    cfg = read_hf_config(model_dir)
    family = HF_MODEL_TYPES.get(cfg.get("model_type", ""))
    if family is None:
        for arch in cfg.get("architectures") or ():
            family = HF_ARCHITECTURES.get(arch)
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
    # The decoder's shape, under the argument names every Tunix ModelConfig shares.
    shape = dict(
        num_layers=n,
        embed_dim=d,
        hidden_dim=ffw,
        num_heads=heads,
        head_dim=head_dim,
        num_kv_heads=kv,
    )
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
        theta, scaling = rope_of(hf)
        common = dict(**shape, vocab_size=vocab, rope_theta=theta, norm_eps=eps)
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
    shape = dict(shape, num_embed=vocab)
    window = hf.get("sliding_window")
    if family == "gemma2":
        theta, scaling = rope_of(hf)
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
            **shape,
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
    local_theta, local_scaling = rope_of(hf, "sliding_attention")
    global_theta, global_scaling = rope_of(hf, "full_attention", default_theta=1_000_000.0)

    def _linear_factor(scaling: dict | None) -> float:
        if not scaling:
            return 1.0
        if scaling.get("rope_type", scaling.get("type")) != "linear":
            raise _unsupported(family, f"rope scaling {scaling}")
        return float(scaling["factor"])

    cfg = gemma3_lib.ModelConfig(
        **shape,
        sliding_window_size=window,
        local_base_frequency=local_theta,
        global_base_frequency=global_theta,
        local_scale_factor=_linear_factor(local_scaling),
        global_scale_factor=_linear_factor(global_scaling),
        query_pre_attn_norm=query_norm,
        param_dtype=dtype,
    )
    return cfg, extras


def model_info(
    model_dir: str | os.PathLike,
    *,
    family: str = "auto",
    dtype: Any = jnp.float32,
    compute_dtype: Any = None,
    num_layers: int | None = None,
    layers_field: str = "spec.model.layers",
    vision: bool = False,
    remat: str = "auto",
) -> tuple[ModelInfo, dict]:
    """ModelInfo (and config extras) of a HF checkpoint directory, without loading weights.
    ``num_layers`` keeps only the first decoder layers (``layers_field`` in errors);
    ``vision`` adds Gemma 3's vision tower (``posttrain.trainer.models.vision``);
    ``remat`` is spec.training.remat: a job passes its own (``resolve_remat``)."""
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
    remat = resolve_remat(remat)
    config = with_remat(shard_batch_over_slices(config), family, remat)
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
        remat=remat,
    )
    if vision:
        from posttrain.trainer.models import vision as vision_lib

        info.vision = vision_lib.require_vision_info(read_hf_config(model_dir), family, model_dir)
        info.config = vision_lib.with_vision(info.config, info.vision)
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
