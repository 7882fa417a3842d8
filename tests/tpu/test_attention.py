"""Splash attention on the chip against Tunix's dense attention (the same checks as
tests/trainer/test_attention.py, there in Pallas's interpret mode): every family's tiny
checkpoint over packed rows, float32 logits and a bf16 loss at 8k tokens."""

from __future__ import annotations

import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from posttrain.trainer import models, sft
from posttrain.trainer.models import attention

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "trainer"))
from data_helpers import packed_batch  # noqa: E402
from hf_fixtures import FIXTURES  # noqa: E402

pytestmark = pytest.mark.skipif(jax.default_backend() != "tpu", reason="needs a TPU")


@pytest.mark.parametrize("fixture", ["llama3", "qwen2", "qwen3", "gemma2", "gemma3", "gemma3-mha"])
def test_splash_matches_each_example_alone(fixture: str) -> None:
    """float32, highest matmul precision: the splash kernel over packed rows gives each
    real token its example's dense logits (run alone)."""
    with jax.default_matmul_precision("highest"):
        model, info = models.load_model(FIXTURES / fixture, dtype=jnp.float32, attention="splash")
        assert attention.kernel_of(model) == "splash"
        batch = packed_batch(info.vocab_size, ((200, 150, 100, 62), (400,)), 512)
        got, _ = nnx.jit(lambda m, b: m(b["input_ids"], b["positions"], None, b["segment_ids"]))(
            model, batch
        )
        got = np.asarray(got)
        seg = np.asarray(batch["segment_ids"])
        for r in range(seg.shape[0]):
            for s in set(seg[r].tolist()) - {0}:
                where = np.flatnonzero(seg[r] == s)
                ids = np.asarray(batch["input_ids"])[r, where][None]
                want = np.asarray(models.forward(model, ids))[0]
                np.testing.assert_allclose(got[r, where], want, rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize("fixture", ["qwen3", "gemma3"])
def test_bf16_loss_and_gradients_at_8k(fixture: str) -> None:
    """bf16 at 8192 tokens: the splash step's loss within 1e-2 (relative) of the dense
    step's, and its gradients' global norm within 2e-2."""
    batch = packed_batch(64, ((3000, 2500, 2000, 600), (8000,)), 8192)  # every fixture's vocab

    def loss(model, batch):
        total, count = sft.token_nll(model, batch)
        return total / count

    results = {}
    for kernel in ("dense", "splash"):
        model, _ = models.load_model(
            FIXTURES / fixture, dtype=jnp.bfloat16, attention=kernel, remat="layer"
        )
        value, grads = nnx.jit(nnx.value_and_grad(loss))(model, batch)
        norm = float(jnp.sqrt(sum(jnp.sum(g.astype(jnp.float32) ** 2)
                                  for g in jax.tree.leaves(grads))))  # fmt: skip
        results[kernel] = (float(value), norm)
    (l_dense, n_dense), (l_flash, n_flash) = results["dense"], results["splash"]
    assert abs(l_flash - l_dense) <= 1e-2 * abs(l_dense), results
    assert abs(n_flash - n_dense) <= 2e-2 * n_dense, results


@pytest.mark.parametrize("fixture", ["llama3", "qwen3"])
def test_decode_over_the_filled_cache_gives_dense_tokens(fixture: str) -> None:
    """float32, highest: a decode step with splash installed reads the cache's filled
    slots (attention.decode_attend, in its static lengths, a conditional on the chip) and
    gives Tunix's dense decode's greedy tokens across the 128-slot boundary."""
    with jax.default_matmul_precision("highest"):
        tokens = {}
        for kernel in ("dense", "splash"):
            model, info = models.load_model(FIXTURES / fixture, dtype=jnp.float32, attention=kernel)
            prompt = np.asarray(packed_batch(info.vocab_size, ((120,),), 128)["input_ids"])
            tokens[kernel] = models.greedy_generate(model, None, prompt[0, :120].tolist(), 20)
        assert tokens["splash"].token_ids == tokens["dense"].token_ids
        assert len(tokens["dense"].token_ids) == 20
