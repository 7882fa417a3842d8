"""Every technique trains on the chip through the trainer's own entry point (`train`, what
`posttrain run` calls): bfloat16, a few steps, a checkpoint and an export, and the log
names the TPU it trained on. Tiny models here (a minute in all); the published shapes are
bench/tpu.py's (docs/tpu.md)."""

from __future__ import annotations

import json
import logging
import random
from pathlib import Path

import pytest
from tiny_job import run_job, tiny_job
from tiny_model import make_tiny_llama

ROOT = Path(__file__).resolve().parents[2]
CHAT = ROOT / "examples" / "data" / "chat-sft.jsonl"
PAIRS = ROOT / "examples" / "data" / "preferences-dpo.jsonl"
VISION = ROOT / "examples" / "sft-lora-gemma3-vision-cpu.yaml"


@pytest.fixture(scope="module")
def models_dir(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("models")
    make_tiny_llama(root / "student")
    make_tiny_llama(root / "teacher", seed=1)
    with (root / "say.jsonl").open("w") as f:
        rng = random.Random(0)
        for _ in range(64):
            n = rng.randint(0, 9)
            f.write(json.dumps({"prompt": f"Say {n}.", "answer": str(n)}) + "\n")
    return root


def _jobs(root: Path, out: Path) -> dict[str, dict]:
    common = {"steps": 4, "every": 2, "dtype": "bfloat16"}
    return {
        "sft-full": tiny_job(root / "student", CHAT, out, lora=False, **common),
        "sft-lora": tiny_job(root / "student", CHAT, out, **common),
        "dpo-lora": tiny_job(root / "student", PAIRS, out, technique="dpo", **common),
        "distill": tiny_job(root / "student", CHAT, out, lora=False, technique="distill",
                            distill={"teacher": {"source": str(root / "teacher")}}, **common),
        "grpo-lora": tiny_job(
            root / "student", root / "say.jsonl", out, technique="grpo",
            grpo={"numGenerations": 4, "maxPromptLength": 32, "maxCompletionLength": 8,
                  "rewards": [{"type": "exactAnswer"}]}, **common),
    }  # fmt: skip


@pytest.mark.parametrize("name", ["sft-full", "sft-lora", "dpo-lora", "distill", "grpo-lora"])
def test_technique_trains_checkpoints_and_exports_on_the_tpu(models_dir, tmp_path, name, caplog):
    out = tmp_path / "out"
    doc = _jobs(models_dir, out)[name]
    with caplog.at_level(logging.INFO, logger="posttrain.trainer"):
        result = run_job(doc)
    assert result.step == 4 and not result.stopped_early
    assert any("training on tpu" in r.getMessage() for r in caplog.records), caplog.text
    assert (out / "checkpoints" / "4").is_dir()
    assert result.export_dir and Path(result.export_dir).is_dir()


def test_gemma3_vision_lora_trains_on_the_tpu(tmp_path, monkeypatch, caplog):
    import yaml

    monkeypatch.chdir(ROOT)  # the example's paths are relative to the repository
    doc = yaml.safe_load(VISION.read_text())
    spec = doc["spec"]
    spec["output"]["uri"] = str(tmp_path / "out")
    spec["model"]["dtype"] = "bfloat16"
    spec["training"] = {**spec.get("training", {}), "steps": 4}
    spec["checkpoint"] = {"everySteps": 2}
    spec.pop("eval", None)
    with caplog.at_level(logging.INFO, logger="posttrain.trainer"):
        result = run_job(doc)
    assert result.step == 4
    assert any("training on tpu" in r.getMessage() for r in caplog.records)
    assert result.export_dir and Path(result.export_dir).is_dir()


@pytest.mark.parametrize("lora", [True, False], ids=["lora", "full"])
def test_scanned_layers_train_the_unrolled_losses_on_the_tpu(models_dir, tmp_path, lora):
    """spec.training.layerLoop: scan on the chip (splash attention, remat dots): the same
    bfloat16 losses as unroll, to the precision of a float32 sum in another order."""
    losses = {}
    for loop in ("unroll", "scan"):
        doc = tiny_job(models_dir / "student", CHAT, tmp_path / loop, lora=lora, steps=4,
                       every=4, dtype="bfloat16",
                       training={"layerLoop": loop, "remat": "dots", "logEverySteps": 1})  # fmt: skip
        result = run_job(doc)
        losses[loop] = [result.losses[s] for s in sorted(result.losses)]
    assert len(losses["scan"]) == 4
    for got, want in zip(losses["scan"], losses["unroll"], strict=True):
        assert abs(got - want) <= 2e-3 * abs(want), losses
