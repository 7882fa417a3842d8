"""The Hugging Face ``peft`` format of posttrain's LoRA adapters (``posttrain.trainer.lora``).

``save_peft_adapter`` / ``load_peft_adapter`` write and read ``adapter_model.safetensors``
+ ``adapter_config.json``; ``merged_deltas`` gives the weight deltas a merged export adds.

For a Tunix weight, qwix's ``A`` holds the contracted axes (HF ``in_features``,
row-major) and ``B`` the others (HF ``out_features``), so
``lora_A.weight = A.reshape(-1, r).T`` and ``lora_B.weight = B.reshape(r, -1).T``. Gemma's
fused ``kv_einsum`` (and ``qkv_einsum``) has one ``A`` for k and v: it exports as
``k_proj`` and ``v_proj`` with equal ``lora_A``.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from collections.abc import Callable
from pathlib import Path

import jax
import numpy as np
from flax import nnx
from safetensors import safe_open

from posttrain.trainer import lora, models
from posttrain.trainer.models import scan

RESTORE_FIELD = "spec.lora.restoreFrom"
PEFT_PREFIX = "base_model.model."
ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"


def info_from_model(model: nnx.Module, hf_prefix: str = "model.") -> models.ModelInfo:
    """Enough of a ModelInfo to map a Tunix model's params to HF names."""
    family = lora.family_of(model)
    cfg = model.config
    if getattr(cfg, "vision_config", None) is not None:  # a Gemma3ForConditionalGeneration
        hf_prefix = _PEFT_DECODER
    gemma = family.startswith("gemma")
    tie = (
        True
        if gemma
        else bool(getattr(cfg, "weight_tying", getattr(cfg, "use_tied_embedding", False)))
    )
    return models.ModelInfo(
        family=family,
        model_dir="",
        hf_config={},
        config=cfg,
        dtype=None,
        num_layers=cfg.num_layers,
        vocab_size=cfg.num_embed if gemma else cfg.vocab_size,
        hidden_size=cfg.embed_dim,
        intermediate_size=cfg.hidden_dim,
        num_heads=cfg.num_heads,
        num_kv_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim,
        tie_word_embeddings=tie,
        hf_prefix=hf_prefix,
    )


def _lora_params(model: nnx.Module) -> dict[tuple, nnx.Variable]:
    return scan.flat_state(model, nnx.LoRAParam)  # per-layer paths, scanned or not


def _adapted_maps(model: nnx.Module, info: models.ModelInfo):
    """(ParamMap, lora_a var, lora_b var) for every adapted weight; all LoRA params used."""
    params = _lora_params(model)
    used: set[tuple] = set()
    out = []
    for m in models.param_maps(info):
        module, weight = m.path[:-1], m.path[-1]
        a_key, b_key = (*module, f"{weight}_lora_a"), (*module, f"{weight}_lora_b")
        if a_key in params and b_key in params:
            out.append((m, params[a_key], params[b_key]))
            used |= {a_key, b_key}
    left = sorted(set(params) - used, key=str)
    if left:
        raise ValueError(
            f"{lora.TARGET_FIELD}: LoRA params {[lora.module_path(p) for p in left[:5]]} have no "
            "Hugging Face counterpart and cannot be exported"
        )
    return out


# Where a Gemma3ForConditionalGeneration checkpoint keeps its decoder (see detect_prefix),
# and the module PEFT finds it as on the transformers model.
_MULTIMODAL_DECODERS = ("model.language_model.", "language_model.model.")
_PEFT_DECODER = "model.language_model."


def _multimodal(info: models.ModelInfo) -> bool:
    """Whether the transformers model of ``info``'s checkpoint is a
    ``Gemma3ForConditionalGeneration``: with its vision tower loaded, or a text-only job
    on such a checkpoint (its decoder saved under ``language_model``)."""
    return getattr(info, "vision", None) is not None or info.hf_prefix in _MULTIMODAL_DECODERS


def _peft_naming(info: models.ModelInfo) -> models.ModelInfo:
    """``info`` naming modules as PEFT finds them on the transformers model: the decoder
    of a ``Gemma3ForConditionalGeneration`` is ``model.language_model`` whatever layout
    its checkpoint was saved in and whether or not the job loads the vision tower."""
    if not _multimodal(info):
        return info
    return dataclasses.replace(info, hf_prefix=_PEFT_DECODER)


def _hf_module(source: str) -> str:
    return source.removesuffix(".weight")


