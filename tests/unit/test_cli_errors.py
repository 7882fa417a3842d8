"""Ordinary mistakes on the command line end in one line and a documented exit code
(posttrain.cli's docstring), before anything heavy loads: a file that is not there, a
job that never ran, an output that cannot be written, no cluster configured."""

from __future__ import annotations

import argparse
import json
import logging
import os
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import ClassVar

import pytest
import yaml

ROOT = Path(__file__).parent.parent.parent


def posttrain(*args, cwd=ROOT, env=None, seconds=None):
    began = time.monotonic()
    r = subprocess.run(
        [sys.executable, "-m", "posttrain.cli", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        env={**os.environ, **(env or {})},
    )
    took = time.monotonic() - began
    assert "Traceback" not in r.stderr, r.stderr
    assert len(r.stderr.splitlines()) == (r.returncode != 0 or "warning" in r.stderr), r.stderr
    if seconds is not None:  # refused before JAX loads (a JAX import alone takes seconds)
        assert took < seconds, (args, took)
    return r


def job_file(tmp_path: Path, **spec) -> Path:
    """A valid local job whose model directory and data file exist (all but empty:
    nothing loads them before these checks)."""
    (tmp_path / "model").mkdir(exist_ok=True)
    (tmp_path / "model" / "config.json").write_text("{}")
    (tmp_path / "train.jsonl").write_text("")
    doc = {
        "apiVersion": "posttrain.dev/v1alpha1",
        "kind": "PostTrainJob",
        "metadata": {"name": "mistakes"},
        "spec": {
            "model": {"source": str(tmp_path / "model")},
            "lora": {"rank": 4, "alpha": 8},
            "data": {"source": str(tmp_path / "train.jsonl")},
            "training": {"steps": 10, "warmupSteps": 4},
            "output": {"uri": str(tmp_path / "run")},
            **spec,
        },
    }
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


@pytest.mark.parametrize(
    "args, code",
    [
        (["validate", "{missing}"], 1),
        (["estimate", "{missing}"], 1),
        (["render", "{missing}"], 1),
        (["run", "{missing}"], 65),
        (["export", "{missing}"], 65),
        (["generate", "{missing}", "--prompt", "hi"], 65),
        (["convert-gguf", "{out}", "--gguf", "{missing}"], 65),
        (["train", "--config", "{missing}"], 65),
    ],
)
def test_a_file_that_is_not_there(tmp_path, args, code):
    missing = tmp_path / "nowhere.yaml"
    args = [a.format(missing=missing, out=tmp_path / "out") for a in args]
    r = posttrain(*args, seconds=4)
    assert r.returncode == code
    assert str(missing) in r.stderr


def test_export_of_a_job_that_never_ran(tmp_path):
    job = job_file(tmp_path)
    r = posttrain("export", str(job), seconds=4)
    assert r.returncode == 65
    assert "spec.output.uri" in r.stderr and f"posttrain run {job}" in r.stderr
    assert not (tmp_path / "run" / "checkpoints").exists()  # nothing made on the way


def test_generate_from_a_job_that_never_ran(tmp_path):
    job = job_file(tmp_path)
    r = posttrain("generate", str(job), "--prompt", "hi", seconds=4)
    assert r.returncode == 65
    assert f"no export at {tmp_path / 'run' / 'hf'} yet (posttrain run {job} first)" in r.stderr


def test_export_flags_refused_before_loading(tmp_path):
    job = job_file(tmp_path)
    for step in (3, 6):
        (tmp_path / "run" / "checkpoints" / str(step)).mkdir(parents=True)
    r = posttrain("export", str(job), "--step", "5", seconds=4)
    assert (
        r.returncode == 65 and "--step: no checkpoint 5" in r.stderr and "(there: 3, 6)" in r.stderr
    )
    r = posttrain("export", str(job), "--best", seconds=4)
    assert r.returncode == 65 and "--best" in r.stderr and "spec.checkpoint.keepBest" in r.stderr
    r = posttrain("export", str(job), "--output", str(tmp_path / "other"), seconds=4)
    assert r.returncode == 65 and "--output" in r.stderr


@pytest.mark.parametrize("where", ["/proc/posttrain-run", "{file}/run"])
def test_run_refuses_an_output_it_cannot_write(tmp_path, where):
    job = job_file(tmp_path)
    (tmp_path / "a-file").write_text("kept")
    output = where.format(file=tmp_path / "a-file")
    r = posttrain("run", str(job), "--output", output, seconds=4)
    assert r.returncode == 65
    assert "--output (spec.output.uri)" in r.stderr and output in r.stderr
    assert (tmp_path / "a-file").read_text() == "kept"
    doc = yaml.safe_load(job.read_text())
    doc["spec"]["output"]["uri"] = output
    job.write_text(yaml.safe_dump(doc))
    r = posttrain("run", str(job), seconds=4)
    assert r.returncode == 65 and "spec.output.uri" in r.stderr and "--output" not in r.stderr


def test_missing_inputs_name_the_field_and_the_directory_looked_in(tmp_path):
    sub = tmp_path / "project"
    (sub / "data").mkdir(parents=True)
    (sub / "data" / "train.jsonl").write_text("")
    (sub / "model").mkdir()
    job = job_file(sub)
    doc = yaml.safe_load(job.read_text())
    doc["spec"]["data"]["source"] = "data/train.jsonl"  # relative: to the working directory
    job.write_text(yaml.safe_dump(doc))
    r = posttrain("validate", str(job), cwd=tmp_path)
    assert r.returncode == 0 and r.stdout == f"{job}: valid\n"
    assert "warning: spec.data.source: data/train.jsonl" in r.stderr
    assert f"working directory {tmp_path}" in r.stderr and f"run from {sub}" in r.stderr
    r = posttrain("run", str(job), cwd=tmp_path, seconds=4)
    assert r.returncode == 65 and "spec.data.source" in r.stderr
    assert not (sub / "run").exists()  # refused before the output is made
    r = posttrain("validate", str(job), cwd=sub)  # from there: no warning
    assert r.returncode == 0 and r.stderr == ""
    (sub / "model" / "config.json").unlink()
    r = posttrain("run", str(job), cwd=sub, seconds=4)
    assert r.returncode == 65
    assert f"spec.model.source: {sub / 'model'} has no config.json" in r.stderr


@pytest.mark.parametrize("args", [["logs", "some-job"], ["operator"]])
def test_without_a_cluster(tmp_path, args):
    env = {"KUBECONFIG": str(tmp_path / "no-kubeconfig"), "HOME": str(tmp_path)}
    env["KUBERNETES_SERVICE_HOST"] = ""  # not in a pod either
    r = posttrain(*args, env=env, seconds=10)
    assert r.returncode == 1 and "KUBECONFIG" in r.stderr


def test_version():
    r = subprocess.run(
        [sys.executable, "-m", "posttrain.cli", "--version"], capture_output=True, text=True
    )
    assert r.returncode == 0 and r.stdout.startswith("posttrain ")


def test_steps_below_the_warmup_caps_the_warmup(tmp_path, capsys):
    from posttrain.api.validate import InvalidJob
    from posttrain.trainer.main import _load_run

    job = job_file(tmp_path)  # warmupSteps: 4

    def flags(steps):
        return argparse.Namespace(file=str(job), output=None, steps=steps)

    short = _load_run(flags(2))
    assert (short.spec.training.steps, short.spec.training.warmup_steps) == (2, 1)
    assert "--steps 2: spec.training.warmupSteps 4 capped to 1" in capsys.readouterr().err
    assert _load_run(flags(6)).spec.training.warmup_steps == 4  # above it: as written
    with pytest.raises(InvalidJob, match="spec.training.steps"):
        _load_run(flags(0))


def test_a_shortened_run_writes_beside_the_jobs_output(tmp_path, capsys):
    """`posttrain run job.yaml --steps 2` is a quick try: it must not become the job's own
    run, which a later plain run would resume with the try's schedule."""
    from posttrain.trainer.main import _load_run

    job = job_file(tmp_path)  # steps: 10

    def flags(steps, output=None):
        return argparse.Namespace(file=str(job), output=output, steps=steps)

    short = _load_run(flags(2))
    assert short.spec.output.uri == f"{tmp_path / 'run'}-steps-2"
    assert short.spec.training.warmup_steps == 1
    assert f"--steps 2: writing to {tmp_path / 'run'}-steps-2" in capsys.readouterr().err
    assert _load_run(flags(10)).spec.output.uri == str(tmp_path / "run")  # the file's own
    assert _load_run(flags(None)).spec.output.uri == str(tmp_path / "run")
    chosen = _load_run(flags(2, str(tmp_path / "try")))
    assert chosen.spec.output.uri == str(tmp_path / "try")


def test_a_run_does_not_resume_checkpoints_of_another_schedule(tmp_path):
    from posttrain.checks import load_job
    from posttrain.trainer import run_schedule

    out, job = tmp_path / "run", job_file(tmp_path)
    short = load_job(str(job), {"spec.training.steps": 6}).spec
    run_schedule.check_and_record(short, is_main=True)  # a new output: recorded
    (out / "checkpoints" / "6").mkdir(parents=True)
    run_schedule.check_and_record(short, is_main=True)  # its own checkpoints: resumes
    full = load_job(str(job)).spec
    with pytest.raises(ValueError) as refused:
        run_schedule.check_and_record(full, is_main=True)
    said = str(refused.value)
    assert said.startswith(f"spec.training.steps: {out} holds checkpoints of a run with steps 6")
    assert "--output DIR" in said and "(steps 6)" in said
    assert json.loads((out / "schedule.json").read_text())["steps"] == 6  # left as it was
    # Without checkpoints (a run stopped before its first), the new schedule is recorded.
    (out / "checkpoints" / "6").rmdir()
    run_schedule.check_and_record(full, is_main=True)
    assert json.loads((out / "schedule.json").read_text())["steps"] == 10
    # A constant learning rate: more steps of it continue the run.
    constant = {"spec.training.schedule": "constant"}
    run_schedule.check_and_record(load_job(str(job), constant).spec, is_main=True)
    (out / "checkpoints" / "10").mkdir()
    longer = {**constant, "spec.training.steps": 20}
    run_schedule.check_and_record(load_job(str(job), longer).spec, is_main=True)
    with pytest.raises(ValueError, match=r"^spec\.training\.batchSize: "):
        run_schedule.check_and_record(
            load_job(str(job), {**longer, "spec.training.batchSize": 4}).spec, is_main=True
        )


def test_cpu_runs_do_not_ask_for_jax_tpu(caplog):
    from absl import logging as absl_logging

    from posttrain.trainer.main import _setup_logging

    _setup_logging()
    caplog.set_level(logging.WARNING, logger="absl")
    absl_logging.warning("Skipping non-TPU device: %s. You might be missing jax[tpu]", "cpu")
    absl_logging.warning("a warning worth reading")
    assert [r.getMessage() for r in caplog.records] == ["a warning worth reading"]


def test_a_warmup_not_below_the_steps_shows_both_and_the_way_out(tmp_path):
    job = job_file(tmp_path, training={"steps": 10, "warmupSteps": 20})
    said = "spec.training.warmupSteps: training.warmupSteps (20) must be less than "
    said += "training.steps (10)"
    r = posttrain("validate", str(job))
    assert r.returncode == 1 and f"{job}: {said}\n" == r.stderr
    r = posttrain("run", str(job), seconds=4)
    assert r.returncode == 65 and said in r.stderr and "--steps N" in r.stderr


def test_crd_message_shows_the_values_too():
    from posttrain.api import crd

    spec = crd.crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]["spec"]
    rule = next(r for r in spec["x-kubernetes-validations"] if ".warmupSteps <" in r["rule"])
    assert rule["messageExpression"] == (
        "'training.warmupSteps (%d) must be less than training.steps (%d)'"
        ".format([self.training.warmupSteps, self.training.steps])"
    )


