"""The SFT loss and train step (full fine-tune or LoRA), jit-compiled with nnx.

A batch is a dict of [B, L] int32 arrays from `posttrain.trainer.data`: input_ids,
loss_mask (1 where the token is a target), segment_ids (0 = padding, 1..n = the example a
token belongs to when packed) and positions. Attention stays within an example. The loss
is the mean negative log-likelihood over every target token of the global batch, so it
does not depend on how the batch is split over hosts or micro-batches.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from posttrain.trainer import models, optim


def attention_mask(segment_ids: jax.Array) -> jax.Array:
    """[B, L] segments -> [B, L, L] causal mask within each example; a padding token
    attends to itself only (so no row is fully masked)."""
    length = segment_ids.shape[-1]
    causal = jnp.tril(jnp.ones((length, length), dtype=jnp.bool_))
    same = segment_ids[:, :, None] == segment_ids[:, None, :]
    real = segment_ids[:, None, :] != 0
    eye = jnp.eye(length, dtype=jnp.bool_)[None]
    return (causal[None] & same & real) | eye


def target_nll(logits: jax.Array, targets: jax.Array) -> jax.Array:
    """-log softmax(logits)[target] per token ([..., vocab] float32 logits, [...] ids), as
    logsumexp minus the target's logit: no [..., vocab] log-softmax is materialised, so
    the backward pass keeps one float32 array of the logits' size fewer."""
    target = jnp.take_along_axis(logits, targets[..., None], axis=-1)[..., 0]
    return jax.nn.logsumexp(logits, axis=-1) - target


def token_nll(model: nnx.Module, batch: dict[str, jax.Array]) -> tuple[jax.Array, jax.Array]:
    """Summed NLL over target tokens, and the number of target tokens (the forward in the
    model's compute dtype, the loss in float32)."""
    ids = batch["input_ids"]
    mask, extra = models.attention_input(model, batch["segment_ids"], attention_mask), {}
    if "images" in batch:  # Gemma 3 vision: the images' soft tokens see each other
        from posttrain.trainer.models import vision

        mask = mask | vision.image_blocks(ids, vision.image_token_id(model))
        extra["images"] = batch["images"]
    logits, _ = models.compute_view(model)(ids, batch["positions"], None, mask, **extra)
    logits = logits[:, :-1].astype(jnp.float32)
    targets = ids[:, 1:]
    mask = batch["loss_mask"][:, 1:].astype(jnp.float32)
    nll = target_nll(logits, targets)
    return jnp.sum(nll * mask), jnp.sum(mask)


def make_train_step(wrt: Any, accumulation: int):
    """A jitted step: accumulate gradients over `accumulation` micro-batches (a scan,
    optim.accumulate), then one optimizer update. Returns (loss, grad norm, target tokens, tokens processed)."""

    def summed(model: nnx.Module, batch: dict[str, jax.Array]):
        total, count = token_nll(model, batch)
        return total, count

    grad_fn = nnx.value_and_grad(summed, argnums=nnx.DiffState(0, wrt), has_aux=True)

    def step(model: nnx.Module, optimizer: nnx.Optimizer, batch: dict[str, jax.Array]):
        total, count, grads = optim.accumulate(grad_fn, batch, accumulation, model)
        scale = 1.0 / jnp.maximum(count, 1.0)
        grads = jax.tree.map(lambda g: g * scale, grads)
        optimizer.update(model, grads)
        seen = jnp.sum(batch["segment_ids"] != 0)
        return total * scale, optax.tree.norm(grads), count, seen

    return optim.jit_step(step)


def eval_loss(model: nnx.Module, batch: dict[str, Any]) -> float:
    """Mean target-token NLL of one batch (no update)."""
    total, count = nnx.jit(token_nll)(model, {k: jnp.asarray(v) for k, v in batch.items()})
    return float(total / jnp.maximum(count, 1.0))
