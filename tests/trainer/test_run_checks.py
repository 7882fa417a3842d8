"""What `posttrain run` refuses before the model loads: a job this machine's memory
cannot hold, and a dataset with fewer rows than one step takes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from tiny_job import run_job, tiny_job

from posttrain.trainer import loop
from posttrain.trainer.data import DataError

pytestmark = pytest.mark.trainer
DATA = Path(__file__).resolve().parents[2] / "examples" / "data" / "chat-sft.jsonl"


def test_run_refuses_a_job_this_machine_cannot_hold_before_loading(model_dir, tmp_path):
    big = tmp_path / "big"  # config.json only: a 70B Llama shape, no weights
    big.mkdir()
    config = json.loads((model_dir / "config.json").read_text())
    config.update(hidden_size=8192, num_hidden_layers=80, intermediate_size=28672)
    (big / "config.json").write_text(json.dumps(config))
    doc = tiny_job(big, DATA, tmp_path / "out", steps=2, every=2, lora=False)
    doc["spec"]["resources"] = {"accelerator": "cpu"}
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump(doc))
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    env.pop("POSTTRAIN_SKIP_MEMORY_CHECK", None)
    began = time.monotonic()
    r = subprocess.run(
        [sys.executable, "-m", "posttrain.cli", "run", str(job)],
        env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert r.returncode == 65, r.stderr
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("posttrain: spec.resources.accelerator: the job needs about "), last
    assert "GiB of host memory" in last and "loading the model" not in r.stderr
    assert time.monotonic() - began < 60


def test_too_few_rows_are_refused_before_the_model_loads(model_dir, tmp_path, monkeypatch):
    three = tmp_path / "three.jsonl"
    three.write_text("".join(DATA.read_text().splitlines(keepends=True)[:3]))

    def no_loading(*args, **kwargs):
        raise AssertionError("the model loaded before the data was checked")

    monkeypatch.setattr(loop, "load_policy", no_loading)
    with pytest.raises(DataError, match=r"the dataset has 3 rows, fewer than spec\.training\."):
        run_job(tiny_job(model_dir, three, tmp_path / "out", steps=2, every=2))
