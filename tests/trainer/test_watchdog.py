"""The trainer's watchdog (spec.scheduling.progressDeadlineSeconds): a run whose step
never returns exits non-zero with the stack of every thread; one that moves does not."""

from __future__ import annotations

import io
import os
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
import yaml
from tiny_job import tiny_job

from posttrain.api import heartbeat
from posttrain.trainer import watchdog

pytestmark = pytest.mark.trainer
ROOT = Path(__file__).parent.parent.parent


def test_a_loop_that_stops_moving_is_ended_with_every_threads_stack():
    exits: list[int] = []
    out = io.StringIO()
    with watchdog.watching(1, exit=exits.append, out=out, backstop=False) as dog:
        dog.beat(heartbeat.TRAINING, 812)
        parked = threading.Event()
        helper = threading.Thread(target=parked.wait, name="sampler", daemon=True)
        helper.start()
        assert dog.fired.wait(5)
        parked.set()
    assert exits == [watchdog.HUNG_EXIT_CODE]
    text = out.getvalue()
    assert text.startswith("posttrain: no progress for 1 s (last: step 812, training); "), text
    assert "exits with code 70" in text.splitlines()[0]
    assert "Thread sampler:" in text and "in wait" in text  # every thread's stack


def test_beats_keep_it_quiet_and_slow_phases_get_longer():
    exits: list[int] = []
    with watchdog.watching(1, exit=exits.append, out=io.StringIO(), backstop=False) as dog:
        for step in range(12):  # 1.2 s of steps, each within the deadline
            dog.beat(heartbeat.TRAINING, step)
            time.sleep(0.1)
        dog.beat(heartbeat.COMPILING)  # 3 s allowed
        time.sleep(1.5)
        assert not dog.fired.is_set()
    assert exits == []
    assert watchdog._current is None


def test_deadline_0_means_no_watchdog():
    with watchdog.watching(0) as dog:
        assert dog is None
        watchdog.beat(heartbeat.TRAINING, 1)  # no-op


def test_a_run_whose_step_never_returns_exits_70_with_the_stacks(model_dir, tmp_path):
    """`posttrain run` of a tiny job whose third step hangs: the watchdog ends it after
    the deadline with its last step and the stack of the hung call."""
    out = tmp_path / "out"
    doc = tiny_job(model_dir, ROOT / "examples" / "data" / "chat-sft.jsonl", out, steps=6, every=6)
    doc["spec"]["scheduling"] = {"progressDeadlineSeconds": 5}
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump(doc))
    script = textwrap.dedent(
        f"""
        import sys, threading
        from posttrain import cli
        from posttrain.trainer import sft

        make = sft.make_train_step

        def hanging(*args, **kwargs):
            step = make(*args, **kwargs)
            calls = []

            def never_returns_on_step_3(*a, **k):
                calls.append(1)
                if len(calls) == 3:
                    threading.Event().wait()
                return step(*a, **k)

            return never_returns_on_step_3

        sft.make_train_step = hanging
        sys.exit(cli.main(["run", {str(job)!r}]))
        """
    )
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    proc = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=240
    )
    assert proc.returncode == watchdog.HUNG_EXIT_CODE, proc.stderr[-4000:]
    line = next(x for x in proc.stderr.splitlines() if x.startswith("posttrain: no progress"))
    assert line.startswith("posttrain: no progress for 5 s (last: step 2, training)"), line
    assert "in never_returns_on_step_3" in proc.stderr  # the hung call, in its thread's stack
    assert "Current thread" in proc.stderr or "Thread 0x" in proc.stderr
