"""Knowledge distillation (technique distill): a student learns from a teacher's logits.

Per target token (the SFT loss mask of the data: completion tokens by default):

    loss = alpha * T^2 * KL(softmax(teacher / T) || softmax(student / T))
           + (1 - alpha) * NLL(student, the data's next token)

averaged over every target token of the global batch (so it does not depend on how the
batch is split over hosts or micro-batches), as Hinton et al. (2015) scale it. The
teacher (spec.distill.teacher) is frozen, loaded in its own dtype on the same mesh, and
must share the student's tokenizer (same vocabulary). The student is spec.model, full or
LoRA; data, checkpoints, export and progress are the SFT loop's.

Tunix's ``tunix.distillation`` LogitStrategy averages over every position, padding and
prompt included; here only target tokens count, like the SFT loss.

TensorBoard (train/...): loss, kl (the KL at temperature T, unscaled), nll (student),
teacher_nll, grad_norm, learning_rate, tokens_per_second.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from posttrain.trainer import evaluate, loop, models, optim, sft, sources
from posttrain.trainer.policy import DTYPES, apply_layer_loop


def token_losses(
    student_logits: jax.Array,
    teacher_logits: jax.Array,
    targets: jax.Array,
    temperature: float,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Per token [.., L]: KL(teacher_T || student_T), the student's NLL of the targets and
    the teacher's NLL (logits [.., L, V], targets [.., L])."""
    s = student_logits.astype(jnp.float32)
    t = teacher_logits.astype(jnp.float32)
    log_q = jax.nn.log_softmax(s / temperature, axis=-1)
    log_p = jax.nn.log_softmax(t / temperature, axis=-1)
    kl = jnp.sum(jnp.exp(log_p) * (log_p - log_q), axis=-1)

    def nll(logits):
        logp = jax.nn.log_softmax(logits, axis=-1)
        return -jnp.take_along_axis(logp, targets[..., None], axis=-1)[..., 0]

    return kl, nll(s), nll(t)


def distill_loss(
    student_logits: jax.Array,
    teacher_logits: jax.Array,
    targets: jax.Array,
    mask: jax.Array,
    temperature: float,
    alpha: float,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """The summed loss over target tokens and the sums of its parts (divide by 'count')."""
    kl, nll, teacher_nll = token_losses(student_logits, teacher_logits, targets, temperature)
    mask = mask.astype(jnp.float32)
    sums = {
        "kl": jnp.sum(kl * mask),
        "nll": jnp.sum(nll * mask),
        "teacher_nll": jnp.sum(teacher_nll * mask),
        "count": jnp.sum(mask),
    }
    loss = alpha * temperature**2 * sums["kl"] + (1.0 - alpha) * sums["nll"]
    return loss, sums


def _logits(model: nnx.Module, batch: dict[str, jax.Array]) -> jax.Array:
    logits, _ = models.compute_view(model)(
        batch["input_ids"],
        batch["positions"],
        None,
        models.attention_input(model, batch["segment_ids"], sft.attention_mask),
    )
    return logits[:, :-1]


def make_train_step(wrt: Any, temperature: float, alpha: float, accumulation: int):
    """A jitted update: accumulate summed losses and gradients over `accumulation`
    micro-batches, divide by the global target-token count, one optimizer update."""

    def summed(model, teacher, batch):
        teacher_logits = jax.lax.stop_gradient(_logits(teacher, batch))
        return distill_loss(
            _logits(model, batch),
            teacher_logits,
            batch["input_ids"][:, 1:],
            batch["loss_mask"][:, 1:],
            temperature,
            alpha,
        )

    grad_fn = nnx.value_and_grad(summed, argnums=nnx.DiffState(0, wrt), has_aux=True)

    def step(model, optimizer, teacher, batch):
        total, sums, grads = optim.accumulate(grad_fn, batch, accumulation, model, teacher)
        scale = 1.0 / jnp.maximum(sums["count"], 1.0)
        grads = jax.tree.map(lambda g: g * scale, grads)
        optimizer.update(model, grads)
        return {
            "loss": total * scale,
            "grad_norm": optax.tree.norm(grads),
            "kl": sums["kl"] * scale,
            "nll": sums["nll"] * scale,
            "teacher_nll": sums["teacher_nll"] * scale,
            "tokens": jnp.sum(batch["segment_ids"] != 0),
        }

    return optim.jit_step(step)


def load_teacher(spec: Any, student: models.ModelInfo, mesh: jax.sharding.Mesh, scratch: Path):
    """spec.distill.teacher on the mesh; its vocabulary must be the student's."""
    teacher_spec = spec.distill.teacher
    teacher, info = sources.load_model_source(
        teacher_spec.source,
        scratch,
        field="spec.distill.teacher.source",
        num_layers=teacher_spec.layers,
        layers_field="spec.distill.teacher.layers",
        family=teacher_spec.family,
        mesh=mesh,
        dtype=DTYPES[teacher_spec.dtype],
        remat=spec.training.remat,
        attention=spec.training.attention,
    )
    if info.vocab_size != student.vocab_size:
        raise ValueError(
            f"spec.distill.teacher: the teacher's vocabulary has {info.vocab_size} tokens, "
            f"the student's {student.vocab_size}; the teacher must share the student's "
            "tokenizer"
        )
    return apply_layer_loop(spec, teacher, info.family, mesh), info


def check(spec: Any) -> None:
    """What a distillation job got wrong, before anything loads."""
    if spec.distill is None:
        raise ValueError("spec.distill: technique distill needs a spec.distill block")


def train(run: loop.RunSetup) -> loop.Result:
    """Distil spec.distill.teacher into spec.model for spec.training.steps steps,
    resuming from the newest checkpoint."""
    spec, policy = run.job.spec, run.policy
    teacher, _ = load_teacher(spec, policy.info, run.mesh, run.scratch)
    opt = run.optimizer()
    step_fn = make_train_step(
        policy.wrt,
        float(spec.distill.temperature),
        float(spec.distill.alpha),
        spec.training.gradient_accumulation,
    )

    def step(host_batch: dict[str, np.ndarray], index: int) -> dict[str, Any]:
        return step_fn(policy.model, opt, teacher, run.to_global(host_batch))

    # Held out: the student's own likelihood of the data (loss, perplexity).
    measure, summarize = evaluate.token_loss(policy.model, run.to_global)
    return run.train(opt, step, measure, summarize)
