"""The training loop end to end on CPU with a tiny random Llama: learning, outputs,
checkpoints with exact resume (in-process and after SIGTERM/SIGKILL, on local disk and
on gs:// through a real GCS-compatible server), corrupt and partial checkpoints, full
fine-tune export, and errors in the job's input."""

from __future__ import annotations

import glob
import json
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import pytest
import yaml
from safetensors.numpy import load
from tb_events import scalars, texts
from tiny_job import assert_bitwise_equal, run_job, tiny_job

from posttrain.checks import validate
from posttrain.trainer import data, models, storage
from posttrain.trainer.export import export_checkpoint
from tests.trainer.data_helpers import gcs_bucket

pytestmark = pytest.mark.trainer
ROOT = Path(__file__).resolve().parents[2]
DATA = ROOT / "examples" / "data" / "chat-sft.jsonl"


def job_doc(
    model_dir: Path, out: Path | str, *, steps=12, lora=True, every=4, logEverySteps=2
) -> dict:
    return tiny_job(
        model_dir,
        DATA,
        out,
        steps=steps,
        every=every,
        lora=lora,
        training={"logEverySteps": logEverySteps},
    )


def adapter(out: Path | str) -> dict[str, np.ndarray]:
    """The exported PEFT adapter's tensors; `out` is a local path or a gs:// URI."""
    data = storage.read_bytes(storage.join(str(out), "hf", "adapter_model.safetensors"))
    return load(data)


def committed_steps(out: Path | str) -> list[int]:
    """Checkpoint steps under out/checkpoints that Orbax marked complete."""
    root = storage.join(str(out), "checkpoints")
    names = [f[len(root) + 1 :] for f in storage.list_uri(root, recursive=True)]
    return sorted(int(n.split("/")[0]) for n in names if re.fullmatch(r"\d+/commit_success.txt", n))


@pytest.fixture(scope="module")
def reference(model_dir, tmp_path_factory):
    """An uninterrupted 12-step LoRA run that other tests compare against."""
    out = tmp_path_factory.mktemp("reference") / "out"
    result = run_job(job_doc(model_dir, out))
    return out, result


def test_lora_sft_learns_and_writes_outputs(model_dir, reference):
    out, result = reference
    losses = [result.losses[s] for s in sorted(result.losses)]
    assert result.step == 12 and len(losses) == 6
    assert np.mean(losses[-2:]) < np.mean(losses[:2]) - 0.2, losses
    tb = scalars(out / "tensorboard")
    assert {
        "train/loss",
        "train/learning_rate",
        "train/grad_norm",
        "train/tokens_per_second",
    } <= tb.keys()
    assert tb["train/loss"][12] == pytest.approx(result.losses[12], rel=1e-6)
    assert committed_steps(out) == [4, 8, 12]
    config = yaml.safe_load((out / "hf" / "adapter_config.json").read_text())
    assert config["peft_type"] == "LORA" and config["r"] == 4 and config["lora_alpha"] == 8
    # The job's spec.model.source (test_adapter_base.py: relative paths, hf://, --base).
    assert config["base_model_name_or_path"] == str(model_dir)
    assert any(k.endswith("lora_B.weight") for k in adapter(out))


class _Device:
    """A device that runs the steps dispatched to it one after another, `seconds` each:
    a step's output is ready when the device has finished it."""

    def __init__(self, seconds: float) -> None:
        self.seconds, self.free = seconds, time.monotonic()

    def dispatch(self) -> _Output:
        self.free = max(self.free, time.monotonic()) + self.seconds
        return _Output(self.free)


class _Output:
    def __init__(self, ready_at: float) -> None:
        self.ready_at = ready_at

    def block_until_ready(self) -> _Output:
        time.sleep(max(0.0, self.ready_at - time.monotonic()))
        return self

    def __float__(self) -> float:
        self.block_until_ready()
        return 1.5


