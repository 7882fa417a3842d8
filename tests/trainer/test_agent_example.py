"""examples/agent-calculator-*-smollm2-cpu.yaml hold together: the data files are what
their generator writes, the warm start's episodes open with the very instructions and
prompt the GRPO example's rollouts give the model (its spec.grpo.agent.instructions) (so SFT teaches the format GRPO samples
in), and the GRPO example restores the warm start's adapter with its rank, alpha and
targets. Nothing here runs a model (the runs are in docs/user-guide.md)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from posttrain.checks import load_job
from posttrain.trainer import tool_calls
from posttrain.trainer.tools import Toolbox

ROOT = Path(__file__).resolve().parents[2]
DATA = ROOT / "examples" / "data"
GRPO = ROOT / "examples" / "agent-calculator-smollm2-cpu.yaml"
SFT = ROOT / "examples" / "agent-calculator-sft-smollm2-cpu.yaml"


def test_the_data_is_what_its_generator_writes():
    proc = subprocess.run(
        [sys.executable, str(DATA / "make_agent_calculator.py"), "--check"],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_warm_start_episodes_open_as_the_grpo_rollouts_do():
    grpo = load_job(GRPO).spec
    sft = load_job(SFT).spec
    assert Path(ROOT / sft.data.source).name == "agent-calculator-sft.jsonl"
    box = Toolbox(grpo.grpo.agent, environ={})
    instructions = grpo.grpo.agent.instructions  # the example's own, short text
    assert instructions and instructions.startswith("Call the calculator as <tool_call>")
    (shown,) = tool_calls.FORMATS["chatml"].parse(instructions)  # its call reads and runs
    assert shown.error is None and shown.name == "calculator" and box.run(shown) == "6"
    prompts = [json.loads(line) for line in (ROOT / grpo.data.source).open()]
    episodes = [json.loads(line)["messages"] for line in (ROOT / sft.data.source).open()]
    system = prompts[0]["prompt"][0]
    for messages in episodes:
        assert messages[0] == {"role": "system", "content": instructions}
        assert messages[1] == system and messages[2]["role"] == "user"
        roles = [m["role"] for m in messages[3:]]
        assert roles == ["assistant", "user"] * 2 + ["assistant"]
        for turn in (3, 5):  # each call reads, runs, and gives the next turn's result
            (call,) = tool_calls.FORMATS["chatml"].parse(messages[turn]["content"])
            assert call.error is None
            assert (
                messages[turn + 1]["content"]
                == f"<tool_response>\n{box.run(call)}\n</tool_response>"
            )
        assert messages[-1]["content"] == f"Answer: {messages[-2]['content'].split()[1]}"
    assert box.errors == 0
    # The GRPO prompts are other problems than the warm start's.
    questions = {m[2]["content"] for m in episodes}
    assert not questions & {p["prompt"][1]["content"] for p in prompts}


def test_grpo_restores_the_warm_starts_adapter():
    grpo = load_job(GRPO).spec
    sft = load_job(SFT).spec
    adapter = ROOT / grpo.lora.restore_from
    config = json.loads((adapter / "adapter_config.json").read_text())
    assert (adapter / "adapter_model.safetensors").is_file()
    assert config["r"] == grpo.lora.rank == sft.lora.rank
    assert config["lora_alpha"] == grpo.lora.alpha == sft.lora.alpha
    assert grpo.lora.target_modules == sft.lora.target_modules
    assert sorted(config["target_modules"]) == ["k_proj", "o_proj", "q_proj", "v_proj"]