def peft_tensors(
    model: nnx.Module, info: models.ModelInfo | None = None
) -> dict[str, Callable[[], np.ndarray]]:
    """PEFT key -> producer of the ``lora_A`` ([r, in]) / ``lora_B`` ([out, r]) tensor."""
    info = _peft_naming(info or info_from_model(model))
    out: dict[str, Callable[[], np.ndarray]] = {}
    for m, a_var, b_var in _adapted_maps(model, info):
        n = len(m.sources)

        def a_hf(a_var=a_var):
            a = models.host_array(a_var.get_value())
            return np.ascontiguousarray(a.reshape(-1, a.shape[-1]).T)

        for i, src in enumerate(m.sources):

            def b_hf(b_var=b_var, i=i, n=n):
                b = models.host_array(b_var.get_value())
                if n > 1:
                    b = b[:, i]
                return np.ascontiguousarray(b.reshape(b.shape[0], -1).T)

            key = PEFT_PREFIX + _hf_module(src)
            out[f"{key}.lora_A.weight"] = a_hf
            out[f"{key}.lora_B.weight"] = b_hf
    return out


def merged_deltas(model: nnx.Module, info: models.ModelInfo) -> dict[str, Callable[[], np.ndarray]]:
    """HF weight name -> producer of ``(alpha / r) * lora_B @ lora_A`` (float32)."""
    if not _lora_params(model):
        return {}
    scale = lora.settings_of(model).scale
    tensors = peft_tensors(model, info)
    out = {}
    for key in tensors:
        if not key.endswith(".lora_A.weight"):
            continue
        module = key[len(PEFT_PREFIX) : -len(".lora_A.weight")]

        def delta(key=key, module=module):
            a = tensors[key]().astype(np.float32)
            b = tensors[f"{PEFT_PREFIX}{module}.lora_B.weight"]().astype(np.float32)
            return scale * (b @ a)

        out[f"{module}.weight"] = delta
    return out


def _target_modules(adapted: set[str], info: models.ModelInfo) -> list[str] | str:
    """PEFT ``target_modules``: short names when they select exactly the adapted modules,
    else a full-match regex over the module names. On a ``Gemma3ForConditionalGeneration``
    short names would also select the vision tower's ``q_proj``, ``k_proj``, ``v_proj``: the
    regex names the language model's modules of those short names."""
    every = {
        _hf_module(s)
        for m in models.param_maps(info)
        for s in m.sources
        if s.endswith(".weight") and s.startswith(info.hf_prefix)
    }
    short = sorted({m.rsplit(".", 1)[-1] for m in adapted})
    if {m for m in every if m.rsplit(".", 1)[-1] in short} == adapted:
        if _multimodal(info):
            return re.escape(info.hf_prefix) + r".*\.(" + "|".join(short) + ")"
        return short
    return "^(" + "|".join(re.escape(m) for m in sorted(adapted, key=lora.natural_order)) + ")$"


def save_peft_adapter(
    model: nnx.Module,
    out_dir: str | os.PathLike,
    info: models.ModelInfo | None = None,
    base_model_name: str = "",
    revision: str | None = None,
) -> Path:
    """Writes the model's LoRA as a PEFT adapter (``adapter_model.safetensors`` +
    ``adapter_config.json``) that ``peft.PeftModel.from_pretrained`` loads onto the HF
    base model; ``base_model_name`` and ``revision`` are where
    ``AutoPeftModelForCausalLM`` finds that base (see ``adapter_base``). Only process 0
    writes; every process must call it."""
    info = _peft_naming(info or info_from_model(model))
    settings = lora.settings_of(model)
    tensors = peft_tensors(model, info)
    values = {k: produce() for k, produce in sorted(tensors.items())}  # gathers on all hosts
    out = Path(out_dir)
    if jax.process_index() != 0:
        return out
    out.mkdir(parents=True, exist_ok=True)
    models.write_safetensors(
        out / ADAPTER_WEIGHTS,
        [(k, v.shape, v.dtype, lambda v=v: v) for k, v in values.items()],
    )
    adapted = {
        k[len(PEFT_PREFIX) : -len(".lora_A.weight")] for k in values if k.endswith(".lora_A.weight")
    }
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": settings.rank,
        "lora_alpha": settings.alpha,
        "target_modules": _target_modules(adapted, info),
        "lora_dropout": 0.0,
        "bias": "none",
        "base_model_name_or_path": base_model_name or info.model_dir or None,
        "inference_mode": True,
        "fan_in_fan_out": False,
        "use_rslora": False,
        "use_dora": False,
        "init_lora_weights": True,
        "modules_to_save": None,
        "layers_to_transform": None,
        "layers_pattern": None,
        "rank_pattern": {},
        "alpha_pattern": {},
        "revision": revision,
    }
    (out / ADAPTER_CONFIG).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    return out