def test_every_window_holds_as_many_steps_time_as_steps_tokens():
    """Steps are dispatched ahead of the device; a window's tokens/s is the device's rate,
    the last window's too (it read the last step at once: counting the queued steps'
    time but not their tokens, it said 0.67 of the rate on the chip). Log every 4 of 12
    steps of 100 tokens, 40 ms each: 2,500 tokens/s."""
    from posttrain.trainer.in_flight import Window

    device, window = _Device(0.04), Window()
    rates, losses, pending = {}, {}, None
    for step in range(1, 13):
        losses[step] = device.dispatch()
        window.queue(step, losses[step], np.int32(100))
        if pending is not None:  # read once the next step is queued, as the loop does
            rates[pending] = window.close(pending, losses[pending])
            pending = None
        if step == 12:
            rates[step] = window.close(step, losses[step])
        elif step % 4 == 0:
            pending = step
    assert sorted(rates) == [4, 8, 12]
    for step, (loss, rate) in rates.items():
        assert loss == 1.5 and rate == pytest.approx(2500, rel=0.12), (step, rate)
    assert not window.queued and window.tokens == []


def test_a_log_step_is_read_once_the_next_step_is_queued(model_dir, tmp_path, monkeypatch):
    """Reading a log step's loss at once would leave the device idle until the host
    dispatched the next step: it is read after that dispatch, except where the step
    checkpoints (which waits for the device anyway) or is the last."""
    from posttrain.trainer import loop, sft

    dispatched, read_after, read = [], [], []
    make_step = sft.make_train_step

    def counting_step(*args, **kwargs):
        step = make_step(*args, **kwargs)

        def counted(*a, **k):
            dispatched.append(len(dispatched) + 1)
            return step(*a, **k)

        return counted

    close = loop.Window.close

    def recording_close(self, step, loss):
        read_after.append(len(dispatched))
        read.append((step, len(self.tokens) + sum(s <= step for s, *_ in self.queued)))
        return close(self, step, loss)

    monkeypatch.setattr(sft, "make_train_step", counting_step)
    monkeypatch.setattr(loop.Window, "close", recording_close)
    result = run_job(job_doc(model_dir, tmp_path / "out", steps=8, every=4))
    # Log steps 2, 4, 6, 8; checkpoints at 4 and 8: steps 2 and 6 are read after the next.
    assert read_after == [3, 4, 7, 8]
    # Each window counts its own two steps' tokens, whichever of them the device finished
    # before the read; step 3, queued when step 2 was read, counts in the next window.
    assert read == [(2, 2), (4, 2), (6, 2), (8, 2)]
    assert sorted(result.losses) == [2, 4, 6, 8]
    tb = scalars(tmp_path / "out" / "tensorboard")
    assert {s: tb["train/loss"][s] for s in result.losses} == pytest.approx(result.losses)
    assert sorted(tb["train/tokens_per_second"]) == [2, 4, 6, 8]


def test_a_report_waits_for_nothing_queued_behind_its_step(model_dir, tmp_path, monkeypatch):
    """A log step's report reads that step's outputs and computes nothing on the device:
    an eager computation there (the learning rate from the optax schedule, before) queues
    behind the step dispatched after it and holds the host until the device has finished
    that too, so the device idles until the host has logged and dispatched again. Here a
    second of work is queued behind steps 3 and 7, whose dispatch the reports of log
    steps 2 and 6 follow: the host must reach the next dispatch without waiting for it."""
    import jax.numpy as jnp

    from posttrain.trainer import loop, sft

    busy = jax.jit(lambda x: jnp.tanh(x @ x @ x @ x).sum())
    x = jnp.ones((2400, 2400))
    busy(x).block_until_ready()
    started = time.monotonic()
    busy(x).block_until_ready()
    seconds = time.monotonic() - started
    queued, dispatched_at, reported_at = [], [], []
    make_step = sft.make_train_step

    def busy_step(*args, **kwargs):
        step = make_step(*args, **kwargs)

        def stepped(*a, **k):
            dispatched_at.append(time.monotonic())
            out = step(*a, **k)
            if len(dispatched_at) in (3, 7):
                queued.append(busy(x))
            return out

        return stepped

    close = loop.Window.close

    def timed_close(self, step, loss):
        value = close(self, step, loss)
        reported_at.append((len(dispatched_at), time.monotonic()))
        return value

    monkeypatch.setattr(sft, "make_train_step", busy_step)
    monkeypatch.setattr(loop.Window, "close", timed_close)
    run_job(job_doc(model_dir, tmp_path / "out", steps=8, every=4))
    for after, at in reported_at[::2]:  # steps 2 and 6, read after steps 3 and 7's dispatch
        assert after in (3, 7)
        assert dispatched_at[after] - at < seconds / 2, (dispatched_at[after] - at, seconds)


