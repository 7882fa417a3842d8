"""Every check of a PostTrainJob, where the API alone is not enough: the accelerator
catalog, the renderer's derived names and config size, the batch split and the memory
estimate, over the schema and the API's own checks (`posttrain.api.validate.parse`).

`validate(doc)` is what `posttrain validate`, `posttrain run`, the trainer, the
admission webhook and the operator call, so they accept and refuse the same documents
as the API server with the webhook on. (It lives one floor above `posttrain.api`: the
API imports neither the renderer nor the memory estimate.)
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from posttrain import capacity, catalog
from posttrain.api import batching, kube_values, rollout_split
from posttrain.api.spec import KIND, PostTrainJob
from posttrain.api.validate import (
    FieldError,
    InvalidJob,
    immutable_changes,
    load_documents,
    override,
    parse,
    printable,
)
from posttrain.render.names import NameTooLong, check_name_lengths
from posttrain.render.trainer_config import size_error

__all__ = [
    "FieldError",
    "InvalidJob",
    "immutable_changes",
    "load_documents",
    "load_job",
    "printable",
    "semantic_errors",
    "validate",
    "warnings",
]


def _hosts_and_devices(job: PostTrainJob, placement: catalog.Placement) -> tuple[int, int]:
    res = job.spec.resources
    if res.pathways.enabled:  # one Pathways client process drives every device
        return 1, 1
    if placement.is_tpu:
        hosts = placement.hosts * res.slices
        return hosts, hosts * placement.devices_per_host
    return res.nodes, res.nodes * max(placement.devices_per_host, 1)


def _rollout_errors(
    job: PostTrainJob, placement: catalog.Placement
) -> tuple[list[FieldError], int | None]:
    """A trainer/sampler split (spec.grpo.rollout) that cannot work, and the trainer's
    device count when it can."""
    res = job.spec.resources
    hosts = placement.hosts * res.slices if placement.is_tpu else res.nodes
    if problem := rollout_split.multi_host_error(job.spec, hosts):
        return [FieldError(*problem)], None
    devices = rollout_split.job_devices(job, placement)
    if devices is None:
        return [], None
    found, problem = rollout_split.split(job.spec, devices)
    if problem:
        return [FieldError(*problem)], None
    return [], found.trainer_devices if found else None


def semantic_errors(job: PostTrainJob) -> list[FieldError]:
    """The checks beyond `posttrain.api.validate.spec_errors`: the trainer config's size,
    the catalog, derived name lengths, the batch split and the memory estimate."""
    spec = job.spec
    errors = []
    if too_large := size_error(job):
        errors.append(FieldError(*too_large))
    res = spec.resources
    if re.search(r"-0[0-9]", res.accelerator):
        errors.append(
            FieldError("spec.resources.accelerator", f"{res.accelerator!r}: no leading zeros")
        )
        return errors
    try:
        placement = catalog.resolve(
            res.accelerator, res.topology, res.gpus_per_node, res.machine_type
        )
    except catalog.CatalogError as e:
        errors.append(FieldError(f"spec.resources.{e.field}", str(e)))
        return errors
    name = job.metadata.name
    if kube_values.matches(kube_values.DNS_LABEL, name) and len(name) <= 63:
        try:
            check_name_lengths(name, spec, placement)
        except NameTooLong as e:
            errors.append(FieldError("metadata.name", str(e)))
    hosts, devices = _hosts_and_devices(job, placement)
    split_errors, trainer_devices = _rollout_errors(job, placement)
    errors += split_errors
    if trainer_devices is not None and devices > 1:
        devices = trainer_devices  # the trainer's mesh holds the batch
    generations = spec.grpo.num_generations if spec.grpo else 1
    if problem := batching.batch_split_error(
        spec.training.batch_size, spec.training.gradient_accumulation, hosts, devices, generations
    ):
        errors.append(FieldError("spec.training.batchSize", problem))
    need = capacity.sampler_need_gib(spec, placement)
    if need is not None and need > capacity.REFUSE_ABOVE * placement.memory_gib_per_device:
        errors.append(
            FieldError(
                "spec.grpo.rollout",
                f"the sampler's share needs about {need:.1f} GiB per device (its copy of the "
                f"model and the rollouts' KV cache) but a {placement.accelerator} device has "
                f"{placement.memory_gib_per_device:g} GiB; give the sampler more devices",
            )
        )
    verdict, message = capacity.admission(spec, placement)
    if verdict == "refuse":
        errors.append(FieldError("spec.resources.accelerator", message))
    return errors


def warnings(job: PostTrainJob) -> list[str]:
    """What admission warns about a valid job: a memory estimate within its uncertainty,
    or no memory check for want of a known architecture (posttrain.capacity)."""
    res = job.spec.resources
    try:
        placement = catalog.resolve(
            res.accelerator, res.topology, res.gpus_per_node, res.machine_type
        )
    except catalog.CatalogError:
        return []
    verdict, message = capacity.admission(job.spec, placement)
    return [printable(message)] if verdict == "warn" else []


def validate(doc: Any) -> tuple[PostTrainJob | None, list[FieldError]]:
    """Parse and check a PostTrainJob document. Returns the job (when it parsed) and
    every error found; an empty list means the job is valid."""
    job, errors = parse(doc)
    if job is None:
        return None, errors
    return job, errors + semantic_errors(job)


def load_job(path: str | Path, overrides: dict[str, Any] | None = None) -> PostTrainJob:
    """Read one PostTrainJob from a YAML file, with `overrides` (dotted paths, e.g. from
    command-line flags) applied before it is validated; raise InvalidJob naming every
    bad field."""
    docs = load_documents(path)
    if bad := [i for i, d in enumerate(docs, 1) if not isinstance(d, dict)]:
        raise InvalidJob(
            [
                FieldError(f"(document {i})", "expected a mapping (a Kubernetes object)")
                for i in bad
            ],
            str(path),
        )
    jobs = [d for d in docs if d.get("kind") == KIND] or docs
    if len(jobs) != 1:
        raise InvalidJob(
            [FieldError("(document)", f"expected one PostTrainJob, found {len(jobs)}")],
            str(path),
        )
    if overrides and isinstance(jobs[0], dict):
        override(jobs[0], overrides)
    job, errors = validate(jobs[0])
    if errors:
        raise InvalidJob(errors, str(path))
    assert job is not None
    return job
