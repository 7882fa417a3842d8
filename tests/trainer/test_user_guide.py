"""docs/user-guide.md "Running locally", run as written (tests/guide_shell.py), and the
outputs "Outputs" lists.

`posttrain convert-gguf` really converts SmolLM2-135M-Instruct (about 15 s, 500 MB, removed
afterwards). The two training runs use a tiny random Llama (tiny_model.py) so they take
seconds instead of the demo's minutes: in the scratch copy of
examples/sft-lora-smollm2-cpu.yaml, `spec.model.source` names it (nothing else changes, so
the output stays the relative `runs/sft-lora-smollm2`), and job.yaml is that same file.
One substitution: `/tmp/try` becomes a fresh directory, so no earlier run is resumed.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import yaml
from guide_shell import guide_shell
from safetensors.numpy import load_file
from tb_events import scalars
from tiny_model import make_tiny_llama

pytestmark = pytest.mark.trainer
CURVES = {"train/loss", "train/learning_rate", "train/grad_norm", "train/tokens_per_second"}


def assert_outputs(out: Path, steps: int, rank: int) -> None:
    """checkpoints/<step>/, tensorboard/ and hf/ as the guide's "Outputs" table says."""
    saved = [int(p.name) for p in (out / "checkpoints").iterdir() if p.name.isdigit()]
    assert max(saved) == steps, saved
    curves = scalars(out / "tensorboard")
    assert set(curves) >= CURVES, curves.keys()
    assert max(curves["train/loss"]) == steps
    hf = out / "hf"
    config = json.loads((hf / "adapter_config.json").read_text())
    assert config["peft_type"] == "LORA" and config["r"] == rank
    assert any(
        k.endswith("lora_B.weight") for k in load_file(str(hf / "adapter_model.safetensors"))
    )
    assert (hf / "tokenizer.json").is_file() and (hf / "tokenizer_config.json").is_file()
    assert json.loads((out / "summary.json").read_text())["step"] == steps


def assert_evaluated(out: Path, steps: int, every: int) -> None:
    """eval.json and the eval/ curves of the example's spec.eval."""
    history = json.loads((out / "eval.json").read_text())
    assert [e["step"] for e in history] == list(range(0, steps + 1, every))
    assert history[-1]["samples"][0]["completion"] is not None
    assert history[-1]["metrics"]["loss"] < history[0]["metrics"]["loss"], history
    assert set(scalars(out / "tensorboard")["eval/loss"]) == {e["step"] for e in history}


def test_running_locally(tmp_path: Path, request) -> None:
    with guide_shell(request, tmp_path, None) as guide:
        example = guide.workdir / "examples" / "sft-lora-smollm2-cpu.yaml"
        job = yaml.safe_load(example.read_text())
        job["spec"]["model"]["source"] = str(make_tiny_llama(tmp_path / "tiny"))
        example.write_text(yaml.safe_dump(job, sort_keys=False))
        shutil.copy(example, guide.workdir / "job.yaml")
        guide.substitutions["/tmp/try"] = str(tmp_path / "try")
        converted = guide.workdir / ".cache" / "models" / "smollm2-135m-instruct"
        try:
            convert, demo, override = guide.run(guide.block("posttrain run job.yaml"))
            assert convert.stdout.startswith("converted "), convert
            config = json.loads((converted / "config.json").read_text())
            assert config["architectures"] == ["LlamaForCausalLM"]
            assert (converted / "model.safetensors").stat().st_size > 100e6
            assert (converted / "tokenizer.json").is_file()
        finally:
            shutil.rmtree(converted, ignore_errors=True)  # 500 MB

    rank, steps = job["spec"]["lora"]["rank"], job["spec"]["training"]["steps"]
    assert_outputs(guide.workdir / "runs" / "sft-lora-smollm2", steps, rank)
    assert_evaluated(
        guide.workdir / "runs" / "sft-lora-smollm2", steps, job["spec"]["eval"]["everySteps"]
    )
    assert_outputs(tmp_path / "try", 10, rank)
    bar = override.stderr.replace("\r", "\n").splitlines()
    assert any(
        "10/10" in line
        and all(
            f"{k}=" in line for k in ("loss", "learning_rate", "grad_norm", "tokens_per_second")
        )
        for line in bar
    ), override.stderr[-2000:]
