"""Optimizer and learning-rate schedule from spec.training (optax), and gradient
accumulation over micro-batches."""

from __future__ import annotations

import contextvars
import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

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


def learning_rates(t: TrainingSpec) -> np.ndarray:
    """The schedule's value before each step (index = steps done), computed once on the
    device before training: evaluated at a log step instead, it would queue behind the
    steps in flight and hold the host until they finished, leaving the device idle."""
    steps = jnp.arange(t.steps, dtype=jnp.int32)
    return np.asarray(jax.jit(jax.vmap(learning_rate_schedule(t)))(steps))


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
    `accumulation` equal micro-batches of `batch` (rows interleaved, `micro_batches`): the
    loss, the aux pytree and the gradients (inside a jitted step).

    The micro-batches run in a `jax.lax.scan` whose carry is the running sums, so XLA
    holds one micro-batch's activations and logit gradients at a time (a Python loop
    unrolled in the step let it keep every micro-batch's float32 logit gradients alive
    together: accumulation cost memory instead of saving it). The sums are taken in the
    micro-batches' order, as the unrolled loop took them. `args` are nnx modules (or
    None) read, not changed, by `grad_fn`.

    Each iteration passes the weights through an optimization barrier with its
    micro-batch. Without it XLA hoists what depends on the weights alone out of the loop:
    over several fsdp devices, the all-gather of every layer's weights (and the float32
    masters' cast), so every layer stayed gathered for the whole loop (accumulation 4
    needed 1.27x the memory of accumulation 1 for DPO on 8 devices). With it the weights
    are gathered a layer at a time in each micro-batch, as without accumulation; the
    barrier is the identity, so the sums are unchanged (bitwise:
    tests/trainer/test_accumulation.py).

    Inside a step made by `jit_step`, the gradient sums are also an output of the jitted
    program (dropped by the step's caller), so the compiler keeps the loop's carry in that
    output buffer: the TPU compiler counts a loop carry kept among its temporaries twice
    in the memory it reserves (`temp_size_in_bytes`), an output once (see `jit_step`)."""
    if accumulation == 1:
        (loss, aux), grads = grad_fn(*args, batch)
        return loss, aux, grads
    micro = micro_batches(batch, accumulation)
    graphdef, state = nnx.split(args)

    def one(state: Any, mb: dict[str, jax.Array]):
        # Fresh Variables in the scan's trace (nnx refuses ones made outside it).
        return grad_fn(*nnx.merge(graphdef, jax.tree.map(lambda x: x, state)), mb)

    first = {k: v[0] for k, v in micro.items()}
    zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), jax.eval_shape(one, state, first))

    def body(carry, mb):
        # The weights made loop-variant (tied to this micro-batch): XLA cannot hoist
        # their gathers out of the loop.
        weights, mb = jax.lax.optimization_barrier((state, mb))
        (loss, aux), grads = one(weights, mb)
        (total, aux_sum), grad_sum = carry
        return ((total + loss, _add(aux_sum, aux)), _add(grad_sum, grads)), None

    ((total, aux_sum), grads), _ = jax.lax.scan(body, zeros, micro)
    sums = _SUMS.get()
    if sums is not None:
        sums.append(grads)
    return total, aux_sum, grads


def jit_step(step: Callable[..., Any]) -> Callable[..., Any]:
    """`step(model, optimizer, ...)` jit-compiled with both donated: the step writes the
    new weights and optimizer state into the buffers of the old ones (XLA aliases each
    output to its donated input), so no second copy of either is ever live. What is not
    trained (a LoRA run's base weights) passes through the step unchanged, in place.
    Whatever else holds the model's Variables (a colocated sampler) reads the new arrays:
    nnx.jit updates the Variables themselves.

    The jitted program also outputs the gradient sums of its accumulation loop (none
    without accumulation), which the returned step drops: XLA then keeps the loop's
    carry (the float32 sums) in that output's buffer instead of among the program's
    temporaries, where the TPU compiler reserves a loop carry's memory twice (a while
    loop whose carry is among the temporaries needs its carry's size more temporary
    memory than the buffers it assigns; one whose carry is an output does not). For a
    full fine-tune of Qwen3-0.6B at 2 layers with accumulation 4 that is 0.69 GiB less
    (7.36 to 6.68 GiB; 5.97 without accumulation): the sum is counted once, as
    accumulation must hold it. An output is always in HBM: a step small enough for the
    compiler to keep its temporaries, the sum with them, in the chip's on-chip memory
    (v5e: 128 MiB) needs the sum's size more HBM (an 8k-vocabulary 2-layer model at 256
    tokens: 186 to 248 MiB, was 205), which no fine-tune at a published shape is. `lower`
    lowers the whole program, sums included: its memory_analysis() is what the step
    needs."""

    @functools.wraps(step)
    def with_sums(*args: Any, **kwargs: Any) -> tuple[Any, list[Any]]:
        sums: list[Any] = []
        token = _SUMS.set(sums)
        try:
            out = step(*args, **kwargs)
        finally:
            _SUMS.reset(token)
        return out, sums

    return _Step(nnx.jit(with_sums, donate_argnames=("model", "optimizer")))


class _Step:
    """A jitted step whose program returns (outputs, gradient sums): called, the outputs
    (the sums' buffers are freed as they are dropped); `lower` is the program's."""

    def __init__(self, jitted: Any) -> None:
        self._jitted = jitted

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._jitted(*args, **kwargs)[0]

    def lower(self, *args: Any, **kwargs: Any) -> Any:
        return self._jitted.lower(*args, **kwargs)


# The gradient sums that `accumulate` hands to the step `jit_step` is tracing (None
# outside one).
_SUMS: contextvars.ContextVar[list[Any] | None] = contextvars.ContextVar("sums", default=None)


def micro_batches(batch: dict[str, jax.Array], accumulation: int) -> dict[str, jax.Array]:
    """`batch` as [accumulation, rows / accumulation, ...] arrays: micro-batch i takes rows
    i, i + accumulation, i + 2 x accumulation, ... A global batch is split over the devices
    in contiguous blocks of rows, so each device keeps its share of every micro-batch (a
    contiguous split would give micro-batch i to a few devices only, and XLA would move the
    rows or compute that micro-batch's activations on those devices)."""
    return {
        k: jnp.swapaxes(v.reshape(v.shape[0] // accumulation, accumulation, *v.shape[1:]), 0, 1)
        for k, v in batch.items()
    }


def _add(a: Any, b: Any) -> Any:
    return jax.tree.map(jnp.add, a, b)
