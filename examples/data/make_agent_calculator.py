"""Writes the data of the agent calculator examples (two-step arithmetic, a * b + c, that
takes two calculator calls). Seeded, so every run writes the same bytes:

    .venv/bin/python examples/data/make_agent_calculator.py          # write both files
    .venv/bin/python examples/data/make_agent_calculator.py --check  # verify them

- agent-calculator.jsonl (GRPO, examples/agent-calculator-smollm2-cpu.yaml): a prompt (a
  short system turn and the question) and the answer. The numbers are two-digit, so the
  answer has three or four digits: SmolLM2-135M does not get it right without the tool.
- agent-calculator-sft.jsonl (the warm start, examples/agent-calculator-sft-smollm2-cpu.yaml):
  whole episodes as GRPO renders them: the tool's instructions (the system turn posttrain
  puts first), the prompt, the two calls in chatml's <tool_call> format, the tool's
  answers as <tool_response> user turns, and "Answer: N". Other numbers than the GRPO
  prompts'.
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

HERE = Path(__file__).parent
GRPO, SFT = HERE / "agent-calculator.jsonl", HERE / "agent-calculator-sft.jsonl"
SYSTEM = "Solve it with the calculator, one step per call, then write Answer: N."
# What the model is told about its tool: examples/agent-calculator-smollm2-cpu.yaml's
# spec.grpo.agent.instructions, which posttrain puts first as a system turn (the standard
# chatml text with the calculator's JSON schema takes 243 tokens; this one 40).
INSTRUCTIONS = (
    'Call the calculator as <tool_call>{"name": "calculator", "arguments": {"a": 2, "b": 3, '
    '"op": "*"}}</tool_call> with op one of + - * /.'
)


def call(a: int, b: int, op: str) -> str:
    args = json.dumps({"name": "calculator", "arguments": {"a": a, "b": b, "op": op}})
    return f"<tool_call>\n{args}\n</tool_call>"


def result(value: int) -> str:
    return f"<tool_response>\n{value}\n</tool_response>"


def prompt(a: int, b: int, c: int) -> list[dict[str, str]]:
    return [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": f"What is {a} * {b} + {c}?"},
    ]


def grpo_rows(rng: random.Random, n: int) -> list[str]:
    out = []
    for _ in range(n):
        a, b, c = rng.randint(11, 99), rng.randint(11, 99), rng.randint(11, 99)
        out.append(json.dumps({"prompt": prompt(a, b, c), "answer": str(a * b + c)}))
    return out


def sft_rows(rng: random.Random, n: int) -> list[str]:
    out = []
    for _ in range(n):
        a, b, c = rng.randint(11, 99), rng.randint(11, 99), rng.randint(11, 99)
        messages = [{"role": "system", "content": INSTRUCTIONS}, *prompt(a, b, c)]
        messages += [
            {"role": "assistant", "content": call(a, b, "*")},
            {"role": "user", "content": result(a * b)},
            {"role": "assistant", "content": call(a * b, c, "+")},
            {"role": "user", "content": result(a * b + c)},
            {"role": "assistant", "content": f"Answer: {a * b + c}"},
        ]
        out.append(json.dumps({"messages": messages}))
    return out


def files() -> dict[Path, str]:
    return {
        GRPO: "\n".join(grpo_rows(random.Random(35), 400)) + "\n",
        SFT: "\n".join(sft_rows(random.Random(36), 200)) + "\n",
    }


def main() -> int:
    bad = 0
    for path, text in files().items():
        if "--check" in sys.argv[1:]:
            same = path.exists() and path.read_text() == text
            bad += not same
            print(f"{path.name}: {'as generated' if same else 'differs from the generator'}")
        else:
            path.write_text(text)
            print(f"wrote {path}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
