"""XLA's own memory figure for a job's train step: the step the trainer runs
(``sft``/``dpo``/``distill``/``grpo_step.make_train_step`` with spec.training's optimizer from
``optim.optimizer``, clipping included, its gradient accumulation, its reference model or
teacher, spec.training.remat as on an accelerator, spec.lora's adapters), compiled ahead
of time from abstract arrays (``jax.ShapeDtypeStruct`` params, optimizer state and batch,
each with the sharding the trainer gives it) over a ``dp`` x ``fsdp`` mesh, and
``compiled.memory_analysis()`` of one device. Nothing is allocated and no weights are read:
spec.model.source (and a distillation teacher's source) must be a local directory with a
config.json.

tests/trainer/test_capacity_xla.py holds ``posttrain.capacity.estimate`` against this at
small sizes, bench/memory.py at published shapes and full depth (on CPU devices), and
bench/device_memory.py on a real accelerator.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from posttrain.api.spec import DpoSpec, PostTrainJobSpec
from posttrain.trainer import compile_figures, models, optim
from posttrain.trainer.mesh import AXES, BATCH_AXES
from posttrain.trainer.models import attention as attention_lib
from posttrain.trainer.policy import DTYPES, apply_layer_loop


def peak_bytes(memory: dict[str, int]) -> int:
    """The per-device peak of a memory_analysis(): arguments, temporaries and outputs,
    less the outputs that reuse (alias) a donated argument's buffer."""
    return memory["argument"] + memory["temp"] + memory["output"] - memory["alias"]


def mesh_of(slices: int, per_slice: int, devices: list[Any] | None = None) -> jax.sharding.Mesh:
    """A (dp, fsdp, tp) = (slices, per_slice, 1) mesh over the first devices (simulated
    CPU devices know no slices, so the trainer's make_mesh would put them in one)."""
    devices = list(devices if devices is not None else jax.devices())[: slices * per_slice]
    grid = np.empty(len(devices), dtype=object)
    grid[:] = devices
    return jax.sharding.Mesh(
        grid.reshape(slices, per_slice, 1), AXES, axis_types=(jax.sharding.AxisType.Auto,) * 3
    )


def _abstract(tree: Any, mesh: jax.sharding.Mesh, dtype: Any = None) -> Any:
    """Each leaf of an nnx state as a ShapeDtypeStruct with its annotated sharding, as the
    trainer places it (axes that do not divide a dimension dropped); with `dtype`, every
    floating-point leaf in it, as the loader casts each weight it reads (Tunix's Llama 3
    config carries no parameter dtype: its abstract model is float32 whatever the job's)."""

    def place(x, spec):
        if not hasattr(x, "shape"):
            return x
        fitted = models.fit_spec(tuple(spec), tuple(x.shape), mesh)
        sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(*fitted))
        kind = x.dtype
        if dtype is not None and jnp.issubdtype(kind, jnp.floating):
            kind = dtype
        return jax.ShapeDtypeStruct(x.shape, kind, sharding=sharding)

    specs = nnx.get_partition_spec(tree)
    is_spec = lambda x: isinstance(x, jax.sharding.PartitionSpec)  # noqa: E731
    return jax.tree.map(place, tree, specs, is_leaf=is_spec)


def _model(source: str, mesh, dtype, compute, remat: str, layers=None, family="auto", vision=False,
           attention="dense"):  # fmt: skip
    info, extras = models.model_info(
        source, family=family, dtype=dtype, compute_dtype=compute, num_layers=layers,
        vision=vision, remat=remat,
    )  # fmt: skip
    model = models.abstract_model(info, extras, mesh, _kernel(attention, info, mesh))
    nnx.update(model, _abstract(nnx.state(model), mesh, info.dtype))
    return model, info


def _kernel(attention: str, info: models.ModelInfo, mesh: jax.sharding.Mesh) -> str:
    """spec.training.attention's kernel on the mesh's platform (a TPU compile: splash where
    the trainer would run it); dense where the platform has none (XLA:CPU's figures for
    an accelerator job)."""
    platform = mesh.devices.flat[0].platform
    try:
        return attention_lib.resolve(
            attention, family=info.family, platform=platform, vision=info.vision is not None
        )
    except ValueError:
        return "dense"


def remat_on_accelerator(spec: PostTrainJobSpec) -> str:
    """spec.training.remat as the trainer applies it on a TPU or GPU (auto: layer)."""
    remat = str(spec.training.remat)
    return "layer" if remat == "auto" else remat


def compiled_memory(spec: PostTrainJobSpec, mesh: jax.sharding.Mesh) -> dict[str, int]:
    """memory_analysis() of one device for the job's compiled train step on `mesh`."""
    return memory_of(compile_step(spec, mesh))


def memory_of(compiled: Any) -> dict[str, int]:
    """A compiled program's memory_analysis() of one device, as a dict of bytes."""
    memory = compiled.memory_analysis()
    return {
        "argument": memory.argument_size_in_bytes,
        "output": memory.output_size_in_bytes,
        "alias": memory.alias_size_in_bytes,
        "temp": memory.temp_size_in_bytes,
        "peak": getattr(memory, "peak_memory_in_bytes", 0),  # the compiler's own (TPU)
    }


def compile_step(spec: PostTrainJobSpec, mesh: jax.sharding.Mesh) -> Any:
    """The job's train step compiled ahead of time for `mesh`'s devices (simulated CPU
    devices, a real accelerator's, or compile-only TPU devices: nothing runs on them)."""
    return compile_built(*build(spec, mesh), mesh)


