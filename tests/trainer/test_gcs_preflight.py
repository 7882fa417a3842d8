"""gs:// locations checked before anything loads, against a GCS-compatible server: the
run's output is written (a probe, deleted at once), `posttrain export` finds no
checkpoint in a bucket without loading the model, and `posttrain validate` warns of a
gs:// input it cannot read, or notes that it did not check without credentials."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from data_helpers import gcs_bucket

from posttrain.trainer import storage

pytestmark = pytest.mark.trainer

ROOT = Path(__file__).resolve().parents[2]


def posttrain(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """The CLI in a child process; every refusal here comes before JAX loads."""
    began = time.monotonic()
    r = subprocess.run(
        [sys.executable, "-m", "posttrain.cli", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env=env if env is not None else dict(os.environ),
    )
    assert "Traceback" not in r.stderr, r.stderr
    assert time.monotonic() - began < 15, (args, r.stderr)  # a JAX import alone takes seconds
    return r


def job_file(tmp_path: Path, data: str, output: str) -> Path:
    (tmp_path / "model").mkdir(exist_ok=True)
    (tmp_path / "model" / "config.json").write_text("{}")
    doc = {
        "apiVersion": "posttrain.dev/v1alpha1",
        "kind": "PostTrainJob",
        "metadata": {"name": "gcs"},
        "spec": {
            "model": {"source": str(tmp_path / "model")},
            "lora": {"rank": 4, "alpha": 8},
            "data": {"source": data},
            "training": {"steps": 10},
            "output": {"uri": output},
        },
    }
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


def test_the_output_probe_leaves_nothing():
    with gcs_bucket("ptprobe") as bucket:
        storage.check_writable(f"{bucket}/run", "spec.output.uri")
        assert storage.list_uri(bucket, recursive=True) == []
        with pytest.raises(ValueError, match=r"^spec.output.uri: gs://nope/run: bucket 'nope'"):
            storage.check_writable("gs://nope/run", "spec.output.uri")


def test_export_of_a_gcs_output_without_checkpoints(tmp_path):
    with gcs_bucket("ptruns") as bucket:
        (tmp_path / "train.jsonl").write_text("")
        job = job_file(tmp_path, str(tmp_path / "train.jsonl"), f"{bucket}/run")
        r = posttrain("export", str(job))
        assert r.returncode == 65
        assert r.stderr == (
            f"posttrain: {job}: spec.output.uri: gs://ptruns/run has no checkpoints/ to "
            f"export: train first (posttrain run {job})\n"
        )
        storage.write_text(f"{bucket}/run/checkpoints/4/state/x", "")
        storage.write_text(f"{bucket}/run/checkpoints/7.orbax-checkpoint-tmp-1/x", "")
        r = posttrain("export", str(job), "--step", "2")
        assert r.returncode == 65
        assert "--step: no checkpoint 2 under gs://ptruns/run/checkpoints (there: 4)" in r.stderr
        r = posttrain("export", str(job), "--output", "gs://nope/run")
        assert r.returncode == 65
        assert "--output (spec.output.uri): gs://nope/run: bucket 'nope' does not" in r.stderr


def test_validate_warns_of_a_gcs_input_it_cannot_read(tmp_path):
    with gcs_bucket("ptdata") as bucket:
        job = job_file(tmp_path, f"{bucket}/chat.jsonl", str(tmp_path / "run"))
        r = posttrain("validate", str(job))
        assert r.returncode == 0 and r.stdout == f"{job}: valid\n"
        assert r.stderr == (
            f"{job}: warning: spec.data.source: gs://ptdata/chat.jsonl: no such object or "
            "prefix in the bucket\n"
        )
        storage.write_text(f"{bucket}/chat.jsonl", "")
        r = posttrain("validate", str(job))
        assert r.returncode == 0 and r.stderr == ""


@pytest.mark.skipif(
    Path("/sys/class/dmi/id/product_name").is_file()
    and "Google" in Path("/sys/class/dmi/id/product_name").read_text(),
    reason="a Compute Engine machine has credentials from its metadata server",
)
def test_validate_without_credentials_notes_what_it_did_not_check(tmp_path):
    job = job_file(tmp_path, "gs://ptdata/chat.jsonl", str(tmp_path / "run"))
    env = {k: v for k, v in os.environ.items() if "GOOGLE" not in k and "CLOUDSDK" not in k}
    env.pop("STORAGE_EMULATOR_HOST", None)
    env["HOME"] = str(tmp_path)
    r = posttrain("validate", str(job), env=env)
    assert r.returncode == 0 and r.stdout == f"{job}: valid\n"
    assert r.stderr == (
        f"{job}: note: gs:// inputs not checked: no Google credentials here (gcloud auth "
        "application-default login, or GOOGLE_APPLICATION_CREDENTIALS)\n"
    )
