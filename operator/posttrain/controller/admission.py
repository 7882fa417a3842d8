"""The validating admission webhook: checks the CRD's CEL cannot express.

The API server has already applied the schema and CEL rules; this runs
`posttrain.api.validate.validate`, the same function as `posttrain validate` (the
accelerator catalog, derived name lengths, locations, user regexes, LoRA module names
per family, the batch split and whether the job fits in accelerator memory), and the
immutable-field rules on update. `admission_errors` is pure; `webhook.py` serves it.
"""

from __future__ import annotations

from typing import Any

from posttrain.api.validate import FieldError, immutable_changes, validate


def admission_errors(body: dict[str, Any], old: dict[str, Any] | None) -> list[FieldError]:
    _, errors = validate(body)
    if old:
        errors += immutable_changes(old.get("spec") or {}, body.get("spec") or {})
    return errors
