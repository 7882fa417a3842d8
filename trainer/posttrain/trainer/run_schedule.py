"""The schedule a run's checkpoints were made under, kept beside them (schedule.json under
output.uri, and in summary.json), so that a run with another schedule (`posttrain run
--steps`, an edited file) does not silently continue them as if they were its own: a
checkpoint made with the warmup capped to 1 for a 2-step try is no step 2 of the 30-step
run. A changed schedule is refused before anything loads, saying how to go on; only
`steps` may change under a constant schedule (every step's learning rate stays)."""

from __future__ import annotations

import json
import logging
from typing import Any

from posttrain.trainer import storage

log = logging.getLogger("posttrain.trainer")
RECORD = "schedule.json"
# spec.training's fields that make the learning-rate schedule and what a step trains on.
FIELDS = {
    "steps": "steps",
    "batchSize": "batch_size",
    "learningRate": "learning_rate",
    "warmupSteps": "warmup_steps",
    "schedule": "schedule",
}


def schedule_of(spec: Any) -> dict[str, Any]:
    """The run's schedule, as its spec.training names it."""
    training = spec.training
    return {name: _plain(getattr(training, attr)) for name, attr in FIELDS.items()}


def _plain(value: Any) -> Any:
    return value.value if hasattr(value, "value") else value


def _has_checkpoints(uri: str) -> bool:
    return any(d.isdigit() for d in storage.list_dirs(storage.join(uri, "checkpoints")))


def _shown(schedule: dict[str, Any], names: list[str]) -> str:
    return ", ".join(f"{name} {schedule.get(name)}" for name in names)


def check_and_record(spec: Any, is_main: bool) -> None:
    """Refuse (a ValueError naming spec.training's first changed field) to resume
    checkpoints under output.uri made with another schedule; else record this run's
    schedule there (process 0). An output without a record (older runs) resumes."""
    uri = spec.output.uri
    path = storage.join(uri, RECORD)
    ours = schedule_of(spec)
    try:
        theirs = json.loads(storage.read_text(path))
    except (OSError, ValueError):  # absent (a new run, an older one) or unreadable
        theirs = None
    changed = [k for k in ours if isinstance(theirs, dict) and theirs.get(k) != ours[k]]
    if changed == ["steps"] and ours["schedule"] == "constant":
        changed = []  # the same learning rate at every step: more (or fewer) steps of it
    if changed and _has_checkpoints(uri):
        raise ValueError(
            f"spec.training.{changed[0]}: {uri} holds checkpoints of a run with "
            f"{_shown(theirs, changed)}, not {_shown(ours, changed)}; resuming them would "
            "train under a schedule neither run asked for. Give this run its own output "
            "(posttrain run --output DIR, or spec.output.uri) or remove "
            f"{uri} to start over; or, to continue that run, run it with its own schedule "
            f"({_shown(theirs, changed)})"
        )
    if is_main and theirs != ours:
        storage.write_text(path, json.dumps(ours, indent=2) + "\n")
