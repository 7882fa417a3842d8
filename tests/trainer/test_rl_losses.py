"""The GRPO family's losses (posttrain.trainer.rl_losses) against losses computed by hand
in numpy: GRPO, GSPO (token), DAPO (clip-higher, token-level aggregation), Dr. GRPO (no
std, no length normalisation), their advantages, DAPO's group filter, and decoupled PPO's
behaviour weights for stale rollouts.

The policy is a bigram table (logits of the next token are a row of a [V, V] parameter),
so every log-probability is a numpy log-softmax of a known row."""

from __future__ import annotations

import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from posttrain.trainer import rl_losses

pytestmark = pytest.mark.trainer

V, PAD, EOS = 6, 0, 5


class Bigram(nnx.Module):
    def __init__(self, table: np.ndarray):
        self.table = nnx.Param(jnp.asarray(table, jnp.float32))

    def __call__(self, input_tokens, positions, cache, attention_mask):
        return self.table[...][input_tokens], None


def grpo_spec(algo: str, **kw) -> types.SimpleNamespace:
    g = {"num_generations": 2, "beta": 0.0, "epsilon": 0.2, "epsilon_high": None}
    return types.SimpleNamespace(loss_algorithm=algo, **{**g, **kw})


def config(algo: str, **kw):
    from tunix.rl.grpo import grpo_learner

    cfg = rl_losses.algo_config(grpo_spec(algo, **kw), grpo_learner.GRPOConfig)
    cfg.temperature = 1.0
    return cfg


def log_softmax(x: np.ndarray) -> np.ndarray:
    x = x - x.max(-1, keepdims=True)
    return x - np.log(np.exp(x).sum(-1, keepdims=True))


def setup():
    rng = np.random.default_rng(0)
    table = rng.normal(size=(V, V)).astype(np.float32) * 2
    prompt = np.array([[1, 2], [3, 1], [2, 2], [4, 3]], np.int32)
    completion = np.array([[3, 4, 1, EOS], [2, EOS, PAD, PAD], [1, 1, 2, 3], [4, EOS, PAD, PAD]])
    mask = (np.arange(4)[None] < np.array([[4], [2], [4], [2]])).astype(np.int32)
    # The log-prob of each completion token: the row of the token before it.
    previous = np.concatenate([prompt[:, -1:], completion[:, :-1]], axis=1)
    logp = np.take_along_axis(log_softmax(table[previous]), completion[..., None], -1)[..., 0]
    old = logp + rng.normal(scale=0.4, size=logp.shape)  # ratios inside and outside the clip
    advantages = np.array([1.0, -0.5, 2.0, -1.5], np.float32)
    return table, prompt, completion.astype(np.int32), mask, logp, old, advantages


def example(prompt, completion, mask, advantages, old):
    from tunix.rl import common

    return common.TrainExample(
        prompt_ids=jnp.asarray(prompt),
        prompt_mask=jnp.asarray(prompt != PAD),
        completion_ids=jnp.asarray(completion),
        completion_mask=jnp.asarray(mask),
        advantages=jnp.asarray(advantages),
        ref_per_token_logps=None,
        old_per_token_logps=None if old is None else jnp.asarray(old, jnp.float32),
    )


def numpy_loss(algo, logp, old, mask, adv, eps_low, eps_high, weights=None):
    m = mask.astype(np.float64)
    log_ratio = logp - old
    if algo == "gspo-token":
        seq = (log_ratio * m).sum(-1) / m.sum(-1)
        log_ratio = np.broadcast_to(seq[:, None], logp.shape)
    r = np.exp(log_ratio)
    a = adv[:, None]
    per_token = np.maximum(-a * r, -a * np.clip(r, 1 - eps_low, 1 + eps_high))
    if weights is not None:
        per_token = per_token * weights
    if algo == "dapo":  # every token of the batch counts the same
        return (per_token * m).sum() / m.sum()
    if algo == "dr-grpo":  # a constant: the completion length the batch is padded to
        return ((per_token * m).sum(-1) / logp.shape[1]).mean()
    return ((per_token * m).sum(-1) / m.sum(-1)).mean()


