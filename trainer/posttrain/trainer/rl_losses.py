"""The GRPO family's losses (spec.grpo.lossAlgorithm) and the off-policy correction of
asynchronous rollouts (spec.grpo.maxStaleness), on Tunix's policy loss.

Every variant is Tunix's clipped-ratio policy loss (``tunix.rl.algo_core.grpo_loss_fn``,
registered as ``grpo``) with its own settings; this module only chooses them:

=============  ===================  ===========================  ======================
variant        advantage            clip range                   loss aggregation
=============  ===================  ===========================  ======================
``grpo``       (r - mean) / std     [1 - eps, 1 + eps]           mean over each
                                                                 sequence's tokens,
                                                                 then over sequences
``gspo-token`` as grpo              as grpo, on the sequence's   as grpo
                                    mean log-ratio (GSPO)
``dapo``       as grpo              [1 - eps, 1 + epsilonHigh]   mean over all tokens
                                    (clip-higher)                of the batch
                                                                 (token-level)
``dr-grpo``    r - mean (no std)    as grpo                      each sequence's token
                                                                 sum divided by
                                                                 maxCompletionLength
                                                                 (no length norm.)
=============  ===================  ===========================  ======================

DAPO's dynamic sampling (groups whose rewards are all equal carry no advantage; they
are dropped and the batch refilled) is ``grpo.GrpoRun``'s, with ``informative_groups``
here.

Asynchronous rollouts come from a behaviour policy up to ``maxStaleness`` versions older
than the policy being trained. The correction is decoupled PPO's (Hilton et al. 2022,
"Batch size-invariance for policy optimization"; AReaL's decoupled objective): the
clipped ratio is taken against the proximal policy (the current parameters at the start
of the step, ``old_per_token_logps`` None: one update per batch), and each token's loss
is weighted by the behaviour importance ratio ``pi_prox / pi_behav``, truncated at
``IS_TRUNCATION`` (truncated importance sampling): ``behaviour_weights``.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

# The upper bound of the behaviour importance weight pi_prox / pi_behav (truncated IS).
IS_TRUNCATION = 2.0

# DAPO's default upper clip (the paper's epsilon_high) when spec.grpo.epsilonHigh is unset.
DAPO_EPSILON_HIGH = 0.28


@dataclasses.dataclass(frozen=True)
class Variant:
    loss_algo: str  # Tunix's loss_algo: grpo or gspo-token
    loss_agg_mode: str  # tunix.rl.common.aggregate_loss
    advantage_estimator: str  # tunix.rl.function_registry advantage estimator
    dynamic_sampling: bool = False


VARIANTS: dict[str, Variant] = {
    "grpo": Variant("grpo", "sequence-mean-token-mean", "grpo"),
    "gspo-token": Variant("gspo-token", "sequence-mean-token-mean", "grpo"),
    "dapo": Variant("grpo", "token-mean", "grpo", dynamic_sampling=True),
    "dr-grpo": Variant("grpo", "sequence-mean-token-scale", "drgrpo"),
}


def epsilon_high(g: Any) -> float:
    """The upper clip of the ratio: spec.grpo.epsilonHigh, else DAPO's 0.28 for dapo and
    epsilon (a symmetric clip) for the others."""
    if g.epsilon_high is not None:
        return float(g.epsilon_high)
    return DAPO_EPSILON_HIGH if str(g.loss_algorithm) == "dapo" else float(g.epsilon)


def algo_config(g: Any, config_class: Any) -> Any:
    """Tunix's GRPOConfig (or a subclass) for spec.grpo `g`: the variant's loss algorithm,
    aggregation, advantage estimator and clip range."""
    variant = VARIANTS[str(g.loss_algorithm)]
    config = config_class(
        num_generations=g.num_generations,
        num_iterations=1,
        beta=g.beta,
        epsilon=g.epsilon,
        loss_algo=variant.loss_algo,
        loss_agg_mode=variant.loss_agg_mode,
        advantage_estimator=variant.advantage_estimator,
        kl_loss_mode="low_var_kl",
    )
    # Tunix's loss reads epsilon_high where the config has it (DAPO's config does).
    config.epsilon_high = epsilon_high(g)
    return config


def behaviour_weights(
    current_logps: jax.Array, behaviour_logps: jax.Array, mask: jax.Array
) -> jax.Array:
    """Decoupled PPO's per-token behaviour weight min(pi_prox / pi_behav, IS_TRUNCATION),
    detached; 0 on padding."""
    log_ratio = jax.lax.stop_gradient(current_logps).astype(jnp.float32) - behaviour_logps
    weights = jnp.minimum(jnp.exp(jnp.clip(log_ratio, max=20.0)), IS_TRUNCATION)
    return weights * mask


def policy_loss(
    model: Any,
    example: Any,
    *,
    algo_config: Any,
    pad_id: int,
    eos_id: int,
    behaviour_logps: jax.Array | None = None,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """Tunix's policy loss for the variant `algo_config` describes; with
    `behaviour_logps` (the log-probs of the policy that sampled the completions, when it is
    older than the current one) each token is weighted by ``behaviour_weights``."""
    from tunix.rl import common, function_registry

    loss_fn = function_registry.get_policy_loss_fn(algo_config.policy_loss_fn)
    if behaviour_logps is not None:
        graphdef, state = nnx.split(model)
        current = common.compute_per_token_logps(
            graphdef,
            state,
            prompt_tokens=example.prompt_ids,
            completion_tokens=example.completion_ids,
            pad_id=pad_id,
            eos_id=eos_id,
            stop_gradient=True,
            temperature=algo_config.temperature,
        )
        weights = behaviour_weights(current, behaviour_logps, example.completion_mask)
        example = dataclasses.replace(example, sampler_is_weights=weights)
    loss, aux = loss_fn(model, example, algo_config=algo_config, pad_id=pad_id, eos_id=eos_id)
    if behaviour_logps is not None:
        aux["behaviour_weight"] = aux["sampler_is/weight_mean"]
    return loss, aux


def informative_groups(rewards: np.ndarray, num_generations: int) -> np.ndarray:
    """Which prompt groups (rows of `rewards` reshaped [groups, num_generations]) have
    rewards that differ: the groups DAPO's dynamic sampling keeps. A rollout without a
    reward (NaN: its verifier gave none) is left out, not counted as 0."""
    grouped = np.asarray(rewards, np.float64).reshape(-1, num_generations)
    scored = ~np.isnan(grouped)
    highest = np.where(scored, grouped, -np.inf).max(axis=-1)
    lowest = np.where(scored, grouped, np.inf).min(axis=-1)
    return (scored.sum(axis=-1) > 1) & (highest > lowest)
