"""Read a PostTrainJob document as the API server reads it, and report every error with
its field path.

`parse(doc)` is the schema (pydantic, read as strictly as the CRD: no coercion of
quoted numbers or booleans, camelCase names only, finite numbers, nulls pruned), the
cross-field rules (also in the CRD as CEL) and the checks that need nothing but the API
(locations, user regexes, LoRA module names, a local model's config.json, columns).
What needs the accelerator catalog, the renderer's derived names or the memory estimate
is one floor up, in `posttrain.checks`, whose `validate(doc)` is what `posttrain
validate`, `posttrain run`, the trainer, the admission webhook and the operator call.
"""

from __future__ import annotations

import difflib
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, get_args

from pydantic import BaseModel, ValidationError

from posttrain.api import functions, kube_values, lora_modules, model_shapes, rules
from posttrain.api.documents import DocumentError, read_documents
from posttrain.api.locations import mount_path_error
from posttrain.api.spec import API_VERSION, KIND, PostTrainJob, PostTrainJobStatus

_ESCAPED = re.compile(r"[\x00-\x1f\x7f-\x9f\u061c\u200b-\u200f\u2028-\u202e\u2066-\u2069\ufeff]")


def printable(text: str) -> str:
    """`text` with control and bidirectional characters escaped (\\n, \\x1b, \\u202e), so
    that user input echoed in a message cannot forge lines or reorder them."""
    return _ESCAPED.sub(lambda m: m.group(0).encode("unicode_escape").decode(), text)


@dataclass(frozen=True)
class FieldError:
    field: str  # e.g. spec.training.batchSize
    message: str

    def __str__(self) -> str:
        return f"{printable(self.field)}: {printable(self.message)}"


class InvalidJob(ValueError):
    """A PostTrainJob that cannot run; `errors` names every bad field. Its message has
    one line per error: `source: field: message`."""

    def __init__(self, errors: list[FieldError], source: str = "PostTrainJob"):
        self.errors = errors
        self.source = source
        super().__init__("\n".join(f"{printable(source)}: {e}" for e in errors))


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


def _model_at(loc: tuple[Any, ...]) -> type[BaseModel] | None:
    """The model whose fields hold the last part of `loc` (list indexes skipped)."""
    model: type[BaseModel] = PostTrainJob
    for part in loc[:-1]:
        if isinstance(part, int):
            continue
        field = next(
            (f for name, f in model.model_fields.items() if (f.alias or name) == part), None
        )
        if field is None:
            return None
        found = _inner_model(field.annotation)
        if found is None:
            return None
        model = found
    return model


def _inner_model(annotation: Any) -> type[BaseModel] | None:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in get_args(annotation):
        if (found := _inner_model(arg)) is not None:
            return found
    return None


def _did_you_mean(loc: tuple[Any, ...]) -> str:
    """` (did you mean X?)` for an unknown field close to a known one (camelCase for
    snake_case, another case, a typo); empty when none is."""
    model = _model_at(loc)
    if model is None or not isinstance(loc[-1], str):
        return ""
    known = [f.alias or name for name, f in model.model_fields.items()]
    squash = {k.lower().replace("_", ""): k for k in known}
    wrong = loc[-1]
    match = squash.get(wrong.lower().replace("_", "")) or next(
        iter(difflib.get_close_matches(wrong, known, n=1, cutoff=0.75)), None
    )
    return f" (did you mean {match}?)" if match else ""


# What a user may mean by a technique posttrain has under another name.
TECHNIQUE_HINTS = {
    "orpo": "ORPO is technique: dpo with dpo.algorithm: orpo",
    "rlhf": "reinforcement learning from rewards is technique: grpo",
    "ppo": "posttrain's policy-gradient technique is grpo (grpo.lossAlgorithm picks the loss)",
    "dapo": "DAPO is technique: grpo with grpo.lossAlgorithm: dapo",
    "distillation": "distillation is technique: distill",
    "lora": "LoRA is spec.lora beside any technique",
}
DATASET_HINT = (
    "; a Hugging Face dataset is read from a copy: save it with datasets' save_to_disk, "
    "or as parquet or jsonl, and give that directory or file (a path or gs://bucket/path)"
)