@pytest.mark.parametrize(
    ("algo", "eps_high", "want_high"),
    [("grpo", None, 0.2), ("gspo-token", None, 0.2), ("dapo", None, 0.28), ("dr-grpo", 0.3, 0.3)],
)
def test_loss_matches_hand_computed(algo, eps_high, want_high):
    table, prompt, completion, mask, logp, old, adv = setup()
    cfg = config(algo, epsilon_high=eps_high)
    assert cfg.epsilon_high == pytest.approx(want_high)
    loss, aux = rl_losses.policy_loss(
        Bigram(table),
        example(prompt, completion, mask, adv, old),
        algo_config=cfg,
        pad_id=PAD,
        eos_id=EOS,
    )
    want = numpy_loss(algo, logp, old, mask, adv, 0.2, want_high)
    assert float(loss) == pytest.approx(want, rel=1e-5, abs=1e-6)
    # The variants differ on this batch: each aggregation/clip rule is really in effect.
    others = {a: numpy_loss(a, logp, old, mask, adv, 0.2, 0.28) for a in rl_losses.VARIANTS}
    assert len({round(v, 6) for v in others.values()}) == len(others)


def test_advantages_match_hand_computed():
    from tunix.rl import function_registry

    rewards = np.array([1.0, 0.0, 3.0, 3.0, 2.0, 0.5], np.float32)
    grouped = rewards.reshape(-1, 2)
    centred = (grouped - grouped.mean(-1, keepdims=True)).reshape(-1)
    std = np.repeat(grouped.std(-1, ddof=1), 2)
    for algo, want in [
        ("grpo", centred / (std + 1e-6)),
        ("dapo", centred / (std + 1e-6)),
        ("dr-grpo", centred),  # Dr. GRPO: no division by the group's std
    ]:
        estimator = function_registry.get_advantage_estimator(config(algo).advantage_estimator)
        got = np.asarray(estimator(rewards=rewards, num_generations=2))
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_informative_groups_are_those_with_differing_rewards():
    rewards = np.array([1.0, 1.0, 0.0, 1.0, 0.5, 0.5, 0.0, 0.25])
    assert rl_losses.informative_groups(rewards, 2).tolist() == [False, True, False, True]


def test_a_rollout_without_a_reward_is_left_out_of_dynamic_samplings_check():
    """NaN (a verifier gave no reward) neither makes a group informative nor hides that
    its scored rollouts differ; one scored rollout alone compares with nothing."""
    nan = np.nan
    rewards = np.array([1.0, nan, 1.0, 1.0, 0.0, nan, 1.0, 1.0, 1.0, nan, nan, 1.0])
    got = rl_losses.informative_groups(rewards, 3).tolist()
    assert got == [False, True, False, False]


def test_behaviour_weights_correct_stale_rollouts():
    """Decoupled PPO: ratio against the current (proximal) policy, each token weighted by
    min(pi_prox / pi_behav, IS_TRUNCATION) where pi_behav sampled the completion."""
    table, prompt, completion, mask, logp, old, adv = setup()
    behaviour = logp - np.array([0.5, -0.3, 1.2, 0.0])[:, None]  # 1.2: truncated
    weights = np.minimum(np.exp(logp - behaviour), rl_losses.IS_TRUNCATION)
    assert (weights == rl_losses.IS_TRUNCATION).any() and (weights < 1).any()
    for algo in ("grpo", "dapo"):
        loss, aux = rl_losses.policy_loss(
            Bigram(table),
            example(prompt, completion, mask, adv, None),
            algo_config=config(algo),
            pad_id=PAD,
            eos_id=EOS,
            behaviour_logps=jnp.asarray(behaviour, jnp.float32),
        )
        eps_high = 0.28 if algo == "dapo" else 0.2
        want = numpy_loss(algo, logp, logp, mask, adv, 0.2, eps_high, weights)
        assert float(loss) == pytest.approx(want, rel=1e-5)
        want_mean = (weights * mask).sum() / mask.sum()
        assert float(aux["behaviour_weight"]) == pytest.approx(want_mean, rel=1e-5)

    # The gradient is the weighted policy gradient: -sum_t w_t A grad log pi / norm.
    def loss_of(t):
        model = Bigram(t)
        ex = example(prompt, completion, mask, adv, None)
        cfg = config("grpo")
        return rl_losses.policy_loss(
            model, ex, algo_config=cfg, pad_id=PAD, eos_id=EOS, behaviour_logps=behaviour
        )[0]

    grad = np.asarray(jax.grad(loss_of)(jnp.asarray(table)))
    previous = np.concatenate([prompt[:, -1:], completion[:, :-1]], axis=1)
    probs = np.exp(log_softmax(table[previous]))
    want = np.zeros_like(table, dtype=np.float64)
    coef = -(adv[:, None] * weights * mask) / mask.sum(-1, keepdims=True) / len(adv)
    for b in range(4):
        for t in range(4):
            onehot = np.eye(V)[completion[b, t]]
            want[previous[b, t]] += coef[b, t] * (onehot - probs[b, t])
    np.testing.assert_allclose(grad, want, rtol=1e-4, atol=1e-6)
