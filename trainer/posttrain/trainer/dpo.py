"""DPO and ORPO (technique dpo) on preference pairs: prompt, chosen, rejected.

- DPO (sigmoid loss, Rafailov et al. 2023): ``-log sigmoid(beta * ((log pi(y_w|x) -
  log ref(y_w|x)) - (log pi(y_l|x) - log ref(y_l|x))))`` with summed completion
  log-probs. The reference is frozen: with LoRA it is the policy with its adapters zeroed
  (the base model; no second copy of the weights), for a full fine-tune a frozen copy
  loaded in spec.model.dtype.
- ORPO (Hong et al. 2024, reference-free): the chosen completion's token-mean NLL plus
  ``beta * -log sigmoid(log odds(y_w|x) - log odds(y_l|x))`` with odds from the
  token-mean log-probs (as TRL computes it; spec.dpo.beta is ORPO's lambda).

The losses are written here in JAX rather than taken from ``tunix.sft.dpo``: its trainer
owns its loop and checkpoints (no data position), needs a second model object for the
reference, and its ORPO uses summed log-probs in ``log1p(-exp(.))``, which is NaN for any
completion longer than a few tokens.

TensorBoard (train/...): loss, preference_accuracy (share of pairs whose chosen reward
beats the rejected one), reward_margin, reward_chosen, reward_rejected, logps_chosen,
logps_rejected (+ nll, log_odds_ratio for ORPO), grad_norm, learning_rate, tokens/s.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from posttrain.api.spec import DpoSpec
from posttrain.trainer import evaluate, loop, models, optim
from posttrain.trainer.policy import load_reference

BATCH_KEYS = (
    "prompt_ids",
    "prompt_mask",
    "chosen_ids",
    "chosen_mask",
    "rejected_ids",
    "rejected_mask",
)


# ----------------------------------------------------------------------------- losses


def dpo_loss(
    policy_chosen: jax.Array,
    policy_rejected: jax.Array,
    ref_chosen: jax.Array,
    ref_rejected: jax.Array,
    beta: float,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Per-pair sigmoid DPO loss and the implicit rewards beta * log(pi / ref) of the
    chosen and rejected completions (inputs: summed completion log-probs [n])."""
    chosen = beta * (policy_chosen - ref_chosen)
    rejected = beta * (policy_rejected - ref_rejected)
    return -jax.nn.log_sigmoid(chosen - rejected), chosen, rejected


def _log1m_exp(x: jax.Array) -> jax.Array:
    """log(1 - exp(x)) for x < 0, kept finite as x -> 0."""
    return jnp.log1p(-jnp.exp(jnp.minimum(x, -1e-6)))


