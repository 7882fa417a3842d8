"""The progress deadline (spec.scheduling.progressDeadlineSeconds), shared by the
operator, which restarts or fails a job whose trainer stops reporting, and the trainer's
own watchdog, which exits with every thread's stack when its loop stops moving.

The trainer reports what it is doing as status.progress.phase, with updatedAt, at least
every HEARTBEAT_INTERVAL_S while it runs and at once when the phase changes. How long a
phase may go without a report is `deadline_seconds`: the spec's deadline, and
FIRST_STEP_FACTOR times as long for the phases a first compile or a large export may
take (everything before the first step of each start, and exporting).
"""

from __future__ import annotations

DEFAULT_DEADLINE_S = 1800
HEARTBEAT_INTERVAL_S = 30.0
FIRST_STEP_FACTOR = 3
OPERATOR_GRACE_S = 60

LOADING = "loading"
COMPILING = "compiling"
TRAINING = "training"
EVALUATING = "evaluating"
CHECKPOINTING = "checkpointing"
EXPORTING = "exporting"
PHASES = (LOADING, COMPILING, TRAINING, EVALUATING, CHECKPOINTING, EXPORTING)
# Phases before the first step, and the export: a first compile of a large model, a
# model read from a bucket, an export written to one.
LONG_PHASES = frozenset({LOADING, COMPILING, EXPORTING})


def phase_of(doing: str | None) -> str:
    """The phase named by the trainer's label of what it does ("compiling and running
    step 1", "evaluating step 20", ...); None (steps run again): training."""
    if not doing:
        return TRAINING
    first = doing.split(maxsplit=1)[0].lower()
    return first if first in PHASES else TRAINING


def operator_grace_seconds(deadline: int) -> int:
    """How much later than the trainer's watchdog the operator acts: the watchdog's
    exit, with the stack of every thread, comes first where the trainer can still exit
    (and the trainer writes its heartbeat at most HEARTBEAT_INTERVAL_S apart)."""
    return min(OPERATOR_GRACE_S, deadline // 10)


def deadline_seconds(deadline: int, phase: str | None) -> int | None:
    """How long the trainer may stay in `phase` (None: it has not reported since it
    started) without a report; None when the deadline is off (0)."""
    if deadline <= 0:
        return None
    if phase is None or phase in LONG_PHASES:
        return deadline * FIRST_STEP_FACTOR
    return deadline
