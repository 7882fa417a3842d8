"""The validating admission webhook: checks the CRD's CEL cannot express.

The API server has already applied the schema and CEL rules; this adds the accelerator
catalog, derived name lengths, LoRA module names per family and patterns, and whether the job fits in
accelerator memory. `admission_errors` is pure; `webhook.py` serves it.
"""

from __future__ import annotations

import re
from typing import Any

from posttrain import capacity, catalog
from posttrain.api import lora_modules
from posttrain.api.validate import FieldError, immutable_changes, validate


def admission_errors(body: dict[str, Any], old: dict[str, Any] | None) -> list[FieldError]:
    job, errors = validate(body)
    if old:
        errors += immutable_changes(old.get("spec") or {}, body.get("spec") or {})
    if job is None or errors:
        return errors
    spec = job.spec
    if spec.lora and spec.lora.target_modules:
        family, targets = spec.model.family, spec.lora.target_modules
        if unknown := lora_modules.unknown_names(family, targets):
            names = ", ".join(map(repr, unknown))
            errors.append(
                FieldError(
                    "spec.lora.targetModules", f"{family} models have no module named {names}"
                )
            )
        try:
            re.compile(targets)
        except re.error as e:
            errors.append(
                FieldError("spec.lora.targetModules", f"not a valid regular expression: {e}")
            )
    res = spec.resources
    placement = catalog.resolve(res.accelerator, res.topology, res.gpus_per_node, res.machine_type)
    estimate = capacity.estimate(spec, placement)
    if estimate is not None and not estimate.fits:
        errors.append(
            FieldError(
                "spec.resources.accelerator",
                f"the job does not fit: {estimate.explain()}; use LoRA, a larger slice, "
                "more slices or nodes, or a smaller batchSize/maxLength",
            )
        )
    return errors
