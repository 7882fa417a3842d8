"""Gradient accumulation as a scan (optim.accumulate): every technique's train step with
spec.training.gradientAccumulation 2 gives what the same step gave with the micro-batch
loop unrolled in Python (the sums taken in the same order), on a tiny random Llama on
CPU: the loss, every metric and every updated parameter equal to a few float32 ulps (not
bitwise: the two are different programs, and XLA may fuse the gradient norm's reduction
differently for them; on some CPUs it comes out one ulp apart); and to float tolerance
what the step gave before micro-batches interleaved rows (optim.micro_batches).
test_capacity_xla.py shows what the scan is for: the step's memory no longer grows with
the accumulation."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from posttrain.api.spec import DpoSpec
from posttrain.trainer import distill, dpo, grpo_step, models, optim, sft

pytestmark = pytest.mark.trainer
ROWS, LENGTH, VOCAB = 4, 16, 400


def unrolled(grad_fn, batch, accumulation, *args):
    """The micro-batch loop as the step had it before the scan: unrolled in Python (over
    the same micro-batches)."""
    micro = optim.micro_batches(batch, accumulation)
    total, aux_sum, grads = jnp.zeros((), jnp.float32), None, None
    for i in range(accumulation):
        (loss, aux), g = grad_fn(*args, {k: v[i] for k, v in micro.items()})
        total = total + loss
        grads = g if grads is None else jax.tree.map(jnp.add, grads, g)
        aux_sum = aux if aux_sum is None else jax.tree.map(jnp.add, aux_sum, aux)
    return total, aux_sum, grads


def contiguous(batch, accumulation):
    """Micro-batch i as rows i x n / accumulation onwards: the split the step had before."""
    return {k: v.reshape(accumulation, -1, *v.shape[1:]) for k, v in batch.items()}


def ids(seed, shape):
    return jnp.asarray(np.random.default_rng(seed).integers(3, VOCAB, shape), jnp.int32)


def sft_batch():
    ones = jnp.ones((ROWS, LENGTH), jnp.int32)
    positions = jnp.broadcast_to(jnp.arange(LENGTH, dtype=jnp.int32), (ROWS, LENGTH))
    mask = ones.at[:, : LENGTH // 2].set(0)  # completion-only: differs per micro-batch
    mask = mask.at[0, LENGTH // 2 :].set(0).at[0, -1].set(1)
    return {"input_ids": ids(0, (ROWS, LENGTH)), "loss_mask": mask,
            "segment_ids": ones, "positions": positions}  # fmt: skip


def pair_batch():
    half, out = LENGTH // 2, {}
    for i, part in enumerate(("prompt", "chosen", "rejected")):
        out[f"{part}_ids"] = ids(i, (ROWS, half))
        out[f"{part}_mask"] = jnp.ones((ROWS, half), jnp.int32).at[1, : i + 1].set(0)
    return out


def grpo_batch():
    half = LENGTH // 2
    return {
        "prompt_ids": ids(1, (ROWS, half)),
        "completion_ids": ids(2, (ROWS, half)),
        "completion_mask": jnp.ones((ROWS, half), jnp.int32).at[2, 5:].set(0),
        "advantages": jnp.asarray([1.0, -0.5, 0.25, -0.75], jnp.float32),
        "rewards": jnp.ones((ROWS, 1), jnp.float32),
    }


def build(technique, model_dir):
    """(make_step, args after model and optimizer, batch) of a technique, full fine-tune."""
    frozen, _ = models.load_model(model_dir)
    if technique == "sft":
        return (lambda: sft.make_train_step(nnx.Param, 2)), (), sft_batch()
    if technique == "distill":
        step = lambda: distill.make_train_step(nnx.Param, 2.0, 0.5, 2)  # noqa: E731
        return step, (frozen,), sft_batch()
    if technique == "dpo":
        step = lambda: dpo.make_train_step(nnx.Param, DpoSpec(), 2, "model")  # noqa: E731
        return step, (frozen,), pair_batch()
    from tunix.rl.grpo import grpo_learner

    config = grpo_learner.GRPOConfig(num_generations=2, num_iterations=1, beta=0.04,
                                     epsilon=0.2, loss_algo="grpo", kl_loss_mode="low_var_kl")  # fmt: skip
    config.temperature = 0.9
    step = lambda: grpo_step.make_train_step(nnx.Param, config, 0, 2, 2, "model")  # noqa: E731
    return step, (frozen,), grpo_batch()


def one_step(model_dir, make_step, args, batch):
    model, _ = models.load_model(model_dir)
    opt = nnx.Optimizer(model, optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-3)),
                        wrt=nnx.Param)  # fmt: skip
    out = make_step()(model, opt, *args, batch)
    out = (
        out
        if isinstance(out, dict)
        else dict(zip(("loss", "grad_norm", "count", "seen"), out, strict=True))
    )
    return {k: np.asarray(v) for k, v in out.items()}, nnx.state(model, nnx.Param)


@pytest.mark.parametrize("technique", ["sft", "dpo", "distill", "grpo"])
def test_scanned_accumulation_matches_the_unrolled_loop(model_dir, monkeypatch, technique):
    make_step, args, batch = build(technique, model_dir)
    scanned, params = one_step(model_dir, make_step, args, batch)
    monkeypatch.setattr(optim, "accumulate", unrolled)
    loop, loop_params = one_step(model_dir, make_step, args, batch)
    assert scanned.keys() == loop.keys()
    for key in scanned:  # 1e-6: about 8 ulps of float32, 20x tighter than the check below
        np.testing.assert_allclose(scanned[key], loop[key], rtol=1e-6, atol=0, err_msg=key)
    assert np.isfinite(scanned["loss"]) and scanned["grad_norm"] > 0
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(loop_params), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-9)
    # Against the step as it was (contiguous micro-batches): the same losses to float
    # tolerance, every technique's loss being a global mean or a mean of equal parts.
    monkeypatch.setattr(optim, "micro_batches", contiguous)
    before, before_params = one_step(model_dir, make_step, args, batch)
    for key in scanned:
        np.testing.assert_allclose(scanned[key], before[key], rtol=2e-5, atol=1e-6, err_msg=key)
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(before_params), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-5)  # Adam: 1% of a step


def test_each_device_keeps_its_share_of_every_micro_batch():
    """Rows interleave: with 8 rows over 4 devices (2 each) and 2 micro-batches, every
    micro-batch takes one row of each device's pair."""
    micro = optim.micro_batches({"x": jnp.arange(8)}, 2)["x"]
    np.testing.assert_array_equal(micro, [[0, 2, 4, 6], [1, 3, 5, 7]])


