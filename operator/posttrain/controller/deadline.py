"""Whether a running job's trainer has stopped reporting progress
(spec.scheduling.progressDeadlineSeconds; `posttrain.api.heartbeat`): a pure function of
the job's spec, its status.progress (the trainer's heartbeat), the JobSet's restarts and
its pods' start times, table-tested in tests/unit/test_actions.py. `actions.decide`
restarts the JobSet or fails the job on its verdict.

A start of the trainer (the JobSet's current attempt) counts from its pods' newest
startTime; a report from an earlier start (updatedAt before it) does not count for it.
The operator acts `heartbeat.operator_grace_seconds` after the deadline, so that a
trainer that can still exit does so first, with the stack of every thread in its log.
"""

from __future__ import annotations

import datetime
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from posttrain.api import heartbeat
from posttrain.controller.phase import PodState

REASON = "ProgressDeadlineExceeded"


@dataclass(frozen=True)
class Verdict:
    stalled: str | None = None  # why, when the deadline passed: "no progress since ..."
    check_in: float | None = None  # seconds until the deadline passes, when it has not


def _time(text: Any) -> datetime.datetime | None:
    if not isinstance(text, str) or not text:
        return None
    try:
        parsed = datetime.datetime.fromisoformat(text)
    except ValueError:
        return None
    return parsed if parsed.tzinfo else parsed.replace(tzinfo=datetime.UTC)


def _clock(at: datetime.datetime) -> str:
    return at.astimezone(datetime.UTC).strftime("%H:%M UTC")


def _duration(seconds: int) -> str:
    if seconds % 3600 == 0:
        return f"{seconds // 3600}h"
    if seconds % 60 == 0:
        return f"{seconds // 60}m"
    return f"{seconds}s"


def check(
    spec: dict[str, Any],
    progress: dict[str, Any] | None,
    restarts: int,
    pods: Iterable[PodState],
    now: str,
) -> Verdict:
    """The verdict on a job that runs (every pod of its leader slice runs), from its spec,
    its status.progress, the JobSet's restarts and the job's pods."""
    scheduling = spec.get("scheduling") or {}
    seconds = scheduling.get("progressDeadlineSeconds", heartbeat.DEFAULT_DEADLINE_S)
    current = [p for p in pods if p.attempt is None or p.attempt == restarts]
    starts = [t for p in current if (t := _time(p.started_at)) is not None]
    now_at = _time(now)
    if not isinstance(seconds, int) or seconds <= 0 or not starts or now_at is None:
        return Verdict()
    started = max(starts)
    progress = progress or {}
    beat = _time(progress.get("updatedAt"))
    if beat is None or beat < started:  # nothing reported since this start
        since, phase = started, None
        last = "no report since the trainer started"
    else:
        since, phase = beat, progress.get("phase") or heartbeat.TRAINING
        step = progress.get("step")
        last = f"last: step {step}, {phase}" if step is not None else f"last: {phase}"
    allowed = heartbeat.deadline_seconds(seconds, phase)
    assert allowed is not None  # seconds > 0
    grace = heartbeat.operator_grace_seconds(seconds)  # the watchdog's exit first
    left = allowed + grace - (now_at - since).total_seconds()
    if left > 0:
        return Verdict(check_in=left)
    return Verdict(
        stalled=f"no progress since {_clock(since)} ({last}; deadline {_duration(allowed)}, "
        "spec.scheduling.progressDeadlineSeconds)"
    )