def _hint(path: str, e: Any) -> str:
    """A hint for a mistake with an answer: a technique under another name, a dataset
    named by hf://."""
    if path == "spec.technique" and isinstance(e.get("input"), str):
        hint = TECHNIQUE_HINTS.get(e["input"].strip().lower())
        return f" ({hint})" if hint else ""
    data_source = path.startswith(("spec.data.", "spec.eval.")) and path.endswith(".source")
    if data_source and str(e.get("input", "")).lower().startswith("hf://"):
        return DATASET_HINT
    return ""


def _pydantic_errors(err: ValidationError) -> list[FieldError]:
    out = []
    for e in err.errors():
        path = _loc_to_path(e["loc"])
        if e["type"] == "extra_forbidden":
            msg = "unknown field" + _did_you_mean(tuple(e["loc"]))
        else:
            msg = e["msg"].removeprefix("Value error, ") + _hint(path, e)
        out.append(FieldError(path, msg))
    return out


def _columns_errors(job: PostTrainJob) -> list[FieldError]:
    """A column may play one role only (chosen and rejected from one column is no
    preference, prompt and completion from one column trains nothing)."""
    cols = job.spec.data.columns
    roles = {
        "dpo": ("prompt", "chosen", "rejected"),
        "grpo": ("prompt", "answer"),
        "sft": ("prompt", "completion"),
        "distill": ("prompt", "completion"),
    }[job.spec.technique]
    seen: dict[str, str] = {}
    errors = []
    for role in roles:
        name = getattr(cols, role)
        if name in seen:
            errors.append(
                FieldError(
                    f"spec.data.columns.{role}",
                    f"column {name!r} is already spec.data.columns.{seen[name]}; "
                    "each role needs its own column",
                )
            )
        seen.setdefault(name, role)
    return errors


def _lora_errors(job: PostTrainJob) -> list[FieldError]:
    spec = job.spec
    if spec.lora is None:
        return []
    errors = []
    family, targets = spec.model.family, spec.lora.target_modules
    if targets and (unknown := lora_modules.unknown_names(family, targets)):
        names = ", ".join(map(repr, unknown))
        errors.append(
            FieldError("spec.lora.targetModules", f"{family} models have no module named {names}")
        )
    hidden = model_shapes.hidden_size(spec.model.source)
    if hidden is not None and spec.lora.rank > hidden:
        errors.append(
            FieldError(
                "spec.lora.rank",
                f"rank {spec.lora.rank} is above the hidden size of this model ({hidden}); "
                "an adapter that large is no low-rank adapter",
            )
        )
    return errors


def _model_config_errors(job: PostTrainJob) -> list[FieldError]:
    """A model's config.json at hand is input too: one that is not a model's config is
    refused, naming the file and the key."""
    spec = job.spec
    sources = [("spec.model.source", spec.model.source)]
    if spec.distill is not None:
        sources.append(("spec.distill.teacher.source", spec.distill.teacher.source))
    return [
        FieldError(field, problem)
        for field, source in sources
        if (problem := model_shapes.config_problem(source))
    ]


def _images_errors(job: PostTrainJob) -> list[FieldError]:
    """Images need a checkpoint with a vision tower (the family rule is in rules.py)."""
    spec = job.spec
    if spec.data.columns.images is None or spec.model.family not in ("auto", "gemma3"):
        return []
    if model_shapes.has_vision_tower(spec.model.source) is False:
        return [
            FieldError(
                "spec.data.columns.images",
                f"images need a model with a vision tower; {spec.model.source} has none "
                "(a Gemma3ForConditionalGeneration checkpoint, Gemma 3 4B or larger, has one)",
            )
        ]
    return []


def _as_json(doc: Any) -> str | None:
    """The document as the JSON kubectl would send (None when YAML-only values, such as
    binary data or sets, have no JSON form)."""
    try:
        return json.dumps(doc, allow_nan=True)
    except (TypeError, ValueError):
        return None