@pytest.mark.parametrize(
    "flags, name",
    [([], "hf"), (["--step", "3"], "hf-step-3"), (["--format", "merged"], "hf-merged")],
)
def test_export_refuses_an_export_directory_it_cannot_write(tmp_path, flags, name):
    job = job_file(tmp_path)
    (tmp_path / "run" / "checkpoints" / "3").mkdir(parents=True)
    (tmp_path / "run" / name).write_text("in the way")  # export writes the directory there
    r = posttrain("export", str(job), *flags, seconds=4)
    assert r.returncode == 65 and "spec.output.uri" in r.stderr
    assert f"{tmp_path / 'run' / name}: cannot write there: a file is in the way" in r.stderr


class _ReadOnlyGcs(BaseHTTPRequestHandler):
    """Cloud Storage's JSON API as an identity that may list but not write or delete
    (`forbidden`) sees it: reads answer, the rest is 403 as from storage.googleapis.com."""

    forbidden: ClassVar[set[str]] = {"POST"}
    prefixes: ClassVar[list[str]] = []

    def _answer(self, code: int, body: dict | None = None) -> None:
        data = json.dumps(body).encode() if body is not None else b""
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _refuse(self) -> bool:
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        if self.command not in self.forbidden:
            return False
        message = "caller does not have storage.objects.create access to the bucket"
        self._answer(403, {"error": {"code": 403, "message": message}})
        return True

    def do_GET(self):
        self._answer(200, {"kind": "storage#objects", "items": [], "prefixes": self.prefixes})

    def do_POST(self):
        if not self._refuse():
            self._answer(200, {"bucket": "ro", "name": "probe", "generation": "1"})

    def do_DELETE(self):
        if not self._refuse():
            self._answer(204)

    def log_message(self, *args):
        pass