@pytest.mark.parametrize("algorithm", ["grpo", "dapo", "dr-grpo"])
def test_grpo_losses_with_accumulation_match_one_batch(model_dir, algorithm):
    """Accumulation changes no GRPO loss: with accumulation 2 the loss, gradient norm and
    updated params are those of one batch, to float tolerance, though the micro-batches
    hold different numbers of completion tokens (13 and 16): DAPO's token mean is over
    the batch's tokens, not a mean of the micro-batches' token means."""
    from types import SimpleNamespace

    from tunix.rl.grpo import grpo_learner

    from posttrain.trainer import rl_losses

    g = SimpleNamespace(num_generations=2, beta=0.04, epsilon=0.2, epsilon_high=None,
                        loss_algorithm=algorithm)  # fmt: skip
    config = rl_losses.algo_config(g, grpo_learner.GRPOConfig)
    config.temperature = 0.9
    frozen, _ = models.load_model(model_dir)
    batch = grpo_batch()
    results = [
        one_step(
            model_dir,
            lambda k=k: grpo_step.make_train_step(nnx.Param, config, 0, 2, k, "model"),
            (frozen,),
            batch,
        )  # fmt: skip
        for k in (1, 2)
    ]
    (one, one_params), (two, two_params) = results
    for key in ("loss", "grad_norm", "tokens"):
        np.testing.assert_allclose(two[key], one[key], rtol=2e-5, atol=1e-7, err_msg=key)
    for a, b in zip(jax.tree.leaves(one_params), jax.tree.leaves(two_params), strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=5e-5)  # Adam: 5% of a step
