"""Optimizer and learning-rate schedule from spec.training (optax), and gradient
accumulation over micro-batches."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax

from posttrain.api.spec import TrainingSpec


def learning_rate_schedule(t: TrainingSpec) -> optax.Schedule:
    """Linear warmup to learningRate, then cosine or linear decay to 0, or constant."""
    decay_steps = max(1, t.steps - t.warmup_steps)
    if t.schedule == "cosine":
        decay = optax.cosine_decay_schedule(t.learning_rate, decay_steps)
    elif t.schedule == "linear":
        decay = optax.linear_schedule(t.learning_rate, 0.0, decay_steps)
    else:
        decay = optax.constant_schedule(t.learning_rate)
    if t.warmup_steps == 0:
        return decay
    warmup = optax.linear_schedule(0.0, t.learning_rate, t.warmup_steps)
    return optax.join_schedules([warmup, decay], [t.warmup_steps])


def optimizer(t: TrainingSpec) -> optax.GradientTransformation:
    """Clip by global norm, then the chosen optimizer on the schedule."""
    lr = learning_rate_schedule(t)
    if t.optimizer == "adamw":
        opt = optax.adamw(lr, b1=0.9, b2=0.999, eps=1e-8, weight_decay=t.weight_decay)
    elif t.optimizer == "adafactor":
        opt = optax.adafactor(lr, weight_decay_rate=t.weight_decay or None)
    else:
        opt = optax.sgd(lr, momentum=0.9)
    if t.max_grad_norm > 0:
        return optax.chain(optax.clip_by_global_norm(t.max_grad_norm), opt)
    return opt


def accumulate(
    grad_fn: Callable[..., Any], batch: dict[str, jax.Array], accumulation: int, *args: Any
) -> tuple[jax.Array, Any, Any]:
    """Sums of `grad_fn(*args, micro_batch)` (which returns ((loss, aux), grads)) over
    `accumulation` equal micro-batches of `batch`, split along its first axis: the loss,
    the aux pytree and the gradients (inside a jitted step)."""
    micro = {
        k: v.reshape(accumulation, v.shape[0] // accumulation, *v.shape[1:])
        for k, v in batch.items()
    }
    total, aux_sum, grads = jnp.zeros((), jnp.float32), None, None
    for i in range(accumulation):
        (loss, aux), g = grad_fn(*args, {k: v[i] for k, v in micro.items()})
        total = total + loss
        grads = g if grads is None else jax.tree.map(jnp.add, grads, g)
        aux_sum = aux if aux_sum is None else jax.tree.map(jnp.add, aux_sum, aux)
    return total, aux_sum, grads
