"""Distillation on CPU: a tiny random Llama student learns from a differently seeded
tiny teacher with sharp logits. The loss against hand-computed values, the student's KL
to the teacher falling, exact resume of a full fine-tune, and a teacher with another
vocabulary refused."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest
import yaml
from safetensors.numpy import load_file, save_file
from tb_events import scalars
from tiny_job import assert_bitwise_equal, run_job, tiny_job
from tiny_model import make_tiny_llama

from posttrain.trainer import distill, models

pytestmark = pytest.mark.trainer
ROOT = Path(__file__).resolve().parents[2]
DATA = ROOT / "examples" / "data" / "chat-sft.jsonl"


@pytest.fixture(scope="module")
def models_dir(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("models")
    make_tiny_llama(root / "student")
    teacher = make_tiny_llama(root / "teacher", seed=1)
    # Sharper logits than a random init gives (softmax near uniform): something to learn.
    tensors = load_file(str(teacher / "model.safetensors"))
    tensors["lm_head.weight"] = tensors["lm_head.weight"] * 20
    save_file(tensors, str(teacher / "model.safetensors"), metadata={"format": "pt"})
    return root


def job_doc(root: Path, out: Path, *, steps=16, every=8, teacher="teacher", lora=False):
    return tiny_job(
        root / "student",
        DATA,
        out,
        name="tiny-distill",
        steps=steps,
        every=every,
        keep=2,
        lora=lora,
        training={"schedule": "constant", "logEverySteps": 1, "gradientAccumulation": 2},
        technique="distill",
        distill={
            "teacher": {"source": str(root / teacher), "dtype": "float32"},
            "temperature": 2.0,
            "alpha": 0.5,
        },
    )


def test_loss_matches_hand_computed_values():
    student = jnp.array([[[1.0, 0.0, -1.0], [0.5, 0.5, 0.0]]])
    teacher = jnp.array([[[3.0, 0.0, 0.0], [0.0, 0.0, 2.0]]])
    targets = jnp.array([[0, 2]])
    mask = jnp.array([[1, 0]])  # only the first token is a target
    t = 2.0

    def log_softmax(x):
        x = np.asarray(x, np.float64)
        return x - np.log(np.exp(x).sum(-1, keepdims=True))

    p, q = log_softmax(teacher[0, 0] / t), log_softmax(student[0, 0] / t)
    kl = float(np.sum(np.exp(p) * (p - q)))
    nll = float(-log_softmax(student[0, 0])[0])
    loss, sums = distill.distill_loss(student, teacher, targets, mask, t, alpha=0.25)
    assert float(sums["count"]) == 1.0
    np.testing.assert_allclose(float(sums["kl"]), kl, rtol=1e-5)
    np.testing.assert_allclose(float(sums["nll"]), nll, rtol=1e-5)
    np.testing.assert_allclose(float(loss), 0.25 * t**2 * kl + 0.75 * nll, rtol=1e-5)
    # alpha 1: pure distillation; alpha 0: pure hard-label NLL
    assert float(distill.distill_loss(student, teacher, targets, mask, t, 1.0)[0]) == (
        pytest.approx(t**2 * kl, rel=1e-5)
    )
    assert float(distill.distill_loss(student, teacher, targets, mask, t, 0.0)[0]) == (
        pytest.approx(nll, rel=1e-5)
    )


def test_student_kl_to_teacher_falls_and_resumes_exactly(models_dir, tmp_path):
    out = tmp_path / "out"
    result = run_job(job_doc(models_dir, out))
    assert result.step == 16
    tb = scalars(out / "tensorboard")
    kl = [tb["train/kl"][s] for s in sorted(tb["train/kl"])]
    print(
        f"\ndistill (full, 16 steps): KL(teacher || student) at T=2 {kl[0]:.3f} -> "
        f"{np.mean(kl[-3:]):.3f} (step 1 -> mean of the last 3 steps)"
    )
    assert np.mean(kl[-3:]) < 0.6 * kl[0]
    assert {"train/loss", "train/nll", "train/teacher_nll", "train/grad_norm"} <= tb.keys()
    first = load_file(str(out / "hf" / "model.safetensors"))

    shutil.rmtree(out / "checkpoints" / "16")
    shutil.rmtree(out / "hf")
    again = run_job(job_doc(models_dir, out))
    assert again.resumed_from == 8 and again.step == 16
    resumed = load_file(str(out / "hf" / "model.safetensors"))
    assert_bitwise_equal(first, resumed)


def test_teacher_with_another_vocabulary_is_refused(models_dir, tmp_path):
    make_tiny_llama(models_dir / "other", vocab=300)
    with pytest.raises(ValueError, match=r"spec.distill.teacher: .*300 tokens.*400"):
        run_job(job_doc(models_dir, tmp_path / "out", teacher="other"))


def test_held_out_loss_is_reported_and_falls(models_dir, tmp_path):
    doc = job_doc(models_dir, tmp_path / "out", steps=16)
    doc["spec"]["eval"] = {"fraction": 0.1, "everySteps": 8, "samples": 0}
    result = run_job(doc)
    losses = [result.evals[s]["loss"] for s in (8, 16)]
    assert losses[1] < losses[0], losses


def test_the_example_distils_into_the_teachers_first_layers(tmp_path):
    """examples/distill-smollm2-cpu.yaml as written, with a tiny 3-layer Llama standing in
    for the converted SmolLM2: the student is its first layer, trained against all three,
    and the export is a 1-layer model that loads back. Nothing is fetched."""
    doc = yaml.safe_load((ROOT / "examples" / "distill-smollm2-cpu.yaml").read_text())
    spec = doc["spec"]
    assert spec["model"]["source"] == spec["distill"]["teacher"]["source"]
    assert all("://" not in s for s in (spec["model"]["source"], spec["data"]["source"]))
    tiny = str(make_tiny_llama(tmp_path / "llama", layers=3))
    spec["model"]["source"] = spec["distill"]["teacher"]["source"] = tiny
    spec["model"]["layers"] = 1
    spec["data"]["source"] = str(ROOT / spec["data"]["source"])
    spec["training"].update(steps=2, warmupSteps=1, logEverySteps=1)
    spec["output"]["uri"] = str(tmp_path / "out")
    result = run_job(doc)
    assert result.step == 2
    exported = tmp_path / "out" / "hf"
    assert json.loads((exported / "config.json").read_text())["num_hidden_layers"] == 1
    student, info = models.load_model(exported)
    assert info.num_layers == 1
    assert scalars(tmp_path / "out" / "tensorboard")["train/kl"]


def test_more_layers_than_the_source_names_the_field(tmp_path):
    with pytest.raises(ValueError, match=r"^spec.model.layers: 5, but .* has 2 decoder layers"):
        models.load_model(make_tiny_llama(tmp_path / "llama"), num_layers=5)
