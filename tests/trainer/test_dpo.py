"""DPO and ORPO on CPU with a tiny random Llama and the synthetic preference set: the
losses against hand-computed values, preference accuracy and reward margin rising, exact
resume, a frozen-copy reference for full fine-tunes, and ORPO without a reference."""

from __future__ import annotations

import shutil
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import load_file
from tb_events import scalars
from tiny_job import assert_bitwise_equal, run_job, tiny_job

from posttrain.trainer import dpo

pytestmark = pytest.mark.trainer
ROOT = Path(__file__).resolve().parents[2]
DATA = ROOT / "examples" / "data" / "preferences-dpo.jsonl"


@pytest.fixture(scope="module")
def pairs(tmp_path_factory) -> Path:
    """The first 32 pairs of the synthetic preference set: 24 steps of 8 see each 6 times."""
    path = tmp_path_factory.mktemp("data") / "pairs.jsonl"
    path.write_text("".join(DATA.read_text().splitlines(keepends=True)[:32]))
    return path


def job_doc(
    model_dir: Path, out: Path, data: Path, *, steps=24, lora=True, algorithm="dpo", every=8
):
    return tiny_job(
        model_dir,
        data,
        out,
        name="tiny-dpo",
        steps=steps,
        every=every,
        lora=lora,
        training={"schedule": "constant", "logEverySteps": 1, "seed": 3},
        technique="dpo",
        dpo={"algorithm": algorithm, "beta": 0.1},
    )


def series(out: Path, name: str) -> list[float]:
    values = scalars(out / "tensorboard")[f"train/{name}"]
    return [values[s] for s in sorted(values)]


def test_losses_match_hand_computed_values():
    pc, pr = jnp.array([-10.0, -20.0]), jnp.array([-30.0, -15.0])
    rc, rr = jnp.array([-12.0, -18.0]), jnp.array([-25.0, -16.0])
    loss, chosen, rejected = dpo.dpo_loss(pc, pr, rc, rr, beta=0.5)
    # margins: 0.5 * ((-10 + 12) - (-30 + 25)) = 3.5 and 0.5 * ((-20 + 18) - (-15 + 16)) = -1.5
    expected = np.log1p(np.exp(-np.array([3.5, -1.5])))
    np.testing.assert_allclose(loss, expected, rtol=1e-6)
    np.testing.assert_allclose(chosen - rejected, [3.5, -1.5], rtol=1e-6)

    mc, mr = jnp.array([-0.5]), jnp.array([-2.0])
    odds, rc_, rr_, log_odds = dpo.orpo_loss(mc, mr, beta=0.2)
    lo = (-0.5 - -2.0) - (np.log(1 - np.exp(-0.5)) - np.log(1 - np.exp(-2.0)))
    np.testing.assert_allclose(log_odds, [lo], rtol=1e-6)
    np.testing.assert_allclose(odds, [0.2 * np.log1p(np.exp(-lo))], rtol=1e-6)
    np.testing.assert_allclose([rc_[0], rr_[0]], [-0.1, -0.4], rtol=1e-6)
    # odds stay finite for log-probs at 0 (probability 1)
    assert np.isfinite(dpo.orpo_loss(jnp.array([0.0]), jnp.array([-1.0]), 0.1)[0]).all()


def test_lora_dpo_raises_accuracy_and_margin_and_resumes_exactly(model_dir, pairs, tmp_path):
    out = tmp_path / "out"
    result = run_job(job_doc(model_dir, out, pairs))
    assert result.step == 24 and result.export_dir == str(out / "hf")
    accuracy, margin = series(out, "preference_accuracy"), series(out, "reward_margin")
    print(
        f"\nDPO (LoRA, 24 steps): preference accuracy {accuracy[0]:.3f} -> "
        f"{np.mean(accuracy[-6:]):.3f}, reward margin {margin[0]:.3f} -> "
        f"{np.mean(margin[-6:]):.3f} (step 1 -> mean of the last 6 steps)"
    )
    # Step 1 is measured before any update: the policy is the reference, so every reward
    # is 0 up to rounding (and the accuracy of those ties is a coin toss).
    assert margin[0] == pytest.approx(0.0, abs=1e-4)
    assert np.mean(accuracy[-6:]) >= 0.85 and np.mean(accuracy[-6:]) > accuracy[0] + 0.2
    assert np.mean(margin[-6:]) > 1.0
    assert set(scalars(out / "tensorboard")) >= {
        "train/loss",
        "train/reward_chosen",
        "train/reward_rejected",
        "train/grad_norm",
        "train/tokens_per_second",
    }
    first = load_file(str(out / "hf" / "adapter_model.safetensors"))

    # As if the run had died after step 16: the resumed run ends bitwise where it ended.
    shutil.rmtree(out / "checkpoints" / "24")
    shutil.rmtree(out / "hf")
    again = run_job(job_doc(model_dir, out, pairs))
    assert again.resumed_from == 16 and again.step == 24
    resumed = load_file(str(out / "hf" / "adapter_model.safetensors"))
    assert_bitwise_equal(first, resumed)


def test_full_dpo_with_accumulation_uses_a_frozen_reference_and_exports_merged(
    model_dir, pairs, tmp_path
):
    out = tmp_path / "out"
    doc = job_doc(model_dir, out, pairs, steps=4, lora=False, every=4)
    doc["spec"]["training"]["gradientAccumulation"] = 2
    result = run_job(doc)
    assert (out / "hf" / "model.safetensors").exists() and result.step == 4
    margin = series(out, "reward_margin")
    assert margin[0] == pytest.approx(0.0, abs=1e-5)  # the frozen copy equals the policy
    assert margin[-1] > margin[0]


def test_orpo_is_reference_free_and_learns_the_chosen(model_dir, pairs, tmp_path):
    out = tmp_path / "out"
    run_job(job_doc(model_dir, out, pairs, steps=10, algorithm="orpo", every=10))
    nll, log_odds = series(out, "nll"), series(out, "log_odds_ratio")
    assert np.isfinite(nll).all() and np.isfinite(log_odds).all()
    assert np.mean(nll[-3:]) < nll[0]  # the SFT term fits the chosen answers
    assert set(scalars(out / "tensorboard")) >= {
        "train/preference_accuracy",
        "train/reward_margin",
    }


def test_held_out_preference_accuracy_rises(model_dir, pairs, tmp_path):
    held_out = tmp_path / "held-out.jsonl"
    held_out.write_text("".join(DATA.read_text().splitlines(keepends=True)[100:132]))
    doc = job_doc(model_dir, tmp_path / "out", pairs)
    doc["spec"]["eval"] = {"source": str(held_out), "everySteps": 4, "samples": 0}
    result = run_job(doc)
    accuracy = [result.evals[s]["preference_accuracy"] for s in sorted(result.evals)]
    margin = [result.evals[s]["reward_margin"] for s in sorted(result.evals)]
    assert sorted(result.evals) == [0, 4, 8, 12, 16, 20, 24]
    # Before training the policy is its reference (the adapters are zero): no preference.
    assert accuracy[0] == 0.0 and margin[0] == 0.0
    # Pairs it never trained on: the preference generalises (0.75 at step 4 and at the
    # end in the streamed order of the data) and the margin keeps growing.
    assert accuracy[-1] >= accuracy[1] > 0.5, accuracy
    assert margin[-1] > margin[1] > margin[0], margin