def adapter_target_regex(adapter_dir: str | os.PathLike, info: models.ModelInfo) -> str:
    """The qwix module-path regex (``apply_lora``'s) of exactly the modules a PEFT adapter
    holds tensors for, on the model of ``info`` (its ``target_modules`` may be a regex
    over the transformers model's module names, which qwix paths do not follow)."""
    with safe_open(str(Path(adapter_dir) / ADAPTER_WEIGHTS), framework="numpy") as f:
        keys = {re.sub(r"\.default(?=\.weight$)", "", k) for k in f.keys()}  # noqa: SIM118
    paths = sorted(
        {
            lora.module_path(m.path[:-1])
            for m in models.param_maps(_peft_naming(info))
            if any(f"{PEFT_PREFIX}{_hf_module(s)}.lora_A.weight" in keys for s in m.sources)
        },
        key=lora.natural_order,
    )
    if not paths:
        raise ValueError(f"{adapter_dir}: the adapter holds no LoRA tensor of this model's modules")
    return "(" + "|".join(re.escape(p) for p in paths) + ")"


def load_peft_adapter(
    model: nnx.Module, adapter_dir: str | os.PathLike, info: models.ModelInfo | None = None
) -> nnx.Module:
    """Loads a PEFT LoRA adapter into a model that ``apply_lora`` gave the same targets,
    rank and alpha (for ``spec.lora.restoreFrom``); updates ``model`` in place and returns
    it. Every adapter tensor must land on a LoRA param of the model and vice versa."""
    adapter_dir = Path(adapter_dir)
    cfg_path, weights_path = adapter_dir / ADAPTER_CONFIG, adapter_dir / ADAPTER_WEIGHTS
    if not cfg_path.is_file() or not weights_path.is_file():
        raise FileNotFoundError(
            f"{RESTORE_FIELD}: {adapter_dir} lacks {ADAPTER_CONFIG} or {ADAPTER_WEIGHTS}"
        )
    cfg = json.loads(cfg_path.read_text())
    settings = lora.settings_of(model)
    if cfg.get("peft_type", "LORA") != "LORA" or cfg.get("use_dora") or cfg.get("use_rslora"):
        raise ValueError(
            f"{RESTORE_FIELD}: only plain LoRA adapters can be restored (got {cfg_path})"
        )
    if int(cfg["r"]) != settings.rank or float(cfg["lora_alpha"]) != settings.alpha:
        raise ValueError(
            f"{RESTORE_FIELD}: adapter has r={cfg['r']}, lora_alpha={cfg['lora_alpha']}; "
            f"spec.lora has rank={settings.rank}, alpha={settings.alpha}"
        )
    info = _peft_naming(info or info_from_model(model))
    with safe_open(str(weights_path), framework="numpy") as f:
        tensors = {re.sub(r"\.default(?=\.weight$)", "", k): f.get_tensor(k) for k in f.keys()}  # noqa: SIM118
    used: set[str] = set()
    updates = []
    for m, a_var, b_var in _adapted_maps(model, info):
        keys = [PEFT_PREFIX + _hf_module(s) for s in m.sources]
        absent = [f"{k}.lora_A.weight" for k in keys if f"{k}.lora_A.weight" not in tensors]
        absent += [f"{k}.lora_B.weight" for k in keys if f"{k}.lora_B.weight" not in tensors]
        if absent:
            raise ValueError(
                f"{RESTORE_FIELD}: adapter lacks {absent[:4]} that the model's LoRA has"
            )
        a_list = [tensors[f"{k}.lora_A.weight"] for k in keys]
        if any(not np.array_equal(a_list[0], a) for a in a_list[1:]):
            raise ValueError(
                f"{RESTORE_FIELD}: {', '.join(keys)} are one fused projection here and need "
                "equal lora_A weights"
            )
        a_shape, b_shape = a_var.shape, b_var.shape
        a = a_list[0].T.reshape(a_shape)
        bs = [tensors[f"{k}.lora_B.weight"].T for k in keys]
        b = (
            np.stack([x.reshape((b_shape[0], *b_shape[2:])) for x in bs], axis=1)
            if len(keys) > 1
            else bs[0].reshape(b_shape)
        )
        used |= {f"{k}.lora_{x}.weight" for k in keys for x in "AB"}
        updates += [(a_var, a), (b_var, b)]
    extra = sorted(set(tensors) - used)
    if extra:
        raise ValueError(
            f"{RESTORE_FIELD}: adapter has tensors for modules this model's LoRA does not "
            f"target ({extra[:4]}); set spec.lora.targetModules to match the adapter"
        )
    for var, value in updates:
        old = var.get_value()
        value = value.astype(old.dtype)
        var.set_value(
            jax.make_array_from_callback(old.shape, old.sharding, lambda idx, v=value: v[idx])
        )
    return model
