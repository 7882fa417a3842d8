"""A GRPO batch whose every advantage is zero teaches nothing: without a KL term the
policy loss and its gradient are zero, and ``grpo_step.make_zero_advantage_step`` updates the
weights and optimizer state exactly as the full train step does (the optimizer's moments
and weight decay still move them), without the forward and backward passes."""

from __future__ import annotations

import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from hf_fixtures import fixture_loader

from posttrain.api.spec import TrainingSpec
from posttrain.trainer import grpo_step, optim, rl_losses
from posttrain.trainer import lora as lora_lib

pytestmark = pytest.mark.trainer

ROWS, P, K, PAD, EOS, VOCAB = 4, 6, 5, 0, 1, 128  # the fixtures' vocabulary: 128


def batch(advantages: list[float]) -> dict[str, jax.Array]:
    rng = np.random.default_rng(0)
    prompt = rng.integers(3, VOCAB, (ROWS, P)).astype(np.int32)
    completion = rng.integers(3, VOCAB, (ROWS, K)).astype(np.int32)
    completion[1, 3], completion[1, 4:] = EOS, PAD
    return {
        "prompt_ids": jnp.asarray(prompt),
        "completion_ids": jnp.asarray(completion),
        "completion_mask": jnp.asarray((completion != PAD).astype(np.int32)),
        "advantages": jnp.asarray(advantages, jnp.float32),
        "rewards": jnp.asarray(rng.random((ROWS, 1)), jnp.float32),
    }


@pytest.mark.parametrize("lora,accumulation", [(True, 1), (False, 2)])
def test_the_zero_advantage_update_is_the_train_steps(lora, accumulation):
    from tunix.rl.grpo import grpo_learner

    g = types.SimpleNamespace(loss_algorithm="grpo", num_generations=ROWS, beta=0.0,
                              epsilon=0.2, epsilon_high=None)  # fmt: skip
    config = rl_losses.algo_config(g, grpo_learner.GRPOConfig)
    config.temperature = 1.0
    training = TrainingSpec(steps=10, batch_size=ROWS, learning_rate=1e-2, warmup_steps=1,
                            weight_decay=0.1, max_grad_norm=1.0)  # fmt: skip
    model, _ = fixture_loader()("llama3")
    wrt: nnx.filterlib.Filter = nnx.Param
    if lora:
        model, wrt = lora_lib.apply_lora(model, 4, 8.0), nnx.LoRAParam
    opt = nnx.Optimizer(model, optim.optimizer(training), wrt=wrt)
    train = grpo_step.make_train_step(wrt, config, PAD, EOS, accumulation, "none")
    train(model, opt, None, batch([1.0, -1.0, 0.5, -0.5]))  # moments that are not zero

    before = leaves(model, wrt)
    # A copy with buffers of its own: each step donates what it replaces.
    graphdef, state = nnx.split((model, opt))
    full_model, full_opt = nnx.merge(graphdef, jax.tree.map(jnp.array, state))
    full = train(full_model, full_opt, None, batch([0.0] * ROWS))
    skip = grpo_step.make_zero_advantage_step(wrt)(model, opt, None, batch([0.0] * ROWS))

    # The premise: a zero advantage leaves no loss and no gradient.
    assert float(full["loss"]) == 0.0 and float(full["grad_norm"]) == 0.0
    assert set(full) - set(skip) == {"entropy", "clip_fraction", "kl"}
    for key in skip:
        np.testing.assert_array_equal(np.asarray(skip[key]), np.asarray(full[key]), key)
    after = leaves(model, wrt)
    assert any(not np.array_equal(a, b) for a, b in zip(after, before, strict=True))
    for got, want in zip(after, leaves(full_model, wrt), strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-9)
    got_opt, want_opt = leaves(opt), leaves(full_opt)
    assert len(got_opt) == len(want_opt) > 0
    for got, want in zip(got_opt, want_opt, strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-9)


def leaves(node: nnx.Module | nnx.Optimizer, *filters) -> list[np.ndarray]:
    return [np.asarray(x) for x in jax.tree.leaves(nnx.to_pure_dict(nnx.state(node, *filters)))]