def test_what_exists_at_the_first_step_is_frozen_for_the_run(model_dir, tmp_path, monkeypatch):
    """From the first step's dispatch on, everything made before (the model, the compiled
    step, the modules) is out of the collector's reach (gc.freeze): a full collection
    walked it all, 0.4-0.6 s of host time every ~8 steps on the chip. Unfrozen after."""
    import gc

    from posttrain.trainer import sft

    frozen = []
    make_step = sft.make_train_step

    def watched(*args, **kwargs):
        step = make_step(*args, **kwargs)
        return lambda *a, **k: frozen.append(gc.get_freeze_count()) or step(*a, **k)

    monkeypatch.setattr(sft, "make_train_step", watched)
    gc.unfreeze()
    run_job(job_doc(model_dir, tmp_path / "out", steps=3, every=3))
    assert frozen[0] == 0 and min(frozen[1:]) > 10_000, frozen
    assert gc.get_freeze_count() == 0


def test_goodput_of_an_uninterrupted_run(reference):
    out, result = reference
    summary = json.loads((out / "summary.json").read_text())["goodput"]
    assert summary == result.goodput
    assert summary["attempts"] == 1 and summary["lostSteps"] == 0
    assert sum(summary["fractions"].values()) == pytest.approx(1.0)
    assert summary["seconds"]["lost"] == summary["seconds"]["restart"] == 0.0
    for part in ("productive", "compile", "startup", "checkpoint"):
        assert summary["seconds"][part] > 0, part
    assert 0 < summary["goodput"] < 1
    tb = scalars(out / "tensorboard")
    assert tb["goodput/goodput"][12] == pytest.approx(summary["goodput"], rel=1e-6)
    assert {"goodput/compile", "goodput/dataWait", "goodput/lost_steps"} <= tb.keys()


def test_steps_lost_to_crashes_are_counted_once(model_dir, tmp_path, monkeypatch):
    """Attempts that crash a few steps after their newest checkpoint (a failure injected
    where steps 7 and 10 are logged, checkpoints every 4 steps) and resume: the recorded
    steps past the checkpoint are lost once each, and the parts still add up to 1. A log
    step is read once the next step is dispatched, after its own goodput record: so
    5, 6, 7, then 9, 10 are lost."""
    from posttrain.trainer import goodput, loop

    monkeypatch.setattr(goodput, "RECORD_INTERVAL_S", 0.0)  # record every log step
    crash_at = {7, 10}
    step = loop.Progress.step

    def failing_step(self, at, metrics, log_now):
        step(self, at, metrics, log_now)
        if at in crash_at:
            crash_at.remove(at)
            raise RuntimeError(f"injected failure after step {at}")

    monkeypatch.setattr(loop.Progress, "step", failing_step)
    doc = job_doc(model_dir, tmp_path / "out", logEverySteps=1)
    doc["spec"]["checkpoint"]["async"] = False  # a crash never races a save
    for crash in (7, 10):
        with pytest.raises(RuntimeError, match=f"after step {crash}"):
            run_job(doc)
    result = run_job(doc)
    assert result.resumed_from == 8 and result.step == 12
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())["goodput"]
    assert summary["attempts"] == 3 and summary["lostSteps"] == 5
    seconds = summary["seconds"]
    assert seconds["lost"] > 0 and seconds["restart"] > 0
    assert sum(summary["fractions"].values()) == pytest.approx(1.0)
    assert summary["goodput"] == pytest.approx(seconds["productive"] / sum(seconds.values()))


def test_a_finished_run_run_again_trains_and_writes_nothing(model_dir, reference, caplog):
    out, first = reference
    before = {f: f.stat().st_mtime_ns for f in out.rglob("*")}
    again = run_job(job_doc(model_dir, out))
    assert again.already_finished and again.step == 12 and again.export_dir == first.export_dir
    assert {f: f.stat().st_mtime_ns for f in out.rglob("*")} == before
    assert f"{out} already finished at step 12" in caplog.text
    assert "posttrain run --output DIR" in caplog.text


