"""GRPO's learner projects onto the vocabulary only the positions its log-probs read
(``models.last_positions``, through ``grpo_step.completion_view``): the logits it keeps, the
per-token log-probs, the GRPO loss and its gradients are the full projection's for every
family (Gemma 2's final logit soft cap included, LoRA adapters included), and the train
step's program (policy loss, reference log-probs) and the behaviour log-probs' program hold
no [rows, positions, vocab] product over more than the completion's K + 1 positions."""

from __future__ import annotations

import re
import types

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from hf_fixtures import fixture_loader

from posttrain.trainer import grpo_step, models, rl_losses
from posttrain.trainer import lora as lora_lib

pytestmark = pytest.mark.trainer

ROWS, P, K, PAD, EOS, VOCAB = 3, 7, 5, 0, 1, 128  # the fixtures' vocabulary: 128


@pytest.fixture(scope="module")
def loaded():
    return fixture_loader()


def tokens() -> tuple[jax.Array, jax.Array, jax.Array]:
    """Left-padded prompts [ROWS, P], right-padded completions [ROWS, K] (one ends with EOS
    before K), their mask."""
    rng = np.random.default_rng(0)
    prompt = rng.integers(3, VOCAB, (ROWS, P)).astype(np.int32)
    prompt[0, :3] = PAD
    completion = rng.integers(3, VOCAB, (ROWS, K)).astype(np.int32)
    completion[1, 2], completion[1, 3:] = EOS, PAD
    mask = (completion != PAD).astype(np.int32)
    return jnp.asarray(prompt), jnp.asarray(completion), jnp.asarray(mask)


def algo_config(beta: float):
    from tunix.rl.grpo import grpo_learner

    g = types.SimpleNamespace(loss_algorithm="grpo", num_generations=ROWS, beta=beta,
                              epsilon=0.2, epsilon_high=None)  # fmt: skip
    config = rl_losses.algo_config(g, grpo_learner.GRPOConfig)
    config.temperature = 0.8  # the logits divided by it: a temperature other than 1
    return config


def full_view(model: nnx.Module, completion: jax.Array) -> nnx.Module:
    """What the learner ran before: every position projected."""
    return models.compute_view(model)


def log_probs(view, model, prompt, completion) -> jax.Array:
    from tunix.rl import common

    graphdef, state = nnx.split(view(model, completion))
    return common.compute_per_token_logps(
        graphdef, state, prompt_tokens=prompt, completion_tokens=completion, pad_id=PAD,
        eos_id=EOS, stop_gradient=True, temperature=0.8,
    )  # fmt: skip


def loss_and_grads(view, model, wrt, behaviour, reference):
    """GRPO's loss (KL to `reference`, stale rollouts from `behaviour`) and its gradients."""
    from tunix.rl import common

    prompt, completion, mask = tokens()
    example = common.TrainExample(
        prompt_ids=prompt, prompt_mask=prompt != PAD, completion_ids=completion,
        completion_mask=mask, advantages=jnp.asarray([1.0, -0.5, 0.7]),
        ref_per_token_logps=reference, old_per_token_logps=None,
    )  # fmt: skip

    def loss(model):
        value, _ = rl_losses.policy_loss(
            view(model, completion), example, algo_config=algo_config(0.05), pad_id=PAD,
            eos_id=EOS, behaviour_logps=behaviour,
        )  # fmt: skip
        return value

    value, grads = nnx.jit(nnx.value_and_grad(loss, argnums=nnx.DiffState(0, wrt)))(model)
    return float(value), jax.tree.leaves(nnx.to_pure_dict(grads))