def _pruned(value: Any) -> Any:
    """`value` without null values in its mappings: the API server prunes a null where
    the schema does not allow one, so `lora: null` or `steps: null` is no value."""
    if isinstance(value, dict):
        return {k: _pruned(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_pruned(v) for v in value]
    return value


def spec_errors(job: PostTrainJob) -> list[FieldError]:
    """The checks beyond the schema that need nothing but the API: cross-field rules,
    a local model's config.json, columns, LoRA, images, the volume's mount path, the
    name as a DNS label and the rest of metadata as the API server checks it."""
    spec = job.spec
    errors = [FieldError(field, message) for field, message in rules.errors(spec)]
    errors += _model_config_errors(job)
    errors += _columns_errors(job) + _lora_errors(job) + _images_errors(job)
    if spec.output.persistent_volume_claim and (problem := mount_path_error(spec.output.uri)):
        errors.append(FieldError("spec.output.uri", f"the volume's mount path {problem}"))
    rewards = spec.grpo.rewards if spec.grpo else []
    allowed = functions.allowed_modules()  # the installation's, where it set them
    for i, reward in enumerate(rewards):
        if reward.function and (why := functions.function_error(reward.function, allowed)):
            errors.append(FieldError(f"spec.grpo.rewards[{i}].function", why))
    tools = spec.grpo.agent.tools if spec.grpo and spec.grpo.agent else []
    for i, tool in enumerate(tools):
        if tool.function and (why := functions.function_error(tool.function, allowed)):
            errors.append(FieldError(f"spec.grpo.agent.tools[{i}].function", why))
        if tool.parameters is not None and tool.parameters.get("type") != "object":
            errors.append(
                FieldError(
                    f"spec.grpo.agent.tools[{i}].parameters",
                    'is a JSON schema of the arguments object: {"type": "object", '
                    '"properties": {...}}',
                )
            )
    meta = job.metadata
    errors += [
        FieldError(field, message)
        for field, message in kube_values.metadata_errors(
            {"namespace": meta.namespace, "labels": meta.labels, "annotations": meta.annotations}
        )
    ]
    name = job.metadata.name
    if not kube_values.matches(kube_values.DNS_LABEL, name) or len(name) > 63:
        errors.append(
            FieldError(
                "metadata.name",
                f"{name!r} must be a DNS label: at most 63 lowercase letters, "
                "digits and '-', starting with a letter (it names the JobSet and its Service)",
            )
        )
    return errors


def parse(doc: Any) -> tuple[PostTrainJob | None, list[FieldError]]:
    """Parse a PostTrainJob document as the API server reads it, with `spec_errors`.
    Returns the job (when it parsed) and every error found. The checks that need the
    catalog, the renderer or the memory estimate are `posttrain.checks.validate`'s."""
    if not isinstance(doc, dict):
        return None, [FieldError("(document)", "expected a PostTrainJob mapping")]
    errors: list[FieldError] = []
    if doc.get("apiVersion") != API_VERSION:
        errors.append(FieldError("apiVersion", f"must be {API_VERSION}"))
    if doc.get("kind") != KIND:
        errors.append(FieldError("kind", f"must be {KIND}"))
    # What users write is read as strictly as the API server reads it; status is written
    # by the operator and the trainer.
    body = _as_json(
        {k: _pruned(v) for k, v in doc.items() if k not in ("apiVersion", "kind", "status")}
    )
    if body is None:
        return None, errors + [FieldError("(document)", "holds values JSON cannot carry")]
    try:
        job = PostTrainJob.model_validate_json(body, strict=True, by_alias=True, by_name=False)
    except ValidationError as e:
        return None, errors + _pydantic_errors(e)
    if doc.get("status") is not None:
        try:
            job.status = PostTrainJobStatus.model_validate(doc["status"])
        except ValidationError as e:
            return None, errors + [
                FieldError(f"status.{x.field}", x.message) for x in _pydantic_errors(e)
            ]
    return job, errors + spec_errors(job)


def immutable_changes(old_spec: dict[str, Any], new_spec: dict[str, Any]) -> list[FieldError]:
    """Fields that changed but may not (the Python twin of the immutable-fields
    admission policy, `crd.immutable_fields_policy`)."""
    errors = []
    for path in rules.IMMUTABLE:
        old, new = old_spec, new_spec
        for part in path.split("."):
            old = (old or {}).get(part)
            new = (new or {}).get(part)
        if old != new:
            errors.append(FieldError(f"spec.{path}", rules.immutable_message(path)))
    return errors


def load_documents(path: str | Path) -> list[Any]:
    """Every non-empty YAML document in a file (InvalidJob naming the file when it is
    not readable YAML within posttrain.api.documents' limits)."""
    try:
        return read_documents(path)
    except DocumentError as e:
        raise InvalidJob([FieldError(e.field, str(e))], str(path)) from e


def override(doc: Any, overrides: dict[str, Any]) -> None:
    """Set dotted spec paths (spec.training.steps) in a document before it is validated."""
    for path, value in overrides.items():
        node = doc
        *parents, leaf = path.split(".")
        for part in parents:
            if not isinstance(node.get(part), dict):
                node[part] = {}
            node = node[part]
        node[leaf] = value
