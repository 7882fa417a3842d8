"""The memory estimate (posttrain.capacity) against XLA's own figures: the trainer's real
SFT step (full fine-tune, float32 masters, bfloat16 compute, AdamW), compiled ahead of
time from abstract shapes on one CPU device, and `compiled.memory_analysis()`.

Few layers and a small width keep compiles short; one case doubles the layers to show
the per-layer memory (XLA's and the estimate's) grows linearly.
"""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import optax
import pytest
from flax import nnx

from posttrain import capacity, catalog
from posttrain.api.spec import PostTrainJobSpec
from posttrain.trainer import models, sft
from posttrain.trainer.mesh import make_mesh
from posttrain.trainer.models import families, loading

BASE = dict(layers=2, vocab=1024, length=256, batch=4)
CASES = {
    "base": BASE,
    "more-layers": {**BASE, "layers": 4},
    "long-large-vocab": {**BASE, "vocab": 4096, "length": 512},
}


def _config(layers: int, vocab: int) -> dict:
    return {"model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"], "hidden_size": 256,
            "num_hidden_layers": layers, "num_attention_heads": 4, "num_key_value_heads": 2,
            "head_dim": 64, "intermediate_size": 512, "vocab_size": vocab,
            "tie_word_embeddings": True, "rms_norm_eps": 1e-6, "rope_theta": 1e6,
            "hidden_act": "silu"}  # fmt: skip


def xla_bytes(model_dir, batch: int, length: int) -> int:
    """Peak bytes of one device for the compiled step: arguments, temporaries and the
    outputs that do not reuse a donated argument."""
    mesh = make_mesh(1, 1, jax.devices()[:1])
    info, extras = models.model_info(
        model_dir, family="qwen3", dtype=jnp.float32, compute_dtype=jnp.bfloat16
    )
    cls = families.model_class("qwen3")

    def build():
        model = cls(info.config, rngs=nnx.Rngs(params=0))
        return model, nnx.Optimizer(model, optax.adamw(1e-4), wrt=nnx.Param)

    with jax.set_mesh(mesh):
        model, opt = nnx.eval_shape(build)
        loading._configure(model, info, extras)
        step = sft.make_train_step(nnx.Param, 1)
        keys = ("input_ids", "loss_mask", "segment_ids", "positions")
        batch_shape = {k: jax.ShapeDtypeStruct((batch, length), jnp.int32) for k in keys}
        memory = step.lower(model, opt, batch_shape).compile().memory_analysis()
    return (
        memory.argument_size_in_bytes
        + memory.temp_size_in_bytes
        + memory.output_size_in_bytes
        - memory.alias_size_in_bytes
    )


def estimate_bytes(model_dir, batch: int, length: int) -> float:
    spec = PostTrainJobSpec.model_validate(
        {
            "model": {"source": str(model_dir), "dtype": "bfloat16"},
            "data": {"source": "/d.jsonl", "maxLength": length},
            "training": {"batchSize": batch},
            "output": {"uri": "/out"},
            "resources": {"accelerator": "v6e-8"},
        }
    )
    est = capacity.estimate(spec, catalog.resolve("v6e-8"), capacity.Layout(1, 1))
    assert est.shape.origin == "config.json"
    return est.total_gib * capacity.GIB


@pytest.fixture(scope="module")
def measured(tmp_path_factory):
    out = {}
    for name, case in CASES.items():
        model_dir = tmp_path_factory.mktemp(name)
        (model_dir / "config.json").write_text(json.dumps(_config(case["layers"], case["vocab"])))
        out[name] = (
            xla_bytes(model_dir, case["batch"], case["length"]),
            estimate_bytes(model_dir, case["batch"], case["length"]),
        )
    return out


@pytest.mark.parametrize("name", CASES)
def test_estimate_is_within_a_quarter_of_xla_and_never_far_below(measured, name):
    xla, est = measured[name]
    assert 0.9 * xla <= est <= 1.25 * xla, (name, xla, est)


def test_per_layer_memory_is_linear_in_both(measured):
    (xla2, est2), (xla4, est4) = measured["base"], measured["more-layers"]
    layer_xla, layer_est = (xla4 - xla2) / 2, (est4 - est2) / 2
    assert 0.75 * layer_xla <= layer_est <= 1.25 * layer_xla, (layer_xla, layer_est)
