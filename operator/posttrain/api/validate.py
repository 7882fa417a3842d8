"""Validate a PostTrainJob document and report every error with its field path.

`validate(doc)` is what `posttrain validate`, `posttrain run` and the admission webhook
call. It combines the schema (pydantic), the cross-field rules (also in the CRD as CEL),
and the checks CEL cannot express: the accelerator catalog and name-length limits.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from posttrain import catalog
from posttrain.api import rules
from posttrain.api.spec import API_VERSION, KIND, PostTrainJob

DNS1035 = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")


@dataclass(frozen=True)
class FieldError:
    field: str  # e.g. spec.training.batchSize
    message: str

    def __str__(self) -> str:
        return f"{self.field}: {self.message}"


class InvalidJob(ValueError):
    """A PostTrainJob that cannot run; `errors` names every bad field."""

    def __init__(self, errors: list[FieldError], source: str = "PostTrainJob"):
        self.errors = errors
        lines = "\n".join(f"  {e}" for e in errors)
        super().__init__(f"{source} is invalid:\n{lines}")


def _loc_to_path(loc: tuple[Any, ...]) -> str:
    path = ""
    for part in loc:
        if isinstance(part, int):
            path += f"[{part}]"
        elif not path:
            path = str(part)
        else:
            path += f".{part}"
    return path


def _pydantic_errors(err: ValidationError) -> list[FieldError]:
    out = []
    for e in err.errors():
        msg = "unknown field" if e["type"] == "extra_forbidden" else e["msg"]
        out.append(FieldError(_loc_to_path(e["loc"]), msg))
    return out


def semantic_errors(job: PostTrainJob) -> list[FieldError]:
    """Checks beyond the schema: cross-field rules, the catalog, derived name lengths."""
    from posttrain.render.names import NameTooLong, check_name_lengths

    spec = job.spec
    errors = [FieldError(field, message) for field, message in rules.errors(spec)]
    res = spec.resources
    try:
        placement = catalog.resolve(
            res.accelerator, res.topology, res.gpus_per_node, res.machine_type
        )
    except catalog.CatalogError as e:
        field = "spec.resources.topology" if res.topology and "topology" in str(e) else None
        errors.append(FieldError(field or "spec.resources.accelerator", str(e)))
        return errors
    if not DNS1035.match(job.metadata.name) or len(job.metadata.name) > 63:
        errors.append(
            FieldError(
                "metadata.name",
                f"{job.metadata.name!r} must be a DNS label: at most 63 lowercase letters, "
                "digits and '-', starting with a letter (it names the JobSet and its Service)",
            )
        )
    else:
        try:
            check_name_lengths(job.metadata.name, spec, placement)
        except NameTooLong as e:
            errors.append(FieldError("metadata.name", str(e)))
    return errors


def validate(doc: Any) -> tuple[PostTrainJob | None, list[FieldError]]:
    """Parse and check a PostTrainJob document. Returns the job (when it parsed) and
    every error found; an empty list means the job is valid."""
    if not isinstance(doc, dict):
        return None, [FieldError("(document)", "expected a PostTrainJob mapping")]
    errors: list[FieldError] = []
    if doc.get("apiVersion") != API_VERSION:
        errors.append(FieldError("apiVersion", f"must be {API_VERSION}"))
    if doc.get("kind") != KIND:
        errors.append(FieldError("kind", f"must be {KIND}"))
    body = {k: v for k, v in doc.items() if k not in ("apiVersion", "kind")}
    try:
        job = PostTrainJob.model_validate(body)
    except ValidationError as e:
        return None, errors + _pydantic_errors(e)
    return job, errors + semantic_errors(job)


def immutable_changes(old_spec: dict[str, Any], new_spec: dict[str, Any]) -> list[FieldError]:
    """Fields that changed but may not (the Python twin of the CRD's transition rules)."""
    errors = []
    for path in rules.IMMUTABLE:
        old, new = old_spec, new_spec
        for part in path.split("."):
            old = (old or {}).get(part)
            new = (new or {}).get(part)
        if old != new:
            errors.append(FieldError(f"spec.{path}", rules.immutable_message(path)))
    return errors


def load_documents(path: str | Path) -> list[dict[str, Any]]:
    """Every non-empty YAML document in a file."""
    text = Path(path).read_text()
    try:
        return [d for d in yaml.safe_load_all(text) if d is not None]
    except yaml.YAMLError as e:
        raise InvalidJob([FieldError("(yaml)", str(e))], str(path)) from e


def load_job(path: str | Path) -> PostTrainJob:
    """Read one PostTrainJob from a YAML file; raise InvalidJob naming every bad field."""
    docs = [d for d in load_documents(path) if d.get("kind") == KIND] or load_documents(path)
    if len(docs) != 1:
        raise InvalidJob(
            [FieldError("(document)", f"expected one PostTrainJob, found {len(docs)}")],
            str(path),
        )
    job, errors = validate(docs[0])
    if errors:
        raise InvalidJob(errors, str(path))
    assert job is not None
    return job