def test_eval_is_measured_and_does_not_change_training(model_dir, reference, tmp_path):
    held_out = tmp_path / "held-out.jsonl"
    held_out.write_text("".join(DATA.read_text().splitlines(keepends=True)[:24]))
    out = tmp_path / "out"
    doc = job_doc(model_dir, out)
    doc["spec"]["eval"] = {"source": str(held_out), "everySteps": 4, "samples": 1}
    result = run_job(doc)
    # Evaluating reads the model and draws nothing: the same adapter bit for bit.
    assert_bitwise_equal(adapter(out), adapter(reference[0]))
    assert sorted(result.evals) == [0, 4, 8, 12]  # 0: before the first step
    losses = [result.evals[s]["loss"] for s in (0, 4, 8, 12)]
    assert losses[-1] < losses[0], losses
    assert result.evals[12]["perplexity"] == pytest.approx(np.exp(losses[-1]), rel=1e-6)
    history = json.loads((out / "eval.json").read_text())
    assert [e["step"] for e in history] == [0, 4, 8, 12]
    assert history[-1]["metrics"]["loss"] == pytest.approx(losses[-1])
    assert history[-1]["samples"][0]["prompt"]  # the first held-out prompt
    tb = scalars(out / "tensorboard")
    assert tb["eval/loss"] == pytest.approx(dict(zip((0, 4, 8, 12), losses, strict=True)))
    assert "completion" in texts(out / "tensorboard")["eval/sample_0/text_summary"][12]


def test_held_out_fraction_is_disjoint_and_the_same_on_every_host():
    ds = data.open_records(str(DATA))

    def origins(view) -> list[int]:
        return [view.origin(i) for i in range(len(view))]

    train_a, held_a = data.held_out_split(ds, 0.1, seed=3)
    train_b, held_b = data.held_out_split(ds, 0.1, seed=3)
    assert origins(held_a) == origins(held_b) and len(held_a) == round(0.1 * len(ds))
    assert origins(held_a) == sorted(origins(held_a))  # the files' order
    assert set(origins(train_a)).isdisjoint(origins(held_a))
    assert sorted(origins(train_a) + origins(held_a)) == list(range(len(ds)))
    assert origins(data.held_out_split(ds, 0.1, seed=4)[1]) != origins(held_a)
    # Errors still name the file and line of a held-out row.
    assert held_a.where(0) == ds.where(held_a.origin(0))
    assert held_a[0].values == ds[held_a.origin(0)].values


def test_eval_fraction_holds_rows_out_of_training(model_dir, tmp_path):
    out = tmp_path / "out"
    doc = job_doc(model_dir, out, steps=4, lora=True)
    doc["spec"]["eval"] = {"fraction": 0.1, "samples": 0}
    result = run_job(doc)
    assert sorted(result.evals) == [4] and np.isfinite(result.evals[4]["loss"])


def test_too_little_held_out_data_names_the_field(model_dir, tmp_path):
    doc = job_doc(model_dir, tmp_path / "out", steps=2)
    doc["spec"]["eval"] = {"fraction": 0.01}  # 3 rows, fewer than batchSize 8
    with pytest.raises(data.DataError, match=r"spec.eval: the held-out data has 3 rows"):
        run_job(doc)


def test_export_a_checkpoint_without_training(model_dir, reference, tmp_path):
    out = tmp_path / "out"
    shutil.copytree(reference[0] / "checkpoints", out / "checkpoints")
    job, errors = validate(job_doc(model_dir, out))
    assert not errors, errors
    # The newest checkpoint, as the run exported it: the same adapter bit for bit.
    step, uri = export_checkpoint(job)
    assert (step, uri) == (12, str(out / "hf"))
    assert_bitwise_equal(adapter(out), adapter(reference[0]))
    # An earlier step, merged: a full model that loads back, in a directory of its own.
    step, uri = export_checkpoint(job, 8, "merged")
    assert (step, uri) == (8, str(out / "hf-step-8-merged"))
    assert not (out / "hf-step-8-merged" / "adapter_config.json").exists()
    assert export_checkpoint(job, kind="merged") == (12, str(out / "hf-merged"))
    assert (out / "hf" / "adapter_config.json").is_file()  # the adapter stays as it was
    merged, _ = models.load_model(uri)
    assert merged.config.num_layers == models.load_model(model_dir)[0].config.num_layers
    with pytest.raises(ValueError, match=r"--step: no checkpoint 5 under .* \(there: 4, 8, 12\)"):
        export_checkpoint(job, 5)


