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
        from posttrain.trainer.signals import Interrupted, StopFlag

        flag = StopFlag()
        flag.install()
        try:
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(1)
        except Interrupted:
            print("start-up interrupted", flush=True)
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
    assert r.stdout.splitlines() == ["start-up interrupted", "checkpointing"]
    assert "exiting now" in r.stderr
    assert time.monotonic() - began < 20


def test_a_start_up_signal_read_late_is_not_counted_once_training():
    """On a loaded machine the watcher thread may read a start-up signal's byte only after
    training began: that signal was already handled (start-up stopped), so the first one
    while training still checkpoints instead of exiting as if it were the second."""
    script = textwrap.dedent(
        """
        import logging, os, signal
        from posttrain.trainer.signals import StopFlag

        logging.basicConfig(level=logging.INFO)
        flag = StopFlag()
        flag.handled = 1  # the start-up Ctrl-C, handled by raising Interrupted
        flag.training()
        read, write = os.pipe()
        os.write(write, bytes([signal.SIGINT, signal.SIGINT]))  # its byte, then a new one
        os.close(write)
        flag._watch(read)  # returns at end of file; a second counted signal exits
        print("still running", flush=True)
        """
    )
    r = subprocess.run(
        [sys.executable, "-c", script], env=ENV, capture_output=True, text=True, timeout=60
    )
    assert (r.returncode, r.stdout) == (0, "still running\n"), r.stderr
    said = [line for line in r.stderr.splitlines() if "received" in line]
    assert len(said) == 1 and said[0].endswith(
        "received SIGINT: checkpointing after this step (again to exit at once)"
    ), r.stderr


def test_ctrl_c_during_a_compile_says_so_at_once_and_a_second_exits():
    """XLA compiling the first step is one long C call: Python runs no signal handler
    until it returns. The first Ctrl-C still says at once what it will do, and a second
    exits at once, saving nothing. (The main thread here blocks SIGINT and sleeps in C,
    which a signal does not cut short either, as a compile.)"""
    import select

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
        began, said = time.monotonic(), ""
        while "again to exit at once" not in said and time.monotonic() - began < 10:
            if select.select([proc.stderr], [], [], 1)[0]:
                said += proc.stderr.readline()
        assert "received SIGINT before the first step: stopping once" in said, said
        assert "saving nothing" in said and proc.poll() is None  # still in its C call
        proc.send_signal(signal.SIGINT)
        out, rest = proc.communicate(timeout=10)
    finally:
        proc.kill()
    assert proc.returncode == 128 + signal.SIGINT, said + rest
    assert "compiled" not in out
    assert "received SIGINT again: exiting now; nothing saved" in rest
    assert time.monotonic() - began < 20
