"""The memory estimate (posttrain.capacity) against XLA's own figures: the trainer's real
train steps (SFT full fine-tune and LoRA, DPO with its frozen reference, GRPO's update
with its reference), compiled ahead of time from abstract shapes (``ShapeDtypeStruct``
parameters, optimizer state and batch, each with the sharding the trainer gives it) on
simulated 1-, 4- and 8-device CPU meshes, and ``compiled.memory_analysis()`` per device.

Every compile runs in a child process with 8 CPU devices (XLA_FLAGS must be set before
jax starts), the rematerialised steps (spec.training.remat: layer) in a second one with
XLA's memory-minimising CPU scheduler; a 1- or 4-device mesh takes the first devices. Few layers and a small width
keep compiles short: the matrix varies one thing at a time (technique, LoRA, devices,
sequence length, vocabulary) rather than taking every combination, and one case doubles
the layers to show that the per-layer memory (XLA's and the estimate's) grows linearly,
which is what carries the estimate to full-size models.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from posttrain.trainer.cpu_flags import MEMORY_SCHEDULER

DEVICES = 8
# technique, lora, devices, layers, vocab, length, batch (SFT rows, DPO pairs, GRPO prompts)
# [, spec.training.remat (default none)]
CASES = {
    "sft-1dev": ("sft", False, 1, 2, 1024, 256, 8),
    "sft-1dev-4layers": ("sft", False, 1, 4, 1024, 256, 8),
    "sft-8dev-long-large-vocab": ("sft", False, 8, 2, 16384, 1024, 8),
    "lora-4dev-long-large-vocab": ("sft", True, 4, 2, 16384, 1024, 8),
    "dpo-8dev": ("dpo", False, 8, 2, 1024, 256, 8),
    "grpo-4dev": ("grpo", False, 4, 2, 4096, 256, 2),
    # spec.training.remat: layer, long enough that the attention dominates a layer
    "sft-1dev-remat": ("sft", False, 1, 2, 4096, 1024, 4, "layer"),
    "sft-1dev-4layers-remat": ("sft", False, 1, 4, 4096, 1024, 4, "layer"),
}
GENERATIONS = 4
# XLA's default CPU scheduler orders for concurrency and so computes a rematerialised
# layer's recomputation as early as it can (the step then needs what it would without
# remat), where an accelerator's memory-aware scheduler waits for the backward pass:
# rematerialised steps are compiled in a second child with the memory-minimising one.
REMAT_XLA_FLAGS = MEMORY_SCHEDULER  # what `posttrain run` and `posttrain train` set


def _config(layers: int, vocab: int) -> dict:
    return {"model_type": "qwen3", "architectures": ["Qwen3ForCausalLM"], "hidden_size": 256,
            "num_hidden_layers": layers, "num_attention_heads": 4, "num_key_value_heads": 2,
            "head_dim": 64, "intermediate_size": 512, "vocab_size": vocab,
            "tie_word_embeddings": True, "rms_norm_eps": 1e-6, "rope_theta": 1e6,
            "hidden_act": "silu"}  # fmt: skip


def _spec(case: tuple, model_dir: Path):
    from posttrain.api.spec import PostTrainJobSpec

    technique, lora, _, _, _, length, batch, *rest = case
    spec = {
        "technique": technique,
        "model": {"source": str(model_dir), "dtype": "bfloat16"},
        "data": {"source": "/d.jsonl", "maxLength": length},
        "training": {"batchSize": batch, "remat": rest[0] if rest else "none"},
        "output": {"uri": "/out"},
        "resources": {"accelerator": "v6e-8"},
    }
    if lora:
        spec["lora"] = {"rank": 16}
    if technique == "dpo":
        spec["dpo"] = {"maxPromptLength": length // 2}
    if technique == "grpo":
        spec["grpo"] = {
            "numGenerations": GENERATIONS,
            "maxPromptLength": length // 2,
            "maxCompletionLength": length // 2,
            "rewards": [{"type": "exactAnswer"}],
        }
    return PostTrainJobSpec.model_validate(spec)


# ------------------------------------------------------------ the child: XLA's figures


def _abstract(tree, mesh):
    """Each leaf of an nnx state as a ShapeDtypeStruct with its annotated sharding, as
    the trainer places it (axes that do not divide a dimension dropped)."""
    import jax
    from flax import nnx

    from posttrain.trainer import models

    def place(x, spec):
        if not hasattr(x, "shape"):
            return x
        fitted = models.fit_spec(tuple(spec), tuple(x.shape), mesh)
        sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(*fitted))
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding)

    specs = nnx.get_partition_spec(tree)
    is_spec = lambda x: isinstance(x, jax.sharding.PartitionSpec)  # noqa: E731
    return jax.tree.map(place, tree, specs, is_leaf=is_spec)


def _model(model_dir: str, mesh, dtype, compute, remat: str = "none"):
    from flax import nnx

    from posttrain.trainer import models

    info, extras = models.model_info(
        model_dir, family="qwen3", dtype=dtype, compute_dtype=compute, remat=remat
    )
    model = models.abstract_model(info, extras, mesh)
    nnx.update(model, _abstract(nnx.state(model), mesh))
    return model


def xla_bytes(case: tuple, model_dir: str) -> dict[str, int]:
    """memory_analysis() of one device for the case's compiled train step."""
    import jax
    import jax.numpy as jnp
    import optax
    from flax import nnx

    from posttrain.trainer import dpo, grpo, sft
    from posttrain.trainer import lora as lora_lib
    from posttrain.trainer.mesh import BATCH_AXES, make_mesh

    technique, lora, devices, _, _, length, batch, *rest = case
    remat = rest[0] if rest else "none"
    mesh = make_mesh(devices, 1, jax.devices()[:devices])
    rows = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(BATCH_AXES))

    def arrays(shapes: dict) -> dict:
        return {k: jax.ShapeDtypeStruct(s, d, sharding=rows) for k, (s, d) in shapes.items()}

    with jax.set_mesh(mesh):
        dtype = jnp.bfloat16 if lora else jnp.float32
        model = _model(model_dir, mesh, dtype, jnp.bfloat16, remat)
        wrt = nnx.Param
        if lora:
            model = lora_lib.apply_lora(model, 16, 16.0, None, mesh)
            wrt = nnx.LoRAParam
        opt = nnx.eval_shape(lambda m: nnx.Optimizer(m, optax.adamw(1e-4), wrt=wrt), model)
        nnx.update(opt, _abstract(nnx.state(opt), mesh))
        reference = None if lora else _model(model_dir, mesh, jnp.bfloat16, jnp.bfloat16)
        i32, half = jnp.int32, length // 2
        if technique == "sft":
            step = sft.make_train_step(wrt, 1)
            keys = ("input_ids", "loss_mask", "segment_ids", "positions")
            args = (arrays({k: ((batch, length), i32) for k in keys}),)
        elif technique == "dpo":
            from posttrain.api.spec import DpoSpec

            step = dpo.make_train_step(wrt, DpoSpec(), 1, "lora" if lora else "model")
            shapes = {f"{p}_{k}": ((batch, half), i32) for p in ("prompt", "chosen", "rejected")
                      for k in ("ids", "mask")}  # fmt: skip
            args = (reference, arrays(shapes))
        else:
            from tunix.rl.grpo import grpo_learner

            config = grpo_learner.GRPOConfig(
                num_generations=GENERATIONS, num_iterations=1, beta=0.04, epsilon=0.2,
                loss_algo="grpo", kl_loss_mode="low_var_kl",
            )  # fmt: skip
            config.temperature = 0.9
            step = grpo.make_train_step(wrt, config, 0, 1, 1, "lora" if lora else "model")
            n = batch * GENERATIONS
            shapes = {
                "prompt_ids": ((n, half), i32),
                "completion_ids": ((n, half), i32),
                "completion_mask": ((n, half), i32),
                "advantages": ((n,), jnp.float32),
                "rewards": ((n, 1), jnp.float32),
            }
            args = (reference, arrays(shapes))
        memory = step.lower(model, opt, *args).compile().memory_analysis()
    return {
        "argument": memory.argument_size_in_bytes,
        "output": memory.output_size_in_bytes,
        "alias": memory.alias_size_in_bytes,
        "temp": memory.temp_size_in_bytes,
    }


