"""What a user watching a run sees: the bar shows the step it is at with that step's
numbers, and output that is not a terminal gets one log line per log step instead of
a bar redrawn into a single long line."""

from __future__ import annotations

import io
import logging

import pytest

from posttrain.trainer.progress import Progress

pytestmark = pytest.mark.trainer


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_bar_shows_the_current_steps_metrics(monkeypatch):
    screen = Terminal()
    monkeypatch.setattr("sys.stderr", screen)
    progress = Progress(4, 0, True, None, show_bar=True)
    progress.step(1, {"loss": 2.5}, log_now=True)
    assert "loss=2.5" in screen.getvalue().rsplit("\r", 1)[-1]
    progress.step(2, {"loss": 1.25}, log_now=True)
    last = screen.getvalue().rsplit("\r", 1)[-1]
    assert "2/4" in last and "loss=1.25" in last
    progress.close(2, {"loss": 1.25})


def test_without_a_terminal_each_log_step_is_one_line(monkeypatch, caplog):
    written = io.StringIO()  # a pipe or a pod's log: not a terminal
    monkeypatch.setattr("sys.stderr", written)
    caplog.set_level(logging.INFO, logger="posttrain.progress")
    progress = Progress(4, 0, True, None, show_bar=True)
    for step in range(1, 5):
        progress.step(step, {"loss": 1.0 / step}, log_now=step % 2 == 0)
    progress.close(4, {"loss": 0.25})
    lines = [r.getMessage() for r in caplog.records]
    assert lines == ["step 2/4 loss=0.5", "step 4/4 loss=0.25"]
    assert written.getvalue() == ""  # no bar drawn into the log


def test_other_processes_show_nothing(monkeypatch, caplog):
    monkeypatch.setattr("sys.stderr", Terminal())
    caplog.set_level(logging.INFO, logger="posttrain.progress")
    progress = Progress(4, 0, False, None, show_bar=True)
    progress.step(2, {"loss": 1.0}, log_now=True)
    assert progress.bar is None and not caplog.records


METRICS = {
    "loss": 2.3456,
    "learning_rate": 0.0002,
    "grad_norm": 1.234,
    "kl": 0.0123,
    "mean_reward": 0.5,
    "tokens_per_second": 1234.5,
}


def last_line(screen: Terminal) -> str:
    return screen.getvalue().split("\n")[-1].rsplit("\r", 1)[-1]


def test_bar_stays_readable_at_80_columns(monkeypatch):
    screen = Terminal()
    monkeypatch.setattr("sys.stderr", screen)
    progress = Progress(30, 0, True, None, show_bar=True, columns=80)
    progress.step(2, METRICS, log_now=True)
    bar = last_line(screen)
    assert len(bar) <= 80, bar
    assert "2/30" in bar and "loss=2.346" in bar and "tok/s=1234" in bar, bar
    assert "grad_norm" not in bar  # the rest go to the log line
    inner = bar[bar.index("|") + 1 : bar.rindex("|")]
    assert len(inner) >= 10, bar  # the bar itself keeps a width worth looking at
    progress.close(2, METRICS)


def test_an_rl_bar_shows_the_reward_not_the_loss(monkeypatch):
    """GRPO's loss is about zero at every step (advantages are centred per group): the
    bar shows the mean reward and the completion length instead."""
    screen = Terminal()
    monkeypatch.setattr("sys.stderr", screen)
    progress = Progress(30, 0, True, None, show_bar=True, columns=80)
    grpo = {**METRICS, "loss": -2.98e-08, "reward": 0.4375, "completion_length": 23.6}
    progress.step(3, grpo, log_now=True)
    bar = last_line(screen)
    assert len(bar) <= 80, bar
    assert "reward=0.438" in bar and "len=24" in bar and "tok/s=1234" in bar, bar
    assert "loss" not in bar
    progress.close(3, grpo)


def test_log_records_go_above_the_bar(monkeypatch, caplog):
    screen = Terminal()
    monkeypatch.setattr("sys.stderr", screen)
    console = logging.StreamHandler(screen)  # as posttrain run's logging.basicConfig
    logging.getLogger().addHandler(console)
    caplog.set_level(logging.INFO)
    try:
        progress = Progress(4, 0, True, None, show_bar=True, columns=80)
        progress.step(1, {"loss": 2.5}, log_now=False)
        logging.getLogger("posttrain.trainer").warning("received SIGINT: checkpointing")
        progress.step(2, METRICS, log_now=True)
        progress.close(2, METRICS)
    finally:
        logging.getLogger().removeHandler(console)
    lines = [line.rsplit("\r", 1)[-1] for line in screen.getvalue().split("\n")]
    assert "received SIGINT: checkpointing" in lines  # a line of its own
    every = [line for line in lines if line.startswith("step 2/4 ")]
    assert every and "grad_norm=1.234" in every[0] and "tokens_per_second=" in every[0]


