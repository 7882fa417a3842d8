"""A run's exports under output.uri: the PEFT adapter or merged HF model a finished run
writes to hf/ (`export_model`), and `posttrain export` of a chosen checkpoint
(`export_checkpoint`), with the directories they write (`OutputDir`) and the
checkpoint.keepBest checkpoint (`best_checkpoint`)."""

from __future__ import annotations

import logging
import tempfile
from pathlib import Path
from typing import Any

import jax
from flax import nnx

from posttrain.api.spec import LOWER_IS_BETTER, PostTrainJob
from posttrain.trainer import adapter_base, models, optim, peft_format, storage
from posttrain.trainer.checkpoint import BestCheckpoint, Checkpoints
from posttrain.trainer.models.saving import copy_source_files, save_hf
from posttrain.trainer.policy import load_policy, restore_into, shard_like_params, trainable_state

log = logging.getLogger("posttrain.trainer")


class OutputDir:
    """A local directory that mirrors to output.uri when that is gs://."""

    def __init__(self, uri: str, name: str, scratch: Path):
        self.uri = storage.join(uri, name)
        self.remote = storage.is_gcs(uri)
        self.local = (scratch / name) if self.remote else Path(self.uri)
        self.local.mkdir(parents=True, exist_ok=True)

    def sync(self) -> None:
        if self.remote and jax.process_index() == 0:
            storage.upload_dir(self.local, self.uri)


def best_checkpoint(spec: Any) -> BestCheckpoint | None:
    """checkpoint.keepBest's checkpoint directory (None without keepBest)."""
    metric = spec.checkpoint.keep_best
    if metric is None:
        return None
    directory = storage.join(spec.output.uri, "checkpoints-best")
    return BestCheckpoint(directory, str(metric), str(metric) in LOWER_IS_BETTER)


def export_checkpoint(
    job: PostTrainJob,
    step: int | None = None,
    kind: str | None = None,
    *,
    best: bool = False,
    base: str | None = None,
) -> tuple[int, str | None]:
    """Export checkpoint `step` (default: the newest readable one; with `best`, the
    checkpoint.keepBest one) of a job's run without training (`posttrain export`): as
    `kind` (adapter | merged; default spec.output.exportHF) to output.uri/hf, or
    output.uri/hf-step-<step> for an explicit step or the best; a merged export of a LoRA
    job gets its own directory (hf-merged, hf-step-<step>-merged), since a loader that
    finds the adapter's adapter_config.json in hf/ loads the adapter; an adapter names
    `base` (``--base``) as its base model when given. Returns (step, URI)."""
    spec = job.spec
    if kind == "adapter" and not spec.lora:
        raise ValueError("--format adapter: the job has no spec.lora (a full fine-tune)")
    if base is not None:
        chosen = kind or str(spec.output.export_hf)
        if chosen == "merged" or (chosen == "auto" and not spec.lora) or chosen == "none":
            raise ValueError(
                f"{adapter_base.BASE_FLAG}: only an adapter export names a base model "
                f"(this export is {'merged' if chosen != 'none' else 'none'})"
            )
        adapter_base.base_model(spec.model.source, base)  # refuses a bad name before loading
    with tempfile.TemporaryDirectory(prefix="posttrain-") as scratch:  # nothing left in /tmp
        return _restore_and_export(job, step, kind, best, base, Path(scratch))


def _restore_and_export(
    job: PostTrainJob,
    step: int | None,
    kind: str | None,
    best: bool,
    base: str | None,
    scratch: Path,
) -> tuple[int, str | None]:
    spec = job.spec
    mesh = models.make_mesh()
    log.info("loading the model from %s", spec.model.source)
    policy = load_policy(spec, mesh, scratch)
    log.info("restoring the checkpoint")
    opt = nnx.Optimizer(policy.model, optim.optimizer(spec.training), wrt=policy.wrt)
    with jax.set_mesh(mesh):
        shard_like_params(opt, mesh)
    target = trainable_state(policy.model, policy.wrt, opt)
    if best:
        kept = best_checkpoint(spec)
        if kept is None:
            raise ValueError("--best: the job has no checkpoint.keepBest")
        restored = kept.restore(target)
        kept.close()
    else:
        checkpoints = Checkpoints(
            storage.join(spec.output.uri, "checkpoints"), spec.checkpoint.keep
        )
        if step is None:
            restored = checkpoints.restore_latest(target)
            if restored is None:
                raise ValueError(
                    f"spec.output.uri: {spec.output.uri}: no readable checkpoint to export"
                )
        else:
            restored = checkpoints.restore(step, target)
        checkpoints.close()
    restore_into(policy.model, policy.wrt, opt, restored.state)
    name = "hf" if step is None and not best else f"hf-step-{restored.step}"
    resolved = kind or str(spec.output.export_hf)
    if spec.lora and resolved == "merged":  # never beside the adapter, which loaders prefer
        name += "-merged"
    return restored.step, export_model(
        job, policy.model, policy.info, scratch, kind=kind, name=name, base=base
    )


def export_model(
    job: PostTrainJob,
    model: nnx.Module,
    info: models.ModelInfo,
    scratch: Path,
    *,
    kind: str | None = None,
    name: str = "hf",
    base: str | None = None,
) -> str | None:
    """Write the trained model as `kind` (adapter | merged | none | auto; default
    spec.output.exportHF) to output.uri/<name>, with the source's tokenizer, generation and
    image processor files. An adapter names its base model as `adapter_base` says (`base`
    overrides spec.model.source) and explains it in its README.md. Returns its URI (None
    for none)."""
    spec = job.spec
    kind = kind or str(spec.output.export_hf)
    if kind == "auto":
        kind = "adapter" if spec.lora else "merged"
    if kind == "none":
        return None
    out = OutputDir(spec.output.uri, name, scratch)
    log.info("writing the %s to %s", "adapter" if kind == "adapter" else "merged model", out.uri)
    if kind == "adapter":
        named = adapter_base.base_model(spec.model.source, base)
        peft_format.save_peft_adapter(
            model, out.local, info, base_model_name=named.name, revision=named.revision
        )
        if jax.process_index() == 0:
            copy_source_files(info.model_dir, out.local)
            card = adapter_base.model_card(named, spec.model.source)
            (out.local / "README.md").write_text(card)
    else:
        save_hf(model, out.local, info)
    out.sync()
    return out.uri
