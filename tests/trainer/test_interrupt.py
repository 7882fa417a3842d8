"""Ctrl-C as a user presses it: during start-up the run stops at once and claims no
checkpoint; once training, the first one checkpoints after the step and a second one
exits at once."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import yaml
from tiny_job import tiny_job

pytestmark = pytest.mark.trainer
ROOT = Path(__file__).parent.parent.parent
ENV = {**os.environ, "JAX_PLATFORMS": "cpu"}


def test_ctrl_c_during_start_up_stops_at_once_saving_nothing(model_dir, tmp_path):
    out = tmp_path / "out"
    doc = tiny_job(model_dir, ROOT / "examples" / "data" / "chat-sft.jsonl", out, steps=4, every=2)
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump(doc))
    proc = subprocess.Popen(
        [sys.executable, "-m", "posttrain.cli", "run", str(job)],
        env=ENV,
        stderr=subprocess.PIPE,
        text=True,
    )
    seen = []
    for line in proc.stderr:  # the handler is installed before the model loads
        seen.append(line)
        if "loading the model" in line:
            break
    else:
        raise AssertionError("".join(seen))
    proc.send_signal(signal.SIGINT)
    began = time.monotonic()
    rest = proc.communicate(timeout=60)[1]
    assert proc.returncode == 130, "".join(seen) + rest
    assert time.monotonic() - began < 15
    assert rest.strip().splitlines()[-1] == "posttrain: SIGINT before the first step; nothing saved"
    assert "Traceback" not in rest and "checkpoint" not in rest
    assert not (out / "checkpoints").exists() or not any((out / "checkpoints").iterdir())


def test_step_0_measured_again_is_not_recorded_twice(tmp_path):
    """A run stopped before its first checkpoint starts over and measures step 0 again:
    eval.json keeps one entry for it."""
    from posttrain.trainer.evaluate import History

    History(str(tmp_path), 0).add(0, {"loss": 2.0}, [])
    again = History(str(tmp_path), 0)  # the next attempt, resuming from nothing
    again.add(0, {"loss": 2.5}, [])
    again.add(4, {"loss": 1.5}, [])
    saved = json.loads((tmp_path / "eval.json").read_text())
    assert [(e["step"], e["metrics"]["loss"]) for e in saved] == [(0, 2.5), (4, 1.5)]


def test_a_second_signal_while_training_exits_at_once():
    script = textwrap.dedent(
        """
        import os, signal, time
        from posttrain.trainer.signals import StopFlag

        flag = StopFlag()
        flag.install()
        flag.training()
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.2)
        print("checkpointing" if flag else "ignored", flush=True)
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(30)
        print("still running", flush=True)
        """
    )
    began = time.monotonic()
    r = subprocess.run(
        [sys.executable, "-c", script], env=ENV, capture_output=True, text=True, timeout=60
    )
    assert r.returncode == 128 + signal.SIGINT, r.stderr
    assert r.stdout.splitlines() == ["checkpointing"]
    assert "exiting now" in r.stderr
    assert time.monotonic() - began < 20


def test_ctrl_c_inside_a_gc_callback_still_stops_start_up():
    """Python runs a signal's handler between any two bytecodes of the main thread, also
    inside a garbage-collection callback (JAX has one): an exception raised there is
    printed as 'Exception ignored' and lost. The first Ctrl-C before the first step still
    ends the run at once, runs the cleanups and says nothing was saved."""
    script = textwrap.dedent(
        """
        import gc, os, signal, sys, tempfile, time
        from posttrain.trainer.signals import StopFlag

        flag = StopFlag()
        flag.install()
        scratch = tempfile.mkdtemp(prefix="posttrain-test-")
        print(scratch, flush=True)
        flag.on_exit(lambda: os.rmdir(scratch))

        def in_gc(phase, info):
            if phase == "start":
                os.kill(os.getpid(), signal.SIGINT)
                deadline = time.monotonic() + 0.5
                while time.monotonic() < deadline:  # bytecodes: the handler runs here
                    pass

        gc.callbacks.append(in_gc)
        gc.collect()
        gc.callbacks.remove(in_gc)
        time.sleep(10)
        print("still loading", flush=True)
        """
    )
    began = time.monotonic()
    r = subprocess.run(
        [sys.executable, "-c", script], env=ENV, capture_output=True, text=True, timeout=60
    )
    scratch = r.stdout.splitlines()[0]
    assert r.returncode == 130, r.stdout + r.stderr
    assert "still loading" not in r.stdout
    assert "Exception ignored" not in r.stderr and "Traceback" not in r.stderr
    assert r.stderr.strip().splitlines()[-1] == (
        "posttrain: SIGINT before the first step; nothing saved"
    )
    assert not Path(scratch).exists()
    assert time.monotonic() - began < 8


def test_a_signal_handled_before_training_is_not_lost_without_a_watcher():
    """Without the watcher thread (not the main interpreter), a start-up signal is only
    recorded by the handler; the next safe point, or training() itself, raises it."""
    from posttrain.trainer.signals import Interrupted, StopFlag

    flag = StopFlag()
    flag._handle(signal.SIGTERM, None)
    assert not flag.stepping
    with pytest.raises(Interrupted) as raised:
        flag.training()
    assert raised.value.signum == signal.SIGTERM and not flag.stepping
    with pytest.raises(Interrupted):
        flag.check()


def test_a_signal_read_once_training_checkpoints_after_the_step():
    """The watcher reads a signal's byte after training() began: the first one
    checkpoints after the step, a second exits."""
    script = textwrap.dedent(
        """
        import logging, os, signal
        from posttrain.trainer.signals import StopFlag

        logging.basicConfig(level=logging.INFO)
        flag = StopFlag()
        flag.training()
        read, write = os.pipe()
        os.write(write, bytes([signal.SIGINT]))
        os.close(write)
        flag._watch(read)  # returns at end of file
        print("checkpointing" if flag else "ignored", flush=True)
        """
    )
    r = subprocess.run(
        [sys.executable, "-c", script], env=ENV, capture_output=True, text=True, timeout=60
    )
    assert (r.returncode, r.stdout) == (0, "checkpointing\n"), r.stderr
    said = [line for line in r.stderr.splitlines() if "received" in line]
    assert len(said) == 1 and said[0].endswith(
        "received SIGINT: checkpointing after this step (again to exit at once)"
    ), r.stderr


def test_ctrl_c_during_a_compile_stops_at_once():
    """XLA compiling the first step is one long C call: Python runs no signal handler
    until it returns. The watcher thread ends the run at once, saving nothing. (The main
    thread here blocks SIGINT and sleeps in C, which a signal does not cut short either,
    as a compile.)"""
    script = textwrap.dedent(
        """
        import ctypes, logging, signal
        from posttrain.trainer.signals import StopFlag

        logging.basicConfig(level=logging.INFO)
        StopFlag().install()
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
        print("compiling", flush=True)
        ctypes.CDLL(None).sleep(60)
        print("compiled", flush=True)
        """
    )
    proc = subprocess.Popen(
        [sys.executable, "-c", script], env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True,
    )  # fmt: skip
    try:
        assert proc.stdout.readline() == "compiling\n"
        proc.send_signal(signal.SIGINT)
        began = time.monotonic()
        out, rest = proc.communicate(timeout=20)
    finally:
        proc.kill()
    assert proc.returncode == 128 + signal.SIGINT, rest
    assert "compiled" not in out
    assert rest.strip().splitlines()[-1] == "posttrain: SIGINT before the first step; nothing saved"
    assert time.monotonic() - began < 10
