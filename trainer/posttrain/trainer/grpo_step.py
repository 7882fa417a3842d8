"""The GRPO learner's jitted programs (grpo.GrpoRun runs them).

- ``make_train_step``: reference log-probs (none with beta 0, the policy with its LoRA
  adapters zeroed, or a frozen copy), Tunix's policy loss (``rl_losses``) over
  spec.training.gradientAccumulation micro-batches in a scan, one optimizer update;
- ``make_zero_advantage_step``: the same update for a batch with nothing to learn (every
  advantage zero, beta 0), without the forward and backward passes;
- ``behaviour_logps_fn``: per-token log-probs under the sampler's weights, the behaviour
  policy of asynchronous rollouts (spec.grpo.rollout.maxStaleness).

Each projects only the completion's positions onto the vocabulary (``completion_view``).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from posttrain.trainer import models, optim, rl_losses


def _zero_lora(state: nnx.State) -> nnx.State:
    """The state with every LoRA param zero: the base model, adapters off."""
    lora_state, rest = nnx.split_state(state, nnx.LoRAParam, ...)
    return nnx.merge_state(jax.tree.map(jnp.zeros_like, lora_state), rest)


def completion_view(model: nnx.Module, completion_ids: jax.Array) -> nnx.Module:
    """``model`` in its compute dtype, projecting onto the vocabulary only the positions
    that Tunix's log-probs of ``completion_ids`` ([B, K]) read: ``logits[:, -K-1:-1]``
    of its last K + 1 (``models.last_positions``)."""
    return models.last_positions(models.compute_view(model), completion_ids.shape[1] + 1)


def make_train_step(
    wrt: Any, algo_config: Any, pad_id: int, eos_id: int, accumulation: int, use_ref: str
):
    """The jitted GRPO update: reference log-probs (none, the policy with zeroed LoRA, or a
    frozen model), Tunix's policy loss over `accumulation` micro-batches, one optimizer
    update. Returns metrics (device scalars)."""
    from tunix.rl import common

    temperature = float(algo_config.temperature)
    token_mean = algo_config.loss_agg_mode == "token-mean"  # DAPO's

    def ref_logps(model, ref_model, batch):
        if use_ref == "none":
            return None
        if use_ref == "lora":
            graphdef, state = nnx.split(completion_view(model, batch["completion_ids"]))
            state = _zero_lora(state)
        else:
            graphdef, state = nnx.split(completion_view(ref_model, batch["completion_ids"]))
        return common.compute_per_token_logps(
            graphdef,
            state,
            prompt_tokens=batch["prompt_ids"],
            completion_tokens=batch["completion_ids"],
            pad_id=pad_id,
            eos_id=eos_id,
            stop_gradient=True,
            temperature=temperature,
        )

    def loss_fn(model, example, behaviour_logps, share):
        view = completion_view(model, example.completion_ids)
        loss, aux = rl_losses.policy_loss(
            view,
            example,
            algo_config=algo_config,
            pad_id=pad_id,
            eos_id=eos_id,
            behaviour_logps=behaviour_logps,
        )
        return (loss if share is None else loss * jnp.sum(share)), aux

    grad_fn = nnx.value_and_grad(loss_fn, argnums=nnx.DiffState(0, wrt), has_aux=True)

    def micro_grads(model, ref_model, mb):
        """((loss, metrics), grads) of one micro-batch: kl, clip fraction, entropy and, for
        stale rollouts, the mean behaviour weight."""
        example = common.TrainExample(
            prompt_ids=mb["prompt_ids"],
            prompt_mask=mb["prompt_ids"] != pad_id,
            completion_ids=mb["completion_ids"],
            completion_mask=mb["completion_mask"],
            advantages=mb["advantages"],
            ref_per_token_logps=ref_logps(model, ref_model, mb),
            old_per_token_logps=None,
        )
        (loss, aux), grads = grad_fn(model, example, mb.get("behaviour_logps"), mb.get("share"))
        names = {"kl": "kl", "pg_clipfrac": "clip_fraction", "entropy": "entropy",
                 "behaviour_weight": "behaviour_weight"}  # fmt: skip
        return (loss, {ours: aux[k] for k, ours in names.items() if k in aux}), grads

    def step(model, optimizer, ref_model, batch):
        # The micro-batches in a scan (optim.accumulate): one micro-batch's activations
        # and logit gradients live at a time.
        keys = ("prompt_ids", "completion_ids", "completion_mask", "advantages", "behaviour_logps")
        learner = {k: batch[k] for k in keys if k in batch}
        if token_mean and accumulation > 1:
            # A token mean over the whole batch, not a mean of the micro-batches' token
            # means: each micro-batch's loss weighted by accumulation x its share of the
            # batch's tokens (the shares of its rows summed), then averaged as the others.
            tokens = jnp.sum(batch["completion_mask"], axis=-1).astype(jnp.float32)
            learner["share"] = tokens * accumulation / jnp.maximum(jnp.sum(tokens), 1.0)
        loss, metrics, grads = optim.accumulate(
            micro_grads, learner, accumulation, model, ref_model
        )
        scale = 1.0 / accumulation
        grads = jax.tree.map(lambda g: g * scale, grads)
        optimizer.update(model, grads)
        return {
            "loss": loss * scale,
            "grad_norm": optax.tree.norm(grads),
            **{k: v * scale for k, v in metrics.items()},
            **rollout_metrics(batch),
        }

    return optim.jit_step(step)


def make_zero_advantage_step(wrt: Any):
    """The update of a batch whose every advantage is zero, without a KL term (beta 0):
    the policy loss is zero whatever the weights, and so is its gradient, so the update
    is the optimizer's with zero gradients (its moments decay, weight decay and the
    schedule go on), as `make_train_step`'s would be, without the forward and backward
    passes. Same arguments and metrics, less what only those passes measure (entropy,
    clip fraction, KL)."""

    def step(model, optimizer, ref_model, batch):
        del ref_model
        optimizer.update(model, jax.tree.map(jnp.zeros_like, nnx.state(model, wrt)))
        return {"loss": jnp.float32(0), "grad_norm": jnp.float32(0), **rollout_metrics(batch)}

    return optim.jit_step(step)


def rollout_metrics(batch: dict[str, jax.Array]) -> dict[str, jax.Array]:
    mask = batch["completion_mask"].astype(jnp.float32)
    return {
        "reward": jnp.mean(jnp.sum(batch["rewards"], axis=-1)),
        "reward_std": jnp.std(jnp.sum(batch["rewards"], axis=-1)),
        "reward_parts": jnp.mean(batch["rewards"], axis=0),
        "completion_length": jnp.mean(jnp.sum(mask, axis=-1)),
        "tokens": jnp.sum(mask),
    }


def behaviour_logps_fn(pad_id: int, eos_id: int, temperature: float):
    """The per-token log-probs of completions under the sampler's model (the behaviour
    policy of asynchronous rollouts), as the train step computes the policy's."""
    from tunix.rl import common

    def logps(model, prompt_ids, completion_ids):
        graphdef, state = nnx.split(completion_view(model, completion_ids))
        return common.compute_per_token_logps(
            graphdef,
            state,
            prompt_tokens=prompt_ids,
            completion_tokens=completion_ids,
            pad_id=pad_id,
            eos_id=eos_id,
            stop_gradient=True,
            temperature=temperature,
        )

    return nnx.jit(logps)