def test_bar_says_what_happens_before_the_first_step(monkeypatch, caplog):
    screen = Terminal()
    monkeypatch.setattr("sys.stderr", screen)
    progress = Progress(4, 0, True, None, show_bar=True, columns=80)
    progress.phase("compiling and running step 1")
    assert "0/4" in last_line(screen) and "compiling and running step 1" in last_line(screen)
    progress.step(1, {"loss": 2.5}, log_now=True)
    assert "1/4" in last_line(screen) and "compiling" not in last_line(screen)
    progress.phase("evaluating step 1")
    assert "evaluating step 1" in last_line(screen) and "loss" not in last_line(screen)
    progress.step(2, {"loss": 2.0}, log_now=False)  # the numbers of the last log step
    assert "2/4" in last_line(screen) and "loss=2.5" in last_line(screen)
    progress.close(2, {"loss": 2.0})
    # Without a terminal: the same news as log lines.
    monkeypatch.setattr("sys.stderr", io.StringIO())
    caplog.set_level(logging.INFO, logger="posttrain.progress")
    Progress(4, 0, True, None, show_bar=True).phase("evaluating step 0")
    assert [r.getMessage() for r in caplog.records] == ["evaluating step 0"]


def test_status_progress_carries_the_samplers_metrics():
    """GRPO with a disaggregated sampler: status.progress.rollout (validated by the
    status schema) has staleness, busy fractions and the weight-sync time."""
    from posttrain.api.spec import Progress as ProgressStatus

    class Status:
        patches: list = []

        def patch(self, progress):
            self.patches.append(progress)

    status = Status()
    progress = Progress(2, 0, True, None, status, show_bar=False)
    metrics = {"loss": 0.5, "staleness": 1.0, "sampler_busy": 0.75, "learner_busy": 0.5}
    progress.step(2, {**metrics, "weight_sync_seconds": 0.01}, log_now=True)
    (patch,) = status.patches
    assert patch["rollout"] == {
        "staleness": 1.0,
        "samplerBusy": 0.75,
        "learnerBusy": 0.5,
        "weightSyncSeconds": 0.01,
    }
    assert ProgressStatus.model_validate(patch).rollout["samplerBusy"] == 0.75
    progress.close(2, metrics)


def test_heartbeat_says_the_phase_at_once_and_steps_every_30_s(monkeypatch):
    """status.progress.phase (the operator's progress deadline): each new phase is
    written at once; steps between log steps at most every HEARTBEAT_INTERVAL_S."""
    from posttrain.api import heartbeat
    from posttrain.trainer import progress as progress_module

    now = [1000.0]
    monkeypatch.setattr(progress_module.time, "monotonic", lambda: now[0])

    class Status:
        def __init__(self):
            self.patches = []

        def patch(self, progress):
            self.patches.append(progress)

    status = Status()
    progress = Progress(100, 0, True, None, status, show_bar=False)
    progress.phase("compiling and running step 1")
    progress.step(1, {}, log_now=False)  # a new phase: written
    now[0] += 10
    progress.step(2, {}, log_now=False)  # 10 s later, the same phase: not yet
    now[0] += 25
    progress.step(3, {}, log_now=False)  # 35 s after the last write
    progress.phase("evaluating step 3")
    progress.phase("checkpointing step 3")
    assert [(p["phase"], p["step"]) for p in status.patches] == [
        (heartbeat.COMPILING, 0),
        (heartbeat.TRAINING, 1),
        (heartbeat.TRAINING, 3),
        (heartbeat.EVALUATING, 3),
        (heartbeat.CHECKPOINTING, 3),
    ]
    assert all(p["updatedAt"].endswith("Z") for p in status.patches)
    now[0] += 60
    progress.step(4, {"loss": 0.5}, log_now=True)  # a log step's full report has it too
    assert status.patches[-1]["phase"] == heartbeat.TRAINING
    assert status.patches[-1]["loss"] == 0.5
