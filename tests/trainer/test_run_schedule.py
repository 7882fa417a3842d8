"""A run does not resume checkpoints made under another schedule (a shortened try, an
edited file): it is refused before anything loads, saying how to go on."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tiny_job import run_job, tiny_job

from posttrain.trainer.main import is_user_error

pytestmark = pytest.mark.trainer
DATA = Path(__file__).resolve().parents[2] / "examples" / "data" / "chat-sft.jsonl"


def test_a_longer_run_refuses_the_checkpoints_of_a_shortened_one(model_dir, tmp_path):
    out = tmp_path / "out"
    short = tiny_job(model_dir, DATA, out, steps=2, every=2, training={"warmupSteps": 1})
    assert run_job(short).step == 2
    summary = json.loads((out / "summary.json").read_text())
    assert summary["schedule"] == {
        "steps": 2, "batchSize": 8, "learningRate": 0.01, "warmupSteps": 1, "schedule": "cosine",
    }  # fmt: skip
    full = tiny_job(model_dir, DATA, out, steps=4, every=2, training={"warmupSteps": 1})
    with pytest.raises(ValueError, match=r"^spec\.training\.steps: .* steps 2, not steps 4") as e:
        run_job(full)
    assert is_user_error(e.value)  # exit 65, one line
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["2"]  # untouched
