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
from posttrain.api import batching, kube_values
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
    generations = spec.grpo.num_generations if spec.grpo else 1
    if problem := batching.batch_split_error(
        spec.training.batch_size, spec.training.gradient_accumulation, hosts, devices, generations
    ):
        errors.append(FieldError("spec.training.batchSize", problem))
    estimate = capacity.estimate(spec, placement)
    if estimate is not None and not estimate.fits:
        errors.append(
            FieldError("spec.resources.accelerator", capacity.refusal(spec, placement, estimate))
        )
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
    found = capacity.warning(job.spec, placement)
    return [printable(found)] if found else []


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
