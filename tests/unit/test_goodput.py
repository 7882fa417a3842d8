"""Goodput accounting (posttrain.trainer.goodput): every second charged once, the first
step of an attempt as compile, waits hidden behind queued device work not as data waits,
and steps redone after a restart moved from productive to lost once, from the record
an attempt leaves beside its checkpoints."""

from __future__ import annotations

import pytest

from posttrain.trainer.goodput import CATEGORIES, Clock, Ledger


class FakeTime:
    def __init__(self) -> None:
        self.t = 0.0
        self.compiled = 0.0

    def __call__(self) -> float:
        return self.t

    def advance(self, seconds: float, compiling: float = 0.0) -> None:
        self.t += seconds
        self.compiled += compiling


def attempt(ledger: Ledger, time: FakeTime, steps: range, *, checkpoint_every: int) -> None:
    """An attempt: 2 s startup, per step 1 s waiting for data and 3 s computing, a 5 s
    checkpoint every `checkpoint_every` steps."""
    clock = Clock(ledger, time, lambda: time.compiled)
    time.advance(2)
    clock.charge("startup")
    for step in steps:
        time.advance(1)
        clock.data(device_busy=False)
        time.advance(3)
        clock.step(step)
        if step % checkpoint_every == 0:
            time.advance(5)
            ledger.checkpointed(step)
            clock.charge("checkpoint")


def test_one_attempt_charges_every_second_once():
    time, ledger = FakeTime(), Ledger()
    ledger.resume(0, wall=1000.0)
    attempt(ledger, time, range(1, 5), checkpoint_every=2)
    assert ledger.seconds == {
        **dict.fromkeys(CATEGORIES, 0.0),
        "startup": 2.0,
        "dataWait": 4.0,
        "compile": 3.0,  # the first step
        "productive": 9.0,
        "checkpoint": 10.0,
    }
    assert ledger.total() == time.t == 28.0
    assert ledger.goodput() == pytest.approx(9 / 28)
    assert sum(ledger.fractions().values()) == pytest.approx(1.0)
    assert ledger.attempts == 1 and ledger.lost_steps == 0 and ledger.reached == 4


def test_steps_past_the_checkpoint_are_lost_once_across_restarts():
    time, ledger = FakeTime(), Ledger()
    ledger.resume(0, wall=1000.0)
    attempt(ledger, time, range(1, 7), checkpoint_every=4)  # killed after step 6
    ledger.last_seen = 1030.0
    record = ledger.to_json()

    resumed = Ledger.from_json(record)
    resumed.resume(4, wall=1045.0)  # from checkpoint 4, 15 s after the last record
    assert resumed.lost_steps == 2
    assert resumed.seconds["lost"] == 6.0  # steps 5 and 6, 3 s each
    assert resumed.seconds["productive"] == 9.0  # steps 2 to 4
    assert resumed.seconds["restart"] == 15.0
    assert resumed.attempts == 2 and resumed.reached == 4
    assert resumed.total() == pytest.approx(Ledger.from_json(record).total() + 15.0)

    # A third attempt from the same record (the second died before recording anything)
    # counts the same steps once, not twice.
    again = Ledger.from_json(record)
    again.resume(4, wall=1050.0)
    assert again.lost_steps == 2 and again.seconds["lost"] == 6.0

    # The second attempt goes on and records; its own restart loses nothing more.
    attempt(resumed, time, range(5, 9), checkpoint_every=4)
    resumed.last_seen = 1100.0
    after = Ledger.from_json(resumed.to_json())
    after.resume(8, wall=1101.0)
    assert after.lost_steps == 2 and after.seconds["lost"] == 6.0
    assert sum(after.fractions().values()) == pytest.approx(1.0)


@pytest.mark.parametrize(
    "resume_from,lost_steps,lost_seconds",
    [
        (6, 0, 0.0),  # the newest checkpoint: nothing redone
        (3, 3, 9.0),  # an older checkpoint (the newest unreadable)
        (0, 6, 15.0),  # no checkpoint left: every step redone (step 1 was compile)
    ],
)
def test_lost_steps_from_the_checkpoint_resumed(resume_from, lost_steps, lost_seconds):
    time, ledger = FakeTime(), Ledger()
    ledger.resume(0, wall=0.0)
    attempt(ledger, time, range(1, 7), checkpoint_every=3)
    ledger.resume(resume_from, wall=100.0)
    assert ledger.lost_steps == lost_steps
    assert ledger.seconds["lost"] == lost_seconds


def test_waits_behind_queued_work_and_recompiles():
    time, ledger = FakeTime(), Ledger()
    clock = Clock(ledger, time, lambda: time.compiled)
    time.advance(10, compiling=8)
    clock.step(1)  # the first step: all compile
    time.advance(1)
    clock.data(device_busy=True)  # the device was still computing step 1: not a wait
    time.advance(2, compiling=0.5)  # step 2 recompiled for half a second
    clock.step(2)
    time.advance(4, compiling=1)  # evaluation compiles: its own, not the next step's
    clock.charge("eval")
    time.advance(2)
    clock.step(3)
    assert ledger.seconds["compile"] == 10.5
    assert ledger.seconds["productive"] == 2.5 + 2.0
    assert ledger.seconds["dataWait"] == 0.0 and ledger.seconds["eval"] == 4.0
    assert ledger.total() == time.t


def test_record_round_trip_and_bad_records():
    ledger = Ledger()
    ledger.resume(0, wall=5.0)
    ledger.charge("productive", 3.0)
    ledger.checkpointed(2)
    assert Ledger.from_json(ledger.to_json()) == ledger
    for bad in ("", "[]", '{"seconds": {}}', "not json"):
        with pytest.raises(ValueError, match="not a goodput record"):
            Ledger.from_json(bad)
    with pytest.raises(KeyError, match="no goodput category 'sleep'"):
        ledger.charge("sleep", 1.0)


def test_wire_forms():
    ledger = Ledger()
    ledger.charge("productive", 3.0)
    ledger.charge("compile", 1.0)
    assert ledger.status()["goodput"] == 0.75
    assert ledger.status()["goodputBreakdown"]["compile"] == 0.25
    assert set(ledger.status()["goodputBreakdown"]) == set(CATEGORIES)
    assert ledger.summary()["seconds"]["productive"] == 3.0
    assert ledger.scalars()["wall_seconds"] == 4.0
    assert Ledger().fractions() == dict.fromkeys(CATEGORIES, 0.0)
