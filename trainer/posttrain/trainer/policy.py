"""The model a run trains (`Policy`): spec.model loaded on the mesh with spec.lora's
adapters (`load_policy`), a frozen copy of it (`load_reference`: DPO's and GRPO's
reference of a full fine-tune), and its trainable state as a checkpoint holds it: the
trainable params and the optimizer state (`trainable_state`, `restore_into`), with the
optimizer state laid out like the params before a restore (`shard_like_params`)."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from posttrain.trainer import lora, models, peft_format, sources
from posttrain.trainer.models import scan, vision

log = logging.getLogger("posttrain.trainer")

DTYPES = {"bfloat16": jnp.bfloat16, "float16": jnp.float16, "float32": jnp.float32}


def trainable_state(model: nnx.Module, wrt: Any, opt: nnx.Optimizer) -> dict[str, Any]:
    return {
        "params": nnx.to_pure_dict(nnx.state(model, wrt)),
        "opt": nnx.to_pure_dict(nnx.state(opt)),
    }


def restore_into(model: nnx.Module, wrt: Any, opt: nnx.Optimizer, restored: dict[str, Any]) -> None:
    params = nnx.state(model, wrt)
    nnx.replace_by_pure_dict(params, restored["params"])
    nnx.update(model, params)
    opt_state = nnx.state(opt)
    nnx.replace_by_pure_dict(opt_state, restored["opt"])
    nnx.update(opt, opt_state)


def shard_like_params(opt: nnx.Optimizer, mesh: jax.sharding.Mesh) -> None:
    """Give the optimizer state its annotated shardings up front, so the train step is
    compiled once (not again after the first update changes the layouts)."""
    state = nnx.state(opt)
    specs = nnx.get_partition_spec(state)
    shardings = jax.tree.map(
        lambda spec: jax.sharding.NamedSharding(mesh, spec),
        specs,
        is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec),
    )
    nnx.update(opt, jax.device_put(state, shardings))


@dataclass
class Policy:
    """The model being trained, what it was loaded from, and which params train."""

    model: nnx.Module
    info: models.ModelInfo
    wrt: Any  # nnx.Param (full fine-tune) or nnx.LoRAParam
    model_dir: str


def load_policy(spec: Any, mesh: jax.sharding.Mesh, scratch: Path) -> Policy:
    """spec.model loaded on the mesh, with spec.lora's adapters (restored when asked)."""
    # Forward and backward run in spec.model.dtype. What trains is float32 (the master
    # weights the optimizer updates and checkpoints hold): every weight of a full
    # fine-tune, the adapters of LoRA (apply_lora), whose frozen base stays in model.dtype.
    compute = DTYPES[spec.model.dtype]
    model, info = sources.load_model_source(
        spec.model.source,
        scratch,
        family=spec.model.family,
        num_layers=spec.model.layers,
        mesh=mesh,
        dtype=compute if spec.lora else jnp.float32,
        compute_dtype=compute,
        vision=spec.data.columns.images is not None,
        remat=spec.training.remat,
        attention=spec.training.attention,
    )
    wrt: Any = nnx.Param
    if info.vision:  # the vision tower frozen unless spec.training.trainVisionTower
        wrt = vision.full_finetune_params(spec.training.train_vision_tower)
        if spec.training.train_vision_tower:
            vision.unfreeze_tower(model)
    if spec.lora:
        if info.vision:
            lora.refuse_tower_targets(model, spec.lora.target_modules)
        model = lora.apply_lora(
            model,
            spec.lora.rank,
            spec.lora.alpha,
            spec.lora.target_modules,
            mesh,
            seed=spec.training.seed,
        )
        if spec.lora.restore_from:
            adapter = sources.local_model_dir(
                spec.lora.restore_from, scratch, field="spec.lora.restoreFrom"
            )
            peft_format.load_peft_adapter(model, adapter, info)
        wrt = nnx.LoRAParam
    apply_layer_loop(spec, model, info.family, mesh)
    log.info(
        "decoder layers: %s (spec.training.layerLoop: %s)",
        "scanned" if scan.is_stacked(model) else "unrolled",
        spec.training.layer_loop,
    )
    return Policy(model, info, wrt, info.model_dir)


def apply_layer_loop(
    spec: Any, model: nnx.Module, family: str, mesh: jax.sharding.Mesh
) -> nnx.Module:
    """spec.training.layerLoop on a loaded model (its adapters already on), on ``mesh``'s
    platform: scan stacks its decoder layers (``models.scan``). Returns ``model``."""
    setting = str(spec.training.layer_loop)
    loop = scan.resolve(setting, family=family, platform=mesh.devices.flat[0].platform,
                        grpo=str(spec.technique) == "grpo")  # fmt: skip
    if loop == "scan" and setting == "auto" and not scan.alike(model):
        log.info("decoder layers unrolled: they differ (spec.lora.targetModules adapting "
                 "only some of them?), and only alike layers scan")  # fmt: skip
    elif loop == "scan":
        scan.stack(model)
    return model


def load_reference(spec: Any, policy: Policy, mesh: jax.sharding.Mesh) -> nnx.Module:
    """A frozen copy of spec.model (without adapters) on the mesh, in spec.model.dtype."""
    model, _ = models.load_model(
        policy.model_dir,
        num_layers=spec.model.layers,
        weights=sources.weights_uri(spec.model.source),
        family=spec.model.family,
        mesh=mesh,
        dtype=DTYPES[spec.model.dtype],
        remat=spec.training.remat,
        attention=spec.training.attention,
    )
    return apply_layer_loop(spec, model, policy.info.family, mesh)
