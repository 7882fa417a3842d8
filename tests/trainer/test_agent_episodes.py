"""Multi-turn episodes sampled by a real (tiny) policy that calls a tool: the tiny model is
first SFT'd to answer with a calculator call (chatml's <tool_call>), then GRPO'd with
spec.grpo.agent through `posttrain run`, on a disaggregated sampler with asynchronous
rollouts (maxStaleness 1), checkpointing every 2 steps; the run resumed from step 2 ends
bitwise where the whole run ended."""

from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from safetensors.numpy import load_file
from tb_events import scalars
from tiny_job import assert_bitwise_equal
from tiny_model import make_tiny_llama

from posttrain.checks import validate
from posttrain.trainer import tool_calls
from posttrain.trainer.distributed import ProcessInfo
from posttrain.trainer.loop import train

pytestmark = pytest.mark.trainer

CALL = '<tool_call>{"name": "c", "arguments": {"a": %d, "b": %d, "op": "+"}}</tool_call>'
AGENT = {
    "maxTurns": 2,
    "turnLength": 96,
    "toolFormat": "chatml",
    "tools": [{"name": "c", "type": "calculator"}],
}


def tools_text() -> str:
    """What the model is told about its tools (the GRPO prompts' first system turn)."""
    from posttrain.api.spec import AgentSpec
    from posttrain.trainer.tools import Toolbox

    box = Toolbox(AgentSpec.model_validate(AGENT), environ={})
    return tool_calls.FORMATS["chatml"].instructions(box.schemas())


def _doc(spec: dict, name: str) -> dict:
    return {
        "apiVersion": "posttrain.dev/v1alpha1",
        "kind": "PostTrainJob",
        "metadata": {"name": name},
        "spec": spec,
    }


@pytest.fixture(scope="module")
def caller(tmp_path_factory) -> tuple[Path, Path]:
    """The tiny model SFT'd to answer "Add a and b." with a calculator call; and prompts."""
    root = tmp_path_factory.mktemp("caller")
    rng = random.Random(0)
    sft, prompts = root / "calls.jsonl", root / "add.jsonl"
    with sft.open("w") as f:
        for _ in range(200):
            a, b = rng.randint(0, 9), rng.randint(0, 9)
            msgs = [  # as the GRPO prompt with tools renders: the tools, then the default
                {"role": "system", "content": tools_text()},
                {"role": "system", "content": "You are a helpful assistant."},
                {"role": "user", "content": f"Add {a} and {b}."},
                {"role": "assistant", "content": CALL % (a, b)},
            ]
            f.write(json.dumps({"messages": msgs}) + "\n")
    with prompts.open("w") as f:
        for _ in range(40):
            a, b = rng.randint(0, 9), rng.randint(0, 9)
            f.write(json.dumps({"prompt": f"Add {a} and {b}.", "answer": str(a + b)}) + "\n")
    # A tokenizer that has learnt the tools' text keeps the prompts short (260 tokens, not 750).
    base = make_tiny_llama(root / "base", vocab=600, corpus=[tools_text(), CALL % (3, 4)])
    spec = {
        "model": {"source": str(base), "dtype": "float32"},
        "data": {"source": str(sft), "maxLength": 320},
        "training": {
            "steps": 80,
            "batchSize": 16,
            "learningRate": 0.01,
            "schedule": "constant",
            "logEverySteps": 80,
        },
        "checkpoint": {"everySteps": 1000},
        "output": {"uri": str(root / "sft")},
    }
    parsed, errors = validate(_doc(spec, "caller-sft"))
    assert not errors, errors
    train(parsed, ProcessInfo(None, 1, 0), show_bar=False)
    return root / "sft" / "hf", prompts


def test_tool_calling_episodes_disaggregated_async_resume_exactly(caller, tmp_path):
    model, prompts = caller
    out = tmp_path / "out"
    spec = {
        "technique": "grpo",
        "model": {"source": str(model), "dtype": "float32"},
        "lora": {"rank": 4, "alpha": 8},
        "data": {"source": str(prompts)},
        "training": {"steps": 4, "batchSize": 2, "learningRate": 0.01, "logEverySteps": 1},
        "grpo": {
            "numGenerations": 2,
            "beta": 0.0,
            "maxPromptLength": 320,
            "maxCompletionLength": 200,
            "temperature": 0.7,
            "maxStaleness": 1,
            "rollout": {"placement": "disaggregated", "samplerFraction": 0.5},
            "rewards": [{"type": "exactAnswer"}],
            "agent": AGENT,
        },
        "checkpoint": {"everySteps": 2},
        "output": {"uri": str(out), "exportHF": "adapter"},
    }
    job = tmp_path / "job.yaml"
    job.write_text(yaml.safe_dump(_doc(spec, "caller-grpo")))

    def run() -> None:
        proc = subprocess.run(
            [sys.executable, "-m", "posttrain.cli", "run", str(job)],
            capture_output=True,
            text=True,
            env={**os.environ, "JAX_PLATFORMS": "cpu"},
            timeout=900,
        )
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]

    run()
    tb = scalars(out / "tensorboard")
    series = {k: [tb[f"train/{k}"][s] for s in sorted(tb[f"train/{k}"])] for k in
              ("turns", "tool_calls", "tool_errors", "staleness", "reward")}  # fmt: skip
    print(f"\nagent episodes by step: {series}")
    assert series["staleness"] == [0, 1, 0, 1]  # on-policy at each checkpoint step
    assert sum(series["tool_calls"]) > 0 and max(series["turns"]) > 1  # tools were called
    first = load_file(str(out / "hf" / "adapter_model.safetensors"))

    shutil.rmtree(out / "checkpoints" / "4")
    shutil.rmtree(out / "hf")
    run()
    assert_bitwise_equal(first, load_file(str(out / "hf" / "adapter_model.safetensors")))
