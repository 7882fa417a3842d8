"""The same tiny checkpoint on the TPU and on the host's CPU, in one process: the first
step's loss and gradient norm (posttrain's own SFT step), the logits, and greedy tokens.

float32 with `highest` matmul precision must agree to rel 1e-5; bfloat16 (the compute
dtype of every accelerator job) within the tolerances stated below, which are what
bfloat16's 8-bit mantissa allows over a few layers (measured figures: docs/tpu.md)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from tiny_model import make_tiny_llama

from posttrain.api.spec import TrainingSpec
from posttrain.trainer import lora, models, optim, sft

BF16_LOSS_RTOL = 1e-2
BF16_LOGITS_RTOL = 5e-2  # of the largest logit


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return make_tiny_llama(tmp_path_factory.mktemp("tiny") / "llama", hidden=64, layers=2)


def _batch(vocab: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    ids = rng.integers(0, vocab, (4, 32), dtype=np.int32)
    return {
        "input_ids": ids,
        "loss_mask": np.ones_like(ids),
        "segment_ids": np.ones_like(ids),
        "positions": np.broadcast_to(np.arange(32, dtype=np.int32), ids.shape).copy(),
    }


def first_step(model_dir, device, dtype, use_lora: bool) -> dict[str, np.ndarray]:
    """Logits of a batch, then the loss and grad norm of posttrain's first SFT step, and
    16 greedy tokens, all on `device`."""
    mesh = models.make_mesh(devices=[device])
    with jax.set_mesh(mesh):
        model, info = models.load_model(
            model_dir, mesh=mesh, dtype=dtype if use_lora else jnp.float32, compute_dtype=dtype
        )
        wrt = nnx.Param
        if use_lora:
            model = lora.apply_lora(model, 4, 8.0, None, mesh)
            wrt = nnx.LoRAParam
        batch = {k: jax.device_put(v, device) for k, v in _batch(info.vocab_size).items()}
        logits = np.asarray(models.forward(model, batch["input_ids"]))
        tokens = models.greedy_generate(model, None, [1, 2, 3, 4], 16).token_ids
        opt = nnx.Optimizer(model, optim.optimizer(TrainingSpec()), wrt=wrt)
        loss, grad_norm, _, _ = sft.make_train_step(wrt, 1)(model, opt, batch)
        return {
            "logits": logits,
            "loss": np.asarray(loss),
            "grad_norm": np.asarray(grad_norm),
            "tokens": np.asarray(tokens),
        }


def _rel(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-30))


@pytest.mark.parametrize("use_lora", [False, True], ids=["full", "lora"])
def test_float32_on_the_tpu_is_the_cpu(model_dir, use_lora):
    with jax.default_matmul_precision("highest"):
        tpu = first_step(model_dir, jax.devices("tpu")[0], jnp.float32, use_lora)
        cpu = first_step(model_dir, jax.devices("cpu")[0], jnp.float32, use_lora)
    print(
        f"float32 {'lora' if use_lora else 'full'}: logits rel {_rel(tpu['logits'], cpu['logits']):.2e}, "
        f"loss {tpu['loss']:.7f} vs {cpu['loss']:.7f}, grad norm rel "
        f"{_rel(tpu['grad_norm'], cpu['grad_norm']):.2e}"
    )
    assert _rel(tpu["logits"], cpu["logits"]) <= 1e-5
    assert _rel(tpu["loss"], cpu["loss"]) <= 1e-5
    assert _rel(tpu["grad_norm"], cpu["grad_norm"]) <= 1e-5
    assert tpu["tokens"].tolist() == cpu["tokens"].tolist()


def test_bfloat16_on_the_tpu_is_the_cpu_within_its_precision(model_dir):
    tpu = first_step(model_dir, jax.devices("tpu")[0], jnp.bfloat16, True)
    cpu = first_step(model_dir, jax.devices("cpu")[0], jnp.bfloat16, True)
    print(
        f"bfloat16 lora: logits rel {_rel(tpu['logits'], cpu['logits']):.2e}, "
        f"loss {tpu['loss']:.5f} vs {cpu['loss']:.5f}"
    )
    assert _rel(tpu["loss"], cpu["loss"]) <= BF16_LOSS_RTOL
    assert _rel(tpu["logits"], cpu["logits"]) <= BF16_LOGITS_RTOL
