"""Evidence that multimodal SFT learns: examples/sft-lora-gemma3-vision-cpu.yaml (LoRA on
a tiny random Gemma 3 vision model, examples/data/shapes/) run by the trainer raises
answer accuracy on the held-out pictures from chance to well above it.

Accuracy: for each held-out question the model scores the three possible answers (the
summed log-likelihood of the answer's tokens, the picture in the prompt) and picks the
best; chance is 1/3.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import numpy as np
import pytest
import yaml
from tiny_job import run_job

pytestmark = pytest.mark.trainer

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "sft-lora-gemma3-vision-cpu.yaml"
SHAPES = ROOT / "examples" / "data" / "shapes"
ANSWERS = (("red", "green", "blue"), ("circle", "square", "triangle"))


def _candidates(tmp: Path) -> tuple[Path, np.ndarray]:
    """Every held-out question with each of its three answers (one row each), and the
    index of the right one."""
    rows, truth = [], []
    for line in (SHAPES / "heldout.jsonl").read_text().splitlines():
        row = json.loads(line)
        answer = row["messages"][1]["content"][0]["text"]
        options = next(o for o in ANSWERS if answer in o)
        truth.append(options.index(answer))
        for option in options:
            alt = copy.deepcopy(row)
            alt["messages"][1]["content"][0]["text"] = option
            alt["images"] = [str(SHAPES / p) for p in row["images"]]
            rows.append(alt)
    path = tmp / "candidates.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path, np.asarray(truth)


def _accuracy(model, job, candidates: Path, truth: np.ndarray) -> float:
    import jax.numpy as jnp
    from flax import nnx

    from posttrain.trainer import data, sft

    spec = job.spec.model_copy(deep=True)
    spec.data.source = str(candidates)
    tokenizer = data.load_tokenizer(spec.model.source)
    rows = data.build_rows(spec, tokenizer)
    assert len(rows) == 3 * len(truth)
    nll = nnx.jit(sft.token_nll)
    scores = []
    for i in range(len(rows)):
        batch = {k: jnp.asarray(v) for k, v in rows.batch(np.array([i])).items()}
        scores.append(-float(nll(model, batch)[0]))
    picked = np.asarray(scores).reshape(-1, 3).argmax(axis=1)
    return float(np.mean(picked == truth))


def test_example_raises_held_out_answer_accuracy(tmp_path, monkeypatch):
    import jax.numpy as jnp

    from posttrain.api.spec import PostTrainJob
    from posttrain.trainer import lora, models, peft_format

    monkeypatch.chdir(ROOT)  # the example's paths are relative to the repository
    doc = yaml.safe_load(EXAMPLE.read_text())
    doc["spec"]["output"]["uri"] = str(tmp_path / "out")
    job = PostTrainJob.model_validate(doc)
    candidates, truth = _candidates(tmp_path)

    base, info = models.load_model(job.spec.model.source, dtype=jnp.float32, vision=True)
    before = _accuracy(base, job, candidates, truth)

    result = run_job(doc)
    assert result.step == job.spec.training.steps
    tuned = lora.apply_lora(base, job.spec.lora.rank, job.spec.lora.alpha)
    peft_format.load_peft_adapter(tuned, tmp_path / "out" / "hf", info)
    after = _accuracy(tuned, job, candidates, truth)
    print(f"held-out answer accuracy: {before:.2f} -> {after:.2f} (chance 0.33)")
    assert before < 0.45 and after >= 0.6, (before, after)
