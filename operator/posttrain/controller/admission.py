"""The validating admission webhook: checks the CRD's CEL cannot express.

The API server has already applied the schema and CEL rules; this runs
`posttrain.checks.validate`, the same function as `posttrain validate` (the
accelerator catalog, derived name lengths, locations, user regexes, LoRA module names
per family, the batch split and whether the job fits in accelerator memory), and the
immutable-field rules on update. `admission_errors` is pure; `webhook.py` serves it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from posttrain.api.spec import PostTrainJob
from posttrain.checks import FieldError, immutable_changes, validate, warnings
from posttrain.controller.preflight import MEMORY_REFUSAL
from posttrain.render.preflight import PreflightConfig, applies


def _compiled_first(
    job: PostTrainJob | None, errors: list[FieldError], preflight: PreflightConfig | None
) -> tuple[list[FieldError], list[FieldError]]:
    """(errors, the fast estimate's memory refusals left to the TPU compiler): a TPU job
    the operator compiles before it takes TPUs (spec.preflight) is refused for its
    memory by the compiler's answer, not by the estimate's."""
    if job is None or preflight is None or not applies(job, preflight):
        return errors, []
    memory = [e for e in errors if e.message.startswith(MEMORY_REFUSAL)]
    return [e for e in errors if e not in memory], memory


def admission_errors(
    body: dict[str, Any], old: dict[str, Any] | None, preflight: PreflightConfig | None = None
) -> list[FieldError]:
    job, errors = validate(body)
    errors, _ = _compiled_first(job, errors, preflight)
    if old:
        errors += immutable_changes(old.get("spec") or {}, body.get("spec") or {})
    return errors


def admission_warnings(body: dict[str, Any], preflight: PreflightConfig | None = None) -> list[str]:
    """Warnings for a job admission_errors admits: the memory estimate is within its
    uncertainty, or no memory check could be made (the same lines posttrain validate
    prints); or, for a job the TPU compiler checks first, the estimate's refusal."""
    job, errors = validate(body)
    errors, memory = _compiled_first(job, errors, preflight)
    if job is None or errors:
        return []
    if memory:
        return [
            f"{e}; the TPU compiler decides before the job takes TPUs (spec.preflight): "
            "the job fails then if it does not fit"
            for e in memory
        ]
    return warnings(job)


# exists(kind, name, namespace) -> True, False, or None when it could not be read.
Exists = Callable[[str, str, str | None], bool | None]


def reference_checks(
    body: dict[str, Any], exists: Exists, old: dict[str, Any] | None = None
) -> tuple[list[FieldError], list[str]]:
    """Objects the job names that must exist: a PriorityClass or Kueue
    WorkloadPriorityClass that does not is an error (the pods, or Kueue's Workload, would
    never be created); a missing LocalQueue is a warning (the job waits in phase Queued
    until it exists). A lookup that failed (None) is neither. On update only names that
    changed are checked, so a job stays editable (say, suspendable) after a class it
    was created with is gone."""
    before = ((old or {}).get("spec") or {}).get("scheduling") or {}
    scheduling = {
        k: v
        for k, v in ((body.get("spec") or {}).get("scheduling") or {}).items()
        if before.get(k) != v
    }
    namespace = (body.get("metadata") or {}).get("namespace")
    errors: list[FieldError] = []
    warnings: list[str] = []
    if (name := scheduling.get("priorityClass")) and exists("PriorityClass", name, None) is False:
        errors.append(
            FieldError(
                "spec.scheduling.priorityClass",
                f"PriorityClass {name!r} does not exist (kubectl get priorityclasses lists them)",
            )
        )
    wpc = scheduling.get("workloadPriorityClass")
    if wpc and exists("WorkloadPriorityClass", wpc, None) is False:
        errors.append(
            FieldError(
                "spec.scheduling.workloadPriorityClass",
                f"Kueue WorkloadPriorityClass {wpc!r} does not exist, so Kueue would never "
                "admit the job (kubectl get workloadpriorityclasses lists them)",
            )
        )
    queue = scheduling.get("queue")
    if queue and exists("LocalQueue", queue, namespace) is False:
        warnings.append(
            f"spec.scheduling.queue: Kueue LocalQueue {queue!r} does not exist in namespace "
            f"{namespace!r}; the job waits in phase Queued until it does"
        )
    return errors, warnings
