"""Goodput: where a run's wall time went, over every attempt (restart) of the run.

The trainer charges each stretch of its wall time to one category:

- productive: optimizer steps whose result the run keeps;
- compile: the first step of each attempt (tracing and compiling the step, plus that
  step's own compute) and any compilation JAX reports during a later step;
- dataWait: waiting for the next batch while the device had nothing queued;
- checkpoint: saving checkpoints (and waiting for asynchronous saves to land);
- eval: held-out evaluation (spec.eval), its compilation included;
- startup: from the start of an attempt to its first step (loading the model and data,
  restoring the checkpoint);
- restart: the time between attempts, from the previous attempt's last record to this
  attempt's start (the pod restarting, rescheduling);
- lost: steps done after the newest checkpoint an attempt resumed from, which the run
  redid (moved out of productive when the next attempt starts, so counted once);
- other: the rest (logging, status, export).

Goodput is productive / total; the fractions add up to 1. What a resumed attempt needs
(the seconds so far, the newest step reached, the productive seconds at each recent
checkpoint) is a small JSON document beside the checkpoints (`RECORD`), written
atomically. Nothing here reads a clock: callers pass the times, so it is tested as is.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

CATEGORIES = (
    "productive",
    "compile",
    "dataWait",
    "checkpoint",
    "eval",
    "startup",
    "restart",
    "lost",
    "other",
)
RECORD = "goodput.json"  # under output.uri
RECORD_INTERVAL_S = 10.0  # at most this often on log steps (and at every checkpoint)
MARKS_KEPT = 16  # productive seconds at the newest checkpoints, for resumes from them


def _zeros() -> dict[str, float]:
    return dict.fromkeys(CATEGORIES, 0.0)


@dataclass
class Ledger:
    """Seconds per category over every attempt so far, and what a resume needs to move
    the redone steps from productive to lost."""

    seconds: dict[str, float] = field(default_factory=_zeros)
    attempts: int = 0
    lost_steps: int = 0
    reached: int = 0  # the newest step any attempt finished
    marks: dict[int, float] = field(default_factory=dict)  # checkpoint step -> productive s
    last_seen: float | None = None  # wall clock (epoch seconds) of the latest record

    def resume(self, step: int, wall: float) -> None:
        """A new attempt that continues from checkpoint `step` (0: from the start), at
        wall-clock time `wall`: the gap since the last record is restart time, and steps
        past `step` that an earlier attempt finished are lost."""
        self.attempts += 1
        if self.last_seen is not None:
            self.seconds["restart"] += max(0.0, wall - self.last_seen)
        self.last_seen = wall
        if self.reached > step:
            kept = [s for s in self.marks if s <= step]
            mark = self.marks[max(kept)] if kept else 0.0
            moved = max(0.0, self.seconds["productive"] - mark)
            self.seconds["productive"] -= moved
            self.seconds["lost"] += moved
            self.lost_steps += self.reached - step
        self.reached = step
        self.marks = {s: v for s, v in self.marks.items() if s <= step}

    def charge(self, category: str, seconds: float) -> None:
        if category not in self.seconds:
            raise KeyError(f"no goodput category {category!r}")
        self.seconds[category] += max(0.0, seconds)

    def stepped(self, step: int) -> None:
        self.reached = max(self.reached, step)

    def checkpointed(self, step: int) -> None:
        """A checkpoint of `step` was saved: a resume from it keeps what was productive."""
        self.marks[step] = self.seconds["productive"]
        for old in sorted(self.marks)[:-MARKS_KEPT]:
            del self.marks[old]

    def total(self) -> float:
        return sum(self.seconds.values())

    def fractions(self) -> dict[str, float]:
        total = self.total()
        if total <= 0:
            return dict.fromkeys(CATEGORIES, 0.0)
        return {k: v / total for k, v in self.seconds.items()}

    def goodput(self) -> float:
        return self.fractions()["productive"]

    # ------------------------------------------------------------------ wire forms

    def to_json(self) -> str:
        return json.dumps(
            {
                "seconds": self.seconds,
                "attempts": self.attempts,
                "lostSteps": self.lost_steps,
                "reached": self.reached,
                "marks": {str(s): v for s, v in sorted(self.marks.items())},
                "lastSeen": self.last_seen,
            },
            indent=2,
        )

    @classmethod
    def from_json(cls, text: str) -> Ledger:
        """The ledger of a record; ValueError when it is not one."""
        try:
            doc = json.loads(text)
            seconds = _zeros()
            seconds.update({k: float(v) for k, v in doc["seconds"].items() if k in seconds})
            return cls(
                seconds=seconds,
                attempts=int(doc["attempts"]),
                lost_steps=int(doc["lostSteps"]),
                reached=int(doc["reached"]),
                marks={int(s): float(v) for s, v in doc["marks"].items()},
                last_seen=None if doc["lastSeen"] is None else float(doc["lastSeen"]),
            )
        except (KeyError, TypeError, AttributeError, json.JSONDecodeError) as e:
            raise ValueError(f"not a goodput record: {e}") from None

    def status(self) -> dict[str, Any]:
        """status.progress's goodput fields."""
        return {
            "goodput": round(self.goodput(), 4),
            "goodputBreakdown": {k: round(v, 4) for k, v in self.fractions().items()},
            "lostSteps": self.lost_steps,
        }

    def summary(self) -> dict[str, Any]:
        """summary.json's goodput block."""
        return {
            "goodput": self.goodput(),
            "fractions": self.fractions(),
            "seconds": dict(self.seconds),
            "lostSteps": self.lost_steps,
            "attempts": self.attempts,
        }

    def scalars(self) -> dict[str, float]:
        """TensorBoard's goodput/* scalars."""
        out = {"goodput": self.goodput(), **self.fractions()}
        out["lost_steps"] = float(self.lost_steps)
        out["wall_seconds"] = self.total()
        return out