def test_keep_best_keeps_and_exports_the_best_held_out_step(model_dir, tmp_path):
    held_out = tmp_path / "held-out.jsonl"
    held_out.write_text("".join(DATA.read_text().splitlines(keepends=True)[-16:]))
    out = tmp_path / "out"
    doc = job_doc(model_dir, out)
    doc["spec"]["eval"] = {"source": str(held_out), "everySteps": 4, "samples": 0}
    doc["spec"]["checkpoint"]["keepBest"] = "loss"
    doc["spec"]["output"]["exportFrom"] = "best"
    result = run_job(doc)
    losses = {s: m["loss"] for s, m in result.evals.items() if s > 0}
    best = min(losses, key=losses.get)
    assert committed_steps(out) == [4, 8, 12]  # the newest, as without keepBest
    kept = sorted(p.name for p in (out / "checkpoints-best").iterdir() if p.name.isdigit())
    assert kept == [str(best)], (kept, losses)
    # The run's export holds the best step's weights: what exporting that step gives.
    job, _ = validate(doc)
    assert export_checkpoint(job, best, "adapter")[0] == best
    exported = load((out / "hf" / "adapter_model.safetensors").read_bytes())
    at_best = load((out / f"hf-step-{best}" / "adapter_model.safetensors").read_bytes())
    assert_bitwise_equal(exported, at_best)
    assert export_checkpoint(job, best=True) == (best, str(out / f"hf-step-{best}"))


def test_resume_in_process_is_bitwise_identical(model_dir, reference, tmp_path):
    out = tmp_path / "out"
    first = run_job(job_doc(model_dir, out, steps=12, every=4) | {})
    assert first.step == 12
    # Drop the last checkpoint and the export, as if the run had died after step 8.
    for path in glob.glob(str(out / "checkpoints" / "12")) + [str(out / "hf")]:
        subprocess.run(["rm", "-rf", path], check=True)
    again = run_job(job_doc(model_dir, out, steps=12, every=4))
    assert again.resumed_from == 8 and again.step == 12
    assert_bitwise_equal(adapter(out), adapter(reference[0]))


def test_cpu_jobs_save_in_the_foreground_unless_the_job_says():
    from posttrain.api.spec import CheckpointSpec
    from posttrain.trainer.checkpoint import background_saves

    unset = CheckpointSpec()
    assert background_saves(unset, "tpu") and background_saves(unset, "gpu")
    assert not background_saves(unset, "cpu")  # a second copy of the state in host memory
    assert background_saves(CheckpointSpec.model_validate({"async": True}), "cpu")
    assert not background_saves(CheckpointSpec.model_validate({"async": False}), "tpu")


def test_corrupt_latest_checkpoint_is_skipped(model_dir, reference, tmp_path, caplog):
    out = tmp_path / "out"
    run_job(job_doc(model_dir, out))
    for f in (out / "checkpoints" / "12").rglob("*"):
        if f.is_file():
            f.write_bytes(b"\0garbage")
    subprocess.run(["rm", "-rf", str(out / "hf")], check=True)
    again = run_job(job_doc(model_dir, out))
    assert again.resumed_from == 8
    assert "checkpoints/12 is unreadable" in caplog.text
    assert_bitwise_equal(adapter(out), adapter(reference[0]))


