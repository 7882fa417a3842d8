"""Saving a model (LoRA merged in) back as a Hugging Face checkpoint that ``load_model`` reads.

It stands above ``posttrain.trainer.lora`` (it merges the adapters' deltas), which stands
on the rest of this package; so ``posttrain.trainer.models`` does not re-export it.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import shutil
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from posttrain.trainer import peft_format
from posttrain.trainer.models import scan
from posttrain.trainer.models.config import ModelInfo
from posttrain.trainer.models.families import HF_ARCH_OUT
from posttrain.trainer.models.params import param_maps
from posttrain.trainer.models.safetensors_io import host_array, write_safetensors

# Files of the source checkpoint copied next to an export (the weights by save_hf, a
# PEFT adapter by export.export_model): tokenizer, generation and image processor settings.
SOURCE_FILES = (
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
    "processor_config.json",  # Gemma 3 vision: the image processor's settings
    "preprocessor_config.json",
)


def _hf_dtype_name(dtype: np.dtype) -> str:
    return {"float32": "float32", "bfloat16": "bfloat16", "float16": "float16"}[
        np.dtype(dtype).name
    ]


def export_layout(info: ModelInfo) -> ModelInfo:
    """``info`` with the tensor names ``save_hf`` writes (see ``hf_state``)."""
    if info.vision is None:
        return dataclasses.replace(info, hf_prefix="model.")
    vision = dataclasses.replace(
        info.vision,
        tower_prefix="model.vision_tower.vision_model.",
        projector_prefix="model.multi_modal_projector.",
    )
    return dataclasses.replace(info, hf_prefix="model.language_model.", vision=vision)


def hf_state(
    model: nnx.Module, info: ModelInfo
) -> Iterable[tuple[str, Callable[[], np.ndarray], tuple, np.dtype]]:
    """Lazily, every HF tensor of ``model`` (LoRA merged in): (name, produce, shape, dtype).

    Names use the ``*ForCausalLM`` layout (``model.layers...``) whatever the source was;
    a model with Gemma 3's vision tower, ``Gemma3ForConditionalGeneration``'s
    (``model.language_model...``, ``model.vision_tower.vision_model...``).
    """
    info = export_layout(info)
    flat = scan.flat_state(model, nnx.Param)  # per-layer paths, scanned or not
    deltas = peft_format.merged_deltas(model, info)
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
    arch, model_type = HF_ARCH_OUT[info.family]
    cfg["architectures"] = [arch]
    cfg["model_type"] = model_type
    if info.vision is not None:  # the source's multimodal config, with this text config
        full = json.loads((Path(info.model_dir) / "config.json").read_text())
        cfg = {**full, "text_config": {**cfg, "model_type": "gemma3_text"}}
        cfg["architectures"] = ["Gemma3ForConditionalGeneration"]
        cfg["text_config"].pop("architectures", None)
    saved = _hf_dtype_name(target or tensors[0][3])
    if "dtype" in cfg or "torch_dtype" not in cfg:
        cfg["dtype"] = saved
    if "torch_dtype" in cfg:
        cfg["torch_dtype"] = saved
    (out / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    copy_source_files(info.model_dir, out)
    return out


def copy_source_files(model_dir: str | os.PathLike, out: Path) -> None:
    """Copies the SOURCE_FILES that `model_dir` holds into `out` (not onto themselves)."""
    src = Path(model_dir)
    if not model_dir or src.resolve() == out.resolve():
        return
    for fname in SOURCE_FILES:
        if (src / fname).is_file():
            shutil.copyfile(src / fname, out / fname)