@pytest.mark.parametrize(
    "family,lora",
    [("llama3", False), ("llama3", True), ("qwen2", False), ("qwen3", False),
     ("gemma2", False), ("gemma3", False)],
)  # fmt: skip
def test_log_probs_loss_and_gradients_are_the_full_projections(loaded, family, lora):
    model, _ = loaded(family)
    wrt: nnx.filterlib.Filter = nnx.Param
    if lora:
        model, wrt = lora_lib.apply_lora(model, 4, 8.0), nnx.LoRAParam
        nnx.update(model, jax.tree.map(lambda x: x + 0.05, nnx.state(model, nnx.LoRAParam)))
    prompt, completion, _ = tokens()

    # The view's logits are the last K + 1 rows of the full logits, not their neighbours.
    from tunix.rl import common

    ids, positions, attention, _ = common.process_ids(prompt, completion, PAD, EOS)
    full = np.asarray(models.compute_view(model)(ids, positions, None, attention)[0])
    kept = np.asarray(models.last_positions(model, K + 1)(ids, positions, None, attention)[0])
    assert full.shape == (ROWS, P + K, VOCAB) and kept.shape == (ROWS, K + 1, VOCAB)
    np.testing.assert_allclose(kept, full[:, -K - 1 :], rtol=1e-5, atol=1e-6)
    assert np.abs(full[:, -K - 2 : -1] - full[:, -K - 1 :]).max() > 1e-2  # one off differs
    assert models.compute_view(model)(ids, positions, None, attention)[0].shape[1] == P + K

    full_logps = np.asarray(log_probs(full_view, model, prompt, completion))
    cut_logps = np.asarray(log_probs(grpo_step.completion_view, model, prompt, completion))
    assert cut_logps.shape == (ROWS, K)
    np.testing.assert_allclose(cut_logps, full_logps, rtol=1e-5, atol=1e-6)

    noise = np.random.default_rng(1).normal(scale=0.3, size=full_logps.shape)
    behaviour = jnp.asarray(full_logps + noise, jnp.float32)  # weights other than 1
    reference = jnp.asarray(full_logps - noise, jnp.float32)  # a KL other than 0
    full_loss, full_grads = loss_and_grads(full_view, model, wrt, behaviour, reference)
    cut_loss, cut_grads = loss_and_grads(
        grpo_step.completion_view, model, wrt, behaviour, reference
    )
    assert full_loss != 0.0
    np.testing.assert_allclose(cut_loss, full_loss, rtol=1e-5)
    assert len(cut_grads) == len(full_grads) > 0
    for cut, whole in zip(cut_grads, full_grads, strict=True):
        scale = float(np.abs(whole).max())
        assert scale > 0.0
        np.testing.assert_allclose(cut, whole, rtol=1e-5, atol=1e-5 * scale)


def vocab_products(program: str) -> set[tuple[int, int]]:
    """(rows, positions) of each [rows, positions, vocab] product (dot_general) in a
    lowered program's StableHLO."""
    found = set()
    for line in program.splitlines():
        if "dot_general" in line:
            for rows, length in re.findall(rf"-> tensor<(\d+)x(\d+)x{VOCAB}xf32>", line):
                found.add((int(rows), int(length)))
    return found


def programs(model, wrt, use_ref: str, reference) -> str:
    """The StableHLO of GRPO's train step (reference log-probs `use_ref`) and of the
    behaviour log-probs, for one batch."""
    prompt, completion, mask = tokens()
    batch = {"prompt_ids": prompt, "completion_ids": completion, "completion_mask": mask,
             "advantages": jnp.asarray([1.0, -0.5, 0.7]),
             "rewards": jnp.zeros((ROWS, 1), jnp.float32),
             "behaviour_logps": jnp.zeros((ROWS, K), jnp.float32)}  # fmt: skip
    step = grpo_step.make_train_step(wrt, algo_config(0.05), PAD, EOS, 1, use_ref)
    optimizer = nnx.Optimizer(model, optax.sgd(1e-3), wrt=wrt)
    behaviour = grpo_step.behaviour_logps_fn(PAD, EOS, 0.8)
    return "\n".join(
        [step.lower(model, optimizer, reference, batch).as_text(),
         behaviour.lower(model, prompt, completion).as_text()]
    )  # fmt: skip


@pytest.mark.parametrize("family,use_ref", [("llama3", "lora"), ("gemma3", "model")])
def test_the_learner_projects_only_the_completions_positions(loaded, family, use_ref, monkeypatch):
    model, _ = loaded(family)
    wrt: nnx.filterlib.Filter = nnx.Param
    reference = None
    if use_ref == "lora":
        model, wrt = lora_lib.apply_lora(model, 4, 8.0), nnx.LoRAParam
    else:
        reference = model
    assert vocab_products(programs(model, wrt, use_ref, reference)) == {(ROWS, K + 1)}
    # Every position, as before: what the test would see if the restriction were lost.
    monkeypatch.setattr(grpo_step, "completion_view", full_view)
    assert vocab_products(programs(model, wrt, use_ref, reference)) == {(ROWS, P + K)}