@contextmanager
def read_only_gcs(forbidden: set[str], prefixes: list[str] = ()):
    """STORAGE_EMULATOR_HOST for a bucket this identity may list but not write."""
    handler = type("Handler", (_ReadOnlyGcs,), {"forbidden": forbidden, "prefixes": prefixes})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        host, port = server.server_address
        yield {"STORAGE_EMULATOR_HOST": f"http://{host}:{port}", "GOOGLE_CLOUD_PROJECT": "t"}
    finally:
        server.shutdown()
        server.server_close()


@pytest.mark.parametrize("forbidden, verb", [({"POST"}, "write"), ({"DELETE"}, "delete")])
def test_run_refuses_a_bucket_it_may_not_write(tmp_path, forbidden, verb):
    job = job_file(tmp_path)
    with read_only_gcs(forbidden) as env:
        r = posttrain("run", str(job), "--output", "gs://ro/run", env=env, seconds=10)
    assert r.returncode == 65, r.stderr
    assert r.stderr.startswith(
        f"posttrain: {job}: --output (spec.output.uri): gs://ro/run: this identity may not "
        f"{verb} objects in bucket 'ro'"
    ), r.stderr


def test_export_refuses_a_bucket_it_may_not_write(tmp_path):
    job = job_file(tmp_path)
    with read_only_gcs({"POST"}, prefixes=["run/checkpoints/3/"]) as env:
        r = posttrain("export", str(job), "--output", "gs://ro/run", env=env, seconds=10)
        assert r.returncode == 65, r.stderr
        assert "--output (spec.output.uri): gs://ro/run/hf: this identity may not write" in (
            r.stderr
        )
        r = posttrain("export", str(job), "--output", "gs://ro/run", "--step", "2", env=env)
        assert r.returncode == 65 and "no checkpoint 2 under gs://ro/run/checkpoints" in r.stderr