def _posttrain_run(job_file: Path, **env: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "posttrain.cli", "run", str(job_file)],
        env={**os.environ, "JAX_PLATFORMS": "cpu", **env},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def test_an_unreachable_hub_is_one_line_naming_the_field_and_a_retry(tmp_path):
    """No Hub answers (HF_ENDPOINT at a closed local port): one line naming the field and
    the address, and exit code 75 (the JobSet restarts the pod), not a traceback."""
    doc = job_doc(tmp_path, tmp_path / "out", steps=2)
    doc["spec"]["model"]["source"] = "hf://HuggingFaceTB/SmolLM2-135M-Instruct"
    job_file = tmp_path / "job.yaml"
    job_file.write_text(yaml.safe_dump(doc))
    proc = _posttrain_run(job_file, HF_ENDPOINT="http://127.0.0.1:9", HF_HOME=str(tmp_path))
    output, _ = proc.communicate(timeout=120)
    assert proc.returncode == 75, output
    assert "Traceback" not in output, output
    last = output.strip().splitlines()[-1]
    assert last.startswith(
        "posttrain: spec.model.source: cannot fetch hf://HuggingFaceTB/SmolLM2-135M-Instruct "
        "from the Hugging Face Hub (ConnectionRefusedError: [Errno 111] Connection refused)"
    ), last


def test_an_unreachable_bucket_is_one_line_naming_the_field_and_a_retry(tmp_path):
    """Cloud Storage does not answer (STORAGE_EMULATOR_HOST at a closed local port): one
    line naming the field and the address before anything loads, exit 75."""
    doc = job_doc(tmp_path, tmp_path / "out", steps=2)
    (tmp_path / "config.json").write_text("{}")  # a model directory to the local checks
    doc["spec"]["data"]["source"] = "gs://ptdata/chat.jsonl"
    job_file = tmp_path / "job.yaml"
    job_file.write_text(yaml.safe_dump(doc))
    proc = _posttrain_run(job_file, STORAGE_EMULATOR_HOST="http://127.0.0.1:9")
    output, _ = proc.communicate(timeout=120)
    assert proc.returncode == 75, output
    assert "Traceback" not in output, output
    assert (
        output.strip()
        .splitlines()[-1]
        .startswith(
            "posttrain: spec.data.source: cannot reach gs://ptdata/chat.jsonl at "
            "http://127.0.0.1:9 (ConnectionRefusedError"
        )
    ), output


def test_a_missing_bucket_names_the_field():
    with gcs_bucket("ptexists"):
        storage.check_reachable("gs://ptexists/data.jsonl", "spec.data.source")
        with pytest.raises(ValueError, match=r"^spec.output.uri: gs://nope/run: bucket 'nope'"):
            storage.check_reachable("gs://nope/run", "spec.output.uri")


def _wait_for_checkpoint(out: Path | str, proc: subprocess.Popen, timeout: float = 240) -> int:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        done = committed_steps(out)
        if done:
            return max(done)
        assert proc.poll() is None, proc.stdout.read()
        time.sleep(0.05)
    raise AssertionError("no checkpoint appeared")


# The signal goes as soon as the first checkpoint (step 5) commits: the 55 steps after it
# outlast that wait many times over, and a run that finished anyway fails the test.
LONG = {"steps": 60, "every": 5, "logEverySteps": 10}


@pytest.fixture(scope="module")
def long_reference(model_dir, tmp_path_factory):
    """An uninterrupted run long enough that a signal lands mid-way."""
    out = tmp_path_factory.mktemp("long") / "out"
    run_job(job_doc(model_dir, out, **LONG))
    return out


@pytest.fixture(scope="module")
def gcs():
    with gcs_bucket("ptruns") as bucket:
        yield bucket