def _child(work: Path, group: str) -> None:
    cases = json.loads((work / f"cases-{group}.json").read_text())
    out = {name: xla_bytes(tuple(case), model_dir) for name, (case, model_dir) in cases.items()}
    (work / f"xla-{group}.json").write_text(json.dumps(out))


# ------------------------------------------------------------------------- the tests


@pytest.fixture(scope="module")
def measured(tmp_path_factory):
    """{case: (XLA's peak bytes per device, the estimate's bytes per device)}."""
    from posttrain import capacity, catalog

    work = tmp_path_factory.mktemp("capacity-xla")
    dirs = {}
    for case in CASES.values():
        layers, vocab = case[3], case[4]
        if (layers, vocab) not in dirs:
            model_dir = work / f"qwen3-{layers}x-{vocab}"
            model_dir.mkdir()
            (model_dir / "config.json").write_text(json.dumps(_config(layers, vocab)))
            dirs[layers, vocab] = model_dir
    xla = {}
    for group, flags in (("plain", ""), ("remat", REMAT_XLA_FLAGS)):
        todo = {
            name: (case, str(dirs[case[3], case[4]]))
            for name, case in CASES.items()
            if (len(case) > 7) == (group == "remat")
        }
        (work / f"cases-{group}.json").write_text(json.dumps(todo))
        env = dict(os.environ, JAX_PLATFORMS="cpu")
        env["XLA_FLAGS"] = (
            f"{env.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={DEVICES} {flags}"
        ).strip()
        run = subprocess.run(
            [sys.executable, __file__, str(work), group], env=env, capture_output=True, text=True
        )
        assert run.returncode == 0, run.stderr[-4000:]
        xla |= json.loads((work / f"xla-{group}.json").read_text())
    out = {}
    for name, case in CASES.items():
        spec = _spec(case, dirs[case[3], case[4]])
        est = capacity.estimate(spec, catalog.resolve("v6e-8"), capacity.Layout(1, case[2]))
        assert est is not None and est.shape.origin == "config.json"
        m = xla[name]
        peak = m["argument"] + m["temp"] + m["output"] - m["alias"]
        out[name] = (peak, est.total_gib * capacity.GIB)
    return out


@pytest.mark.parametrize("name", CASES)
def test_estimate_is_within_a_quarter_of_xla(measured, name):
    xla, est = measured[name]
    assert 0.75 * xla <= est <= 1.25 * xla, (name, xla, est, est / xla)


@pytest.mark.parametrize("remat", ["", "-remat"])
def test_per_layer_memory_is_linear_in_both(measured, remat):
    (xla2, est2), (xla4, est4) = measured[f"sft-1dev{remat}"], measured[f"sft-1dev-4layers{remat}"]
    layer_xla, layer_est = (xla4 - xla2) / 2, (est4 - est2) / 2
    assert 0.75 * layer_xla <= layer_est <= 1.25 * layer_xla, (layer_xla, layer_est)


if __name__ == "__main__":
    _child(Path(sys.argv[1]), sys.argv[2])