class Clock:
    """Charges an attempt's wall time to the ledger, stretch by stretch: each `charge`
    gives the time since the previous one to a category, so nothing is counted twice or
    left out. `now` is a monotonic clock; `compiled` the seconds of compilation seen so
    far (JAX's compile events), so that compiling inside a later step counts as compile."""

    def __init__(
        self,
        ledger: Ledger,
        now: Callable[[], float],
        compiled: Callable[[], float] = lambda: 0.0,
        started: float | None = None,
    ):
        self.ledger, self.now, self.compiled = ledger, now, compiled
        self._last = now() if started is None else started
        self._compiled = compiled()
        self._steps = 0  # steps of this attempt

    def _lap(self) -> tuple[float, float]:
        """Seconds since the previous charge, and of those the seconds JAX compiled."""
        now, compiled = self.now(), self.compiled()
        seconds, self._last = max(0.0, now - self._last), now
        compiling, self._compiled = max(0.0, compiled - self._compiled), compiled
        return seconds, min(compiling, seconds)

    def charge(self, category: str) -> None:
        """The time since the previous charge went to `category`."""
        self.ledger.charge(category, self._lap()[0])

    def data(self, device_busy: bool) -> None:
        """The next batch arrived: waiting for it counts only if the device had nothing
        queued meanwhile (`device_busy` False); otherwise it hid behind the step."""
        if not device_busy:
            self.charge("dataWait")

    def step(self, step: int) -> None:
        """Optimizer step `step` was done (the time since the batch arrived, or since the
        previous step's bookkeeping when loading the batch hid behind it)."""
        seconds, compiling = self._lap()
        self._steps += 1
        if self._steps == 1:
            self.ledger.charge("compile", seconds)
        else:
            self.ledger.charge("compile", compiling)
            self.ledger.charge("productive", seconds - compiling)
        self.ledger.stepped(step)