@pytest.mark.parametrize(
    "sig,where",
    [(signal.SIGTERM, "local"), (signal.SIGKILL, "local"), (signal.SIGKILL, "gcs")],
    ids=["sigterm", "sigkill", "sigkill-gcs"],
)
def test_killed_run_resumes_bitwise_identical(
    model_dir, long_reference, tmp_path, sig, where, request
):
    out = tmp_path / "out" if where == "local" else f"{request.getfixturevalue('gcs')}/killed"
    job_file = tmp_path / "job.yaml"
    job_file.write_text(yaml.safe_dump(job_doc(model_dir, out, **LONG)))
    proc = _posttrain_run(job_file)
    _wait_for_checkpoint(out, proc)
    proc.send_signal(sig)
    log = proc.communicate(timeout=120)[0]
    if sig == signal.SIGTERM:
        assert proc.returncode == 143, log
        assert "after saving a checkpoint" in log
    else:
        assert proc.returncode == -signal.SIGKILL
    assert not storage.exists(storage.join(str(out), "hf")), (
        "the run finished before it was killed; nothing was tested"
    )
    record = json.loads(storage.read_text(storage.join(str(out), "goodput.json")))
    proc = _posttrain_run(job_file)
    log = proc.communicate(timeout=300)[0]
    assert proc.returncode == 0, log
    assert "resumed from checkpoint step" in log
    assert_bitwise_equal(adapter(out), adapter(long_reference))
    # Goodput over both attempts: the steps the killed one recorded past the checkpoint
    # the second resumed from are lost (none after SIGTERM, which checkpoints first).
    resumed = int(re.search(r"resumed from checkpoint step (\d+)", log).group(1))
    summary = json.loads(storage.read_text(storage.join(str(out), "summary.json")))["goodput"]
    assert summary["attempts"] == 2
    assert summary["lostSteps"] == record["reached"] - resumed
    if sig == signal.SIGTERM:
        assert summary["lostSteps"] == 0
    assert sum(summary["fractions"].values()) == pytest.approx(1.0)


def test_checkpoints_and_outputs_on_gcs(model_dir, reference, gcs, caplog):
    """output.uri on gs://: Orbax writes the checkpoints straight to the bucket,
    TensorBoard and the export are uploaded; a resume skips a partial step (no
    commit_success.txt) and a corrupt one, and still ends bitwise identical."""
    out = f"{gcs}/tiny"
    first = run_job(job_doc(model_dir, out))
    assert first.step == 12 and first.export_dir == f"{out}/hf"
    assert committed_steps(out) == [4, 8, 12]
    assert storage.list_uri(f"{out}/tensorboard")
    assert_bitwise_equal(adapter(out), adapter(reference[0]))

    # The run "died" after writing step 8 and while writing step 12: step 12 has no
    # commit_success.txt and step 8's objects were damaged afterwards.
    storage.delete(f"{out}/hf", recursive=True)
    storage.delete(f"{out}/checkpoints/12/commit_success.txt")
    for f in storage.list_uri(f"{out}/checkpoints/8", recursive=True):
        if "/state/" in f and not f.endswith("commit_success.txt"):
            storage.write_bytes(f, b"\0garbage")
    again = run_job(job_doc(model_dir, out))
    assert again.resumed_from == 4 and again.step == 12
    assert "checkpoints/8 is unreadable" in caplog.text
    assert storage.exists(f"{out}/checkpoints/8.unreadable/state")
    assert committed_steps(out) == [4, 8, 12]
    assert_bitwise_equal(adapter(out), adapter(reference[0]))


def test_full_finetune_exports_merged_model_that_loads(model_dir, tmp_path):
    from posttrain.trainer import models

    out = tmp_path / "out"
    result = run_job(job_doc(model_dir, out, steps=4, lora=False, every=4))
    assert result.export_dir == str(out / "hf")
    tuned, _ = models.load_model(out / "hf")
    base, _ = models.load_model(model_dir)
    ids = np.array([[5, 17, 42, 99, 7, 3]], np.int32)
    delta = np.abs(
        np.asarray(models.forward(tuned, ids)) - np.asarray(models.forward(base, ids))
    ).max()
    assert delta > 1e-3  # training changed the weights, and the export carries them


def test_missing_column_is_a_user_error(model_dir, tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"question": "hi", "reply": "hello"}\n' * 20)
    doc = job_doc(model_dir, tmp_path / "out")
    doc["spec"]["data"]["source"] = str(bad)
    job_file = tmp_path / "job.yaml"
    job_file.write_text(yaml.safe_dump(doc))
    proc = _posttrain_run(job_file)
    log = proc.communicate(timeout=120)[0]
    assert proc.returncode == 65, log
    assert str(bad) in log and "column" in log and "question" in log
    assert not (tmp_path / "out" / "checkpoints").exists() or not any(
        (tmp_path / "out" / "checkpoints").iterdir()
    )