def test_render_refuses_a_namespace_and_an_image_the_cluster_would(tmp_path, capsys):
    from posttrain import cli

    job = job_file(tmp_path)
    code = cli.main(["render", str(job), "-n", "evil ns", "--trainer-image", "x; rm -rf /"])
    out = capsys.readouterr()
    assert code == 2 and out.out == ""
    assert out.err.splitlines() == [
        "posttrain render: --namespace: 'evil ns' is not a namespace name: at most 63 "
        "lowercase letters, digits and '-', starting and ending with a letter or digit",
        "posttrain render: --trainer-image: contains a space; an image reference holds no "
        "control or whitespace characters",
    ]
    assert cli.main(["render", str(job), "-n", "team-a", "--trainer-image", "r.io/t:1"]) == 0
    assert "namespace: team-a" in capsys.readouterr().out


def test_validate_refuses_a_namespace_the_api_server_would(tmp_path):
    doc = yaml.safe_load(job_file(tmp_path).read_text())
    doc["metadata"]["namespace"] = "Team_A"
    path = tmp_path / "ns.yaml"
    path.write_text(yaml.safe_dump(doc))
    r = posttrain("validate", str(path))
    assert r.returncode == 1
    assert r.stderr == f"{path}: metadata.namespace: 'Team_A' is not a namespace name: " \
        "at most 63 lowercase letters, digits and '-', starting and ending with a letter or digit\n"  # fmt: skip