def orpo_loss(
    mean_chosen: jax.Array, mean_rejected: jax.Array, beta: float
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """Per-pair ORPO odds-ratio term beta * -log sigmoid(log odds ratio) (inputs:
    token-mean completion log-probs [n]), the rewards beta * mean log-prob, and the log
    odds ratio."""
    log_odds = (mean_chosen - mean_rejected) - (_log1m_exp(mean_chosen) - _log1m_exp(mean_rejected))
    return -beta * jax.nn.log_sigmoid(log_odds), beta * mean_chosen, beta * mean_rejected, log_odds


def completion_logps(
    model: nnx.Module,
    prompt_ids: jax.Array,
    prompt_mask: jax.Array,
    completion_ids: jax.Array,
    completion_mask: jax.Array,
) -> tuple[jax.Array, jax.Array]:
    """Summed log-probs of the completion tokens [n] and their count [n], for left-padded
    prompts [n, P] followed by right-padded completions [n, C]."""
    ids = jnp.concatenate([prompt_ids, completion_ids], axis=1)
    mask = jnp.concatenate([prompt_mask, completion_mask], axis=1).astype(jnp.bool_)
    positions = jnp.maximum(jnp.cumsum(mask, axis=-1) - 1, 0).astype(jnp.int32)
    length = ids.shape[1]
    causal = jnp.tril(jnp.ones((length, length), jnp.bool_))
    eye = jnp.eye(length, dtype=jnp.bool_)[None]
    attention = models.attention_input(
        model, mask, lambda _: (causal[None] & mask[:, None, :]) | eye
    )
    logits, _ = models.compute_view(model)(ids, positions, None, attention)
    prompt_len = prompt_ids.shape[1]
    logits = logits[:, prompt_len - 1 : -1].astype(jnp.float32)
    logp = jax.nn.log_softmax(logits, axis=-1)
    token = jnp.take_along_axis(logp, completion_ids[..., None], axis=-1)[..., 0]
    cmask = completion_mask.astype(jnp.float32)
    return jnp.sum(token * cmask, axis=-1), jnp.sum(cmask, axis=-1)


def _zero_lora(model: nnx.Module) -> nnx.Module:
    """The model with its LoRA params zero: the frozen base (inside jit: no copy)."""
    graphdef, lora_state, rest = nnx.split(model, nnx.LoRAParam, ...)
    return nnx.merge(graphdef, jax.tree.map(jnp.zeros_like, lora_state), rest)


def _pairs(model: nnx.Module, mb: dict[str, jax.Array]) -> tuple[jax.Array, ...]:
    """(chosen sum, rejected sum, chosen count, rejected count), one forward pass."""
    n = mb["prompt_ids"].shape[0]
    logps, counts = completion_logps(
        model,
        jnp.concatenate([mb["prompt_ids"], mb["prompt_ids"]]),
        jnp.concatenate([mb["prompt_mask"], mb["prompt_mask"]]),
        jnp.concatenate([mb["chosen_ids"], mb["rejected_ids"]]),
        jnp.concatenate([mb["chosen_mask"], mb["rejected_mask"]]),
    )
    return logps[:n], logps[n:], counts[:n], counts[n:]


def make_loss(settings: DpoSpec, reference: str):
    """loss_fn(model, ref_model, batch) -> (mean loss, metrics) of DPO/ORPO over a batch
    of pairs. reference: 'lora' (the policy with adapters zeroed), 'model' (a frozen
    model argument) or 'none' (ORPO)."""
    algorithm, beta = str(settings.algorithm), float(settings.beta)

    def loss_fn(model, ref_model, mb):
        pc, pr, nc, nr = _pairs(model, mb)
        if algorithm == "orpo":
            mean_c, mean_r = pc / jnp.maximum(nc, 1.0), pr / jnp.maximum(nr, 1.0)
            odds, chosen, rejected, log_odds = orpo_loss(mean_c, mean_r, beta)
            nll = -jnp.sum(pc) / jnp.maximum(jnp.sum(nc), 1.0)
            loss = nll + jnp.mean(odds)
            extra = {"nll": nll, "log_odds_ratio": jnp.mean(log_odds)}
        else:
            ref = _zero_lora(model) if reference == "lora" else ref_model
            rc, rr, _, _ = jax.lax.stop_gradient(_pairs(ref, mb))
            losses, chosen, rejected = dpo_loss(pc, pr, rc, rr, beta)
            loss = jnp.mean(losses)
            extra = {}
        aux = {
            "preference_accuracy": jnp.mean((chosen > rejected).astype(jnp.float32)),
            "reward_margin": jnp.mean(chosen - rejected),
            "reward_chosen": jnp.mean(chosen),
            "reward_rejected": jnp.mean(rejected),
            "logps_chosen": jnp.mean(pc),
            "logps_rejected": jnp.mean(pr),
            **extra,
        }
        return loss, aux

    return loss_fn


def make_eval_step(settings: DpoSpec, reference: str):
    """A jitted held-out measure of a batch of pairs: {'loss', 'preference_accuracy',
    'reward_margin', ...}, each a mean over the batch (no gradients, no update)."""
    loss_fn = make_loss(settings, reference)

    def measure(model, ref_model, batch):
        loss, aux = loss_fn(model, ref_model, batch)
        return {"loss": loss, **aux}

    return nnx.jit(measure)


def make_train_step(wrt: Any, settings: DpoSpec, accumulation: int, reference: str):
    """A jitted DPO/ORPO update over `accumulation` micro-batches of pairs (see
    make_loss for reference)."""
    loss_fn = make_loss(settings, reference)
    grad_fn = nnx.value_and_grad(loss_fn, argnums=nnx.DiffState(0, wrt), has_aux=True)

    def step(model, optimizer, ref_model, batch):
        total, aux_sum, grads = optim.accumulate(grad_fn, batch, accumulation, model, ref_model)
        scale = 1.0 / accumulation
        grads = jax.tree.map(lambda g: g * scale, grads)
        optimizer.update(model, grads)
        # Each prompt is read twice (once before each completion).
        tokens = (
            2 * jnp.sum(batch["prompt_mask"])
            + jnp.sum(batch["chosen_mask"])
            + jnp.sum(batch["rejected_mask"])
        )
        return {
            "loss": total * scale,
            "grad_norm": optax.tree.norm(grads),
            **{k: v * scale for k, v in aux_sum.items()},
            "tokens": tokens,
        }

    return optim.jit_step(step)


# ------------------------------------------------------------------------------- run


def train(run: loop.RunSetup) -> loop.Result:
    """DPO/ORPO for spec.training.steps steps of spec.training.batchSize pairs, resuming
    from the newest checkpoint."""
    spec, policy = run.job.spec, run.policy
    settings = spec.dpo or DpoSpec()
    reference, ref_model = "none", None
    if str(settings.algorithm) == "dpo":
        if spec.lora:
            reference = "lora"
        else:
            reference = "model"
            ref_model = load_reference(spec, policy, run.mesh)
    opt = run.optimizer()
    step_fn = make_train_step(policy.wrt, settings, spec.training.gradient_accumulation, reference)

    def to_global(host_batch: dict[str, np.ndarray]) -> dict[str, Any]:
        return run.to_global(host_batch, BATCH_KEYS)

    def step(host_batch: dict[str, np.ndarray], index: int) -> dict[str, Any]:
        return step_fn(policy.model, opt, ref_model, to_global(host_batch))

    eval_fn = make_eval_step(settings, reference)
    measure, summarize = evaluate.batch_means(
        lambda batch: eval_fn(policy.model, ref_model, batch), to_global
    )
    return run.train(opt, step, measure, summarize)