def test_hf_source_fetches_only_what_the_trainer_reads(monkeypatch, tmp_path):
    """hf:// asks the Hub for weights, configs and tokenizer files, not every copy of the
    model a repository holds (no network here: the download itself is replaced)."""
    import fnmatch

    import huggingface_hub

    from posttrain.trainer import sources

    calls = []

    def snapshot_download(repo_id, **kwargs):
        calls.append((repo_id, kwargs))
        return str(tmp_path)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    assert sources.local_model_dir("hf://org/model", tmp_path) == str(tmp_path)
    ((repo, kwargs),) = calls
    assert repo == "org/model" and kwargs["cache_dir"] == str(sources.HF_CACHE)

    def fetched(name):
        return any(fnmatch.fnmatch(name, p) for p in kwargs["allow_patterns"])

    wanted = ["config.json", "model-00001-of-00004.safetensors", "model.safetensors.index.json"]
    wanted += ["tokenizer.json", "tokenizer.model", "chat_template.jinja", "adapter_config.json"]
    assert all(fetched(n) for n in wanted)
    assert not any(fetched(n) for n in ["pytorch_model.bin", "model.gguf", "flax_model.msgpack"])


def test_hf_source_revision(monkeypatch, tmp_path):
    """hf://org/name@revision downloads that branch, tag or commit."""
    import huggingface_hub

    from posttrain.trainer import sources

    calls = []
    monkeypatch.setattr(
        huggingface_hub, "snapshot_download", lambda repo, **kw: calls.append((repo, kw)) or "d"
    )
    sources.local_model_dir("hf://org/model@v1.0", tmp_path)
    sources.local_model_dir("hf://org/model", tmp_path)
    assert [(r, kw["revision"]) for r, kw in calls] == [("org/model", "v1.0"), ("org/model", None)]


def _held_out_rows(model_dir, fraction: float):
    """A job holding out `fraction` of DATA, and those rows built for it."""
    doc = job_doc(model_dir, "/unused")
    doc["spec"]["eval"] = {"fraction": fraction}
    job, _ = validate(doc)
    tokenizer = data.load_tokenizer(str(model_dir))
    held_out = data.held_out_split(data.open_records(str(DATA)), fraction, seed=0)[1]
    return job, data.build_rows(job.spec, tokenizer, held_out)


def test_held_out_batches_hold_the_rows_asked_for_where_there_are_that_many(model_dir):
    from posttrain.trainer import evaluate

    job, rows = _held_out_rows(model_dir, 0.5)
    batch = job.spec.training.batch_size

    def sizes(rows_per_batch):
        out = evaluate.held_out_batches(job.spec, rows, 0, 1, rows_per_batch)
        return {len(b["input_ids"]) for b in out}

    assert len(rows) >= 2 * batch
    assert sizes(None) == {batch}
    assert sizes(2 * batch) == {2 * batch}  # GRPO: a step's rollout rows
    assert sizes(len(rows) + 1) == {batch}  # fewer held-out rows than asked: batchSize


def test_a_second_evaluation_compiles_nothing(model_dir, caplog):
    from posttrain.trainer import evaluate
    from posttrain.trainer.loop import _global_batch

    job, rows = _held_out_rows(model_dir, 0.2)
    model, _ = models.load_model(model_dir)
    mesh = models.make_mesh()
    measure, summarize = evaluate.token_loss(model, lambda b: _global_batch(b, mesh))
    evaluation = evaluate.Evaluation(
        0, evaluate.held_out_batches(job.spec, rows, 0, 1), measure, summarize
    )
    assert len(evaluation.batches) > 1

    def compiles(run) -> tuple[dict, list[str]]:
        caplog.clear()
        with caplog.at_level(logging.WARNING):
            out = run()
        return out, [r.getMessage() for r in caplog.records if "Compiling" in r.getMessage()]

    jax.config.update("jax_log_compiles", True)
    try:
        first, compiled = compiles(evaluation.run)
        again, recompiled = compiles(evaluation.run)
    finally:
        jax.config.update("jax_log_compiles", False)
    assert compiled  # the first evaluation compiles (so the log would show a second)
    assert again == first and not recompiled, recompiled