def compile_built(step: Any, args: tuple, mesh: jax.sharding.Mesh) -> Any:
    """What ``build`` returned, compiled for `mesh`'s devices."""
    with jax.set_mesh(mesh):
        return compile_figures.compile(step.lower(*args), mesh)


def build(spec: PostTrainJobSpec, mesh: jax.sharding.Mesh) -> tuple[Any, tuple]:
    """The job's jitted train step and its abstract arguments on `mesh` (model, optimizer,
    reference or teacher, batch): ``step.lower(*args)`` under ``jax.set_mesh(mesh)``
    compiles what the trainer runs. Only traces: no array is made on mesh's devices."""
    from posttrain.trainer import distill, dpo, grpo_step, lora, sft
    from posttrain.trainer.models import vision as vision_lib

    t, technique = spec.training, str(spec.technique)
    remat = remat_on_accelerator(spec)
    compute = DTYPES[spec.model.dtype]
    rows = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(BATCH_AXES))

    def arrays(shapes: dict) -> dict:
        return {k: jax.ShapeDtypeStruct(s, d, sharding=rows) for k, (s, d) in shapes.items()}

    src, family, layers = spec.model.source, spec.model.family, spec.model.layers
    images = spec.data.columns.images is not None
    with jax.set_mesh(mesh):
        attention = str(t.attention)
        model, info = _model(src, mesh, compute if spec.lora else jnp.float32, compute, remat,
                             layers, family, images, attention)  # fmt: skip
        wrt: Any = nnx.Param
        if images:
            wrt = vision_lib.full_finetune_params(t.train_vision_tower)
            if t.train_vision_tower:
                vision_lib.unfreeze_tower(model)
        if spec.lora:
            model = lora.apply_lora(
                model, spec.lora.rank, spec.lora.alpha, spec.lora.target_modules, mesh,
                abstract=True,
            )  # fmt: skip
            wrt = nnx.LoRAParam
        apply_layer_loop(spec, model, info.family, mesh)
        opt = nnx.eval_shape(lambda m: nnx.Optimizer(m, optim.optimizer(t), wrt=wrt), model)
        nnx.update(opt, _abstract(nnx.state(opt), mesh))

        def frozen() -> nnx.Module:
            ref = _model(src, mesh, compute, compute, remat, layers, family, False, attention)[0]
            return apply_layer_loop(spec, ref, info.family, mesh)

        i32, n, length = jnp.int32, t.batch_size, spec.data.max_length
        sft_keys = ("input_ids", "loss_mask", "segment_ids", "positions")
        if technique in ("sft", "distill"):
            shapes = {k: ((n, length), i32) for k in sft_keys}
            if images:
                vi = info.vision  # one image a row
                shapes["images"] = ((n, 1, vi.image_size, vi.image_size, vi.num_channels),
                                    jnp.float32)  # fmt: skip
            if technique == "sft":
                step, args = sft.make_train_step(wrt, t.gradient_accumulation), ()
            else:
                d = spec.distill
                teacher, teacher_info = _model(d.teacher.source, mesh, DTYPES[d.teacher.dtype],
                                 DTYPES[d.teacher.dtype], remat, d.teacher.layers,
                                 d.teacher.family, False, attention)  # fmt: skip
                apply_layer_loop(spec, teacher, teacher_info.family, mesh)
                step = distill.make_train_step(
                    wrt, float(d.temperature), float(d.alpha), t.gradient_accumulation
                )
                args = (teacher,)
            args = (*args, arrays(shapes))
        elif technique == "dpo":
            settings = spec.dpo or DpoSpec()
            reference = "none"
            if str(settings.algorithm) == "dpo":
                reference = "lora" if spec.lora else "model"
            prompt = min(settings.max_prompt_length, length // 2)
            parts = {"prompt": prompt, "chosen": length - prompt, "rejected": length - prompt}
            shapes = {f"{p}_{k}": ((n, size), i32) for p, size in parts.items()
                      for k in ("ids", "mask")}  # fmt: skip
            step = dpo.make_train_step(wrt, settings, t.gradient_accumulation, reference)
            args = (frozen() if reference == "model" else None, arrays(shapes))
        else:
            from tunix.rl.grpo import grpo_learner

            g = spec.grpo
            config = grpo_learner.GRPOConfig(
                num_generations=g.num_generations, num_iterations=1, beta=g.beta,
                epsilon=g.epsilon, loss_algo=str(g.loss_algorithm), kl_loss_mode="low_var_kl",
            )  # fmt: skip
            config.temperature = g.temperature
            use_ref = "none" if g.beta == 0 else ("lora" if spec.lora else "model")
            reference = frozen() if use_ref == "model" else None
            step = grpo_step.make_train_step(wrt, config, 0, 1, t.gradient_accumulation, use_ref)
            rows_n = n * g.num_generations
            shapes = {
                "prompt_ids": ((rows_n, g.max_prompt_length), i32),
                "completion_ids": ((rows_n, g.max_completion_length), i32),
                "completion_mask": ((rows_n, g.max_completion_length), i32),
                "advantages": ((rows_n,), jnp.float32),
                "rewards": ((rows_n, max(1, len(g.rewards))), jnp.float32),
            }
            args = (reference, arrays(shapes))
    return step, (model, opt, *args)
