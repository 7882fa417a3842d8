"""What a new user meets first: the README's quickstart, what `make demo` prints at its
end, and a quiet install."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).parent.parent.parent
DEMO = (ROOT / "scripts" / "demo.sh").read_text()


def _sh_lines(markdown: str) -> list[str]:
    blocks = re.findall(r"```sh\n(.*?)```", markdown, re.S)
    return [line.strip() for block in blocks for line in block.splitlines()]


def test_readme_puts_posttrain_on_path_before_its_first_use():
    lines = _sh_lines((ROOT / "README.md").read_text())
    demo = lines.index(next(line for line in lines if line.startswith("make demo")))
    first_use = next(i for i, line in enumerate(lines) if line.startswith("posttrain "))
    activate = next(i for i, line in enumerate(lines) if ".venv/bin/activate" in line)
    assert demo < activate < first_use


def test_quickstart_does_not_ask_for_go():
    readme = (ROOT / "README.md").read_text()
    quickstart = readme[readme.index("## Quickstart") : readme.index("make demo")]
    assert "Go" not in quickstart


def test_demo_ends_with_what_to_do_next():
    ending = DEMO[DEMO.rindex("\nPY\n") :]
    assert ". .venv/bin/activate" in ending
    assert "posttrain generate examples/sft-lora-smollm2-cpu.yaml" in ending
    assert "docs/user-guide.md" in ending


def _demo_summary(tmp_path, samples: list[tuple[int, str]]) -> str:
    """What the demo prints after a run whose last evaluation generated `samples`
    ((row of the dataset, completion))."""
    script = DEMO[DEMO.index("python - <<'PY'\n") + len("python - <<'PY'\n") : DEMO.index("\nPY\n")]
    rows = (ROOT / "examples" / "data" / "chat-sft.jsonl").read_text().splitlines()

    def prompt(i: int) -> str:
        question = json.loads(rows[i])["messages"][-2]["content"]
        return (
            "<|im_start|>system\nYou are a helpful AI assistant named SmolLM<|im_end|>\n"
            f"<|im_start|>user\n{question}<|im_end|>\n<|im_start|>assistant\n"
        )

    history = [
        {"step": 0, "metrics": {"loss": 3.0, "perplexity": 20.0}},
        {"step": 24, "metrics": {"loss": 1.5, "perplexity": 4.5},
         "samples": [{"prompt": prompt(i), "completion": c} for i, c in samples]},
    ]  # fmt: skip
    run = tmp_path / "runs" / "sft-lora-smollm2"
    run.mkdir(parents=True)
    (run / "eval.json").write_text(json.dumps(history))
    (tmp_path / "examples" / "data").mkdir(parents=True)
    (tmp_path / "examples" / "data" / "chat-sft.jsonl").write_text("\n".join(rows) + "\n")
    out = subprocess.run(
        [sys.executable, "-c", script], cwd=tmp_path, capture_output=True, text=True, check=True
    ).stdout
    assert "held-out loss 3.000 (step 0) -> 1.500 (step 24)" in out
    assert "system" not in out and "<|im_start|>" not in out
    return out


def test_demo_shows_held_out_questions_the_model_answers_right(tmp_path):
    """The demo's showcase: how many held-out questions the trained model answers right,
    and those it does (the question alone, not the chat template's system prompt); a
    wrong answer is never shown as the showcase."""
    rows = (ROOT / "examples" / "data" / "chat-sft.jsonl").read_text().splitlines()
    question = [json.loads(r)["messages"][-2]["content"] for r in rows]
    # rows 3 and 4: "11 * 4 = ?" -> "Answer: 44.", "Which colour is chocolate?" -> "Answer: brown."
    out = _demo_summary(tmp_path, [(3, " Answer: 45."), (4, " answer: Brown")])
    assert "held-out questions the trained model answers right (greedy, step 24): 1 of 2\n" in out
    assert f"  {question[4]}  ->  answer: Brown\n" in out
    assert "45" not in out and question[3] not in out


def test_demo_says_so_when_no_answer_is_right(tmp_path):
    out = _demo_summary(tmp_path, [(3, " Answer: 45.")])
    assert "answers right (greedy, step 24): 0 of 1\n" in out
    assert "->  Answer: 45.  (the dataset's answer: Answer: 44.)" in out


def test_install_prints_no_deprecation_boxes():
    """setuptools (>= 77) warns, in a box of some 18 lines at each build step, about a
    `project.license` table: it is an SPDX string."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert isinstance(project["project"]["license"], str)
    assert project["build-system"]["requires"] == ["setuptools>=77"]
