"""Which base model an exported PEFT adapter names, in terms that hold on another machine.

``adapter_config.json``'s ``base_model_name_or_path`` (and ``revision``) is what
``AutoPeftModelForCausalLM.from_pretrained(ADAPTER_DIR)`` loads the base from. posttrain
writes what identifies the job's ``spec.model.source`` anywhere: the Hub repository id
(and revision) of an ``hf://`` source, the ``gs://`` URI of a bucket, and a local path as
the job gave it (not made absolute: a path on the training machine means nothing on
another one; ``./`` before a relative ``dir/name``, which would read as a Hub id). ``posttrain export JOB --base NAME`` names another location of the same
model. The adapter's ``README.md`` (``model_card``) says which it is and how to load the
adapter onto a copy of the base elsewhere.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from posttrain.trainer import storage

BASE_FLAG = "--base"


@dataclasses.dataclass(frozen=True)
class BaseModel:
    """``name`` and ``revision`` for adapter_config.json; ``kind`` is hub | gcs | path."""

    name: str
    revision: str | None
    kind: str


def base_model(source: str, base: str | None = None) -> BaseModel:
    """What the adapter of a job whose model came from `source` names as its base: `base`
    (``--base``) when given, else `source`. ``hf://org/name[@rev]`` becomes the Hub id and
    revision; ``gs://`` stays as written; a path stays as given (``./`` before a relative
    one of two parts, which would read as a Hub id); an ``org/name`` given as ``--base``
    that is no existing directory is a Hub id."""
    chosen = source if base is None else base.strip()
    if not chosen:
        raise ValueError(f"{BASE_FLAG}: an empty base model name")
    if chosen.startswith("hf://"):
        repo, _, revision = chosen.removeprefix("hf://").partition("@")
        return BaseModel(repo, revision or None, "hub")
    if storage.is_gcs(chosen):
        return BaseModel(chosen, None, "gcs")
    if is_hub_id(chosen):
        if base is not None and not Path(chosen).exists():
            return BaseModel(chosen, None, "hub")
        chosen = f"./{chosen}"  # the same path, which from_pretrained cannot take for a Hub id
    return BaseModel(chosen, None, "path")


def is_hub_id(name: str) -> bool:
    """`org/name`: two parts, neither starting with a dot (``./x``, ``../x`` are paths)."""
    parts = name.split("/")
    return len(parts) == 2 and all(p and not p.startswith(".") for p in parts)


def model_card(base: BaseModel, source: str) -> str:
    """The adapter's README.md: its base model and how to load it elsewhere."""
    front = ["---", "library_name: peft"]
    if base.kind == "hub":
        front.append(f"base_model: {base.name}")
    front.append("---")
    at = f" at revision `{base.revision}`" if base.revision else ""
    where = {
        "hub": f"the Hugging Face Hub repository `{base.name}`{at}",
        "gcs": f"the Cloud Storage prefix `{base.name}`",
        "path": f"the local directory `{base.name}`",
    }[base.kind]
    lines = [
        *front,
        "",
        "# A LoRA adapter trained with posttrain",
        "",
        f"`adapter_config.json` names the base model as {where}"
        + (f" (the job's `spec.model.source` was `{source}`)." if source != base.name else "."),
    ]
    if base.kind == "hub":
        lines += [
            "",
            "```python",
            "from peft import AutoPeftModelForCausalLM",
            "",
            'model = AutoPeftModelForCausalLM.from_pretrained("ADAPTER_DIR")',
            "```",
        ]
    else:
        if base.kind == "gcs":
            note = (
                "Note: transformers does not read `gs://`, so "
                "`AutoPeftModelForCausalLM.from_pretrained(ADAPTER_DIR)` cannot load this base. "
                "Copy the model to a directory and load the base from it:"
            )
        else:
            relative = (
                ""
                if Path(base.name).is_absolute()
                else (", relative to the directory the job ran in")
            )
            note = (
                f"Note: it is a path on the machine that trained the adapter{relative}. "
                "`AutoPeftModelForCausalLM.from_pretrained(ADAPTER_DIR)` finds it only where "
                "that path holds the model. Elsewhere, load the base from your copy:"
            )
        lines += [
            "",
            note,
            "",
            "```python",
            "from peft import PeftModel",
            "from transformers import AutoModelForCausalLM",
            "",
            'base = AutoModelForCausalLM.from_pretrained("YOUR_COPY_OF_THE_BASE")',
            'model = PeftModel.from_pretrained(base, "ADAPTER_DIR")',
            "```",
            "",
            "or export the adapter again naming it: `posttrain export JOB.yaml --base "
            "YOUR_COPY_OF_THE_BASE` (a path, or a Hub id such as `org/name`).",
        ]
    return "\n".join(lines) + "\n"
