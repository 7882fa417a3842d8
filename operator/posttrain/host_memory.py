"""Host memory of a CPU job (spec.resources.accelerator: cpu, or `posttrain run` on a
laptop): what `posttrain estimate` prints where `posttrain.capacity` has no accelerator.

On CPU, JAX's one device is the host, so the trainer's arrays are the terms
`capacity.estimate` counts for one device (with remat as the trainer applies it on CPU:
auto is none), in host memory. Beside them the process holds what an accelerator job
keeps off the device:

- runtime: Python, JAX, XLA and the tokenizer (RUNTIME_GIB, measured before a model loads);
- compile: what XLA's compiled programs keep (COMPILE_PER_LAYER_GIB a decoder layer of
  the unrolled model, a third of that for a distillation teacher's forward-only layers,
  plus COMPILE_GIB);
- loading: while a checkpoint loads, its safetensors file is read beside the arrays it
  fills (one more copy of the weights at the start, never at the same time as a step's
  activations: the larger of the two counts).

The constants are fitted to the CPU examples' peak resident sizes (docs/user-guide.md,
"Running locally"), which the total is within 18% of for SFT, DPO and distillation on
SmolLM2-135M, and GRPO at one prompt a step without remat (+15%). GRPO at two prompts a
step with remat layer, the example now, peaks 23% above it (2.87 against 3.52 GiB): the
sampler's and the log-prob passes' programs are not terms of their own yet.
"""

from __future__ import annotations

import dataclasses
import os

from posttrain import capacity, catalog
from posttrain.api import model_shapes
from posttrain.api.kube_values import parse_quantity
from posttrain.api.spec import PostTrainJobSpec
from posttrain.catalog import Placement

# Fitted to the CPU examples' measured peaks (docs/user-guide.md, "Running locally"):
# the runtime is the resident size before a model loads; the compile terms hold what
# the examples' compiled programs (train step, evaluation, sampler) keep beside their
# arrays, and cover the estimate's arrays falling short of XLA's CPU buffers.
RUNTIME_GIB = 0.35
COMPILE_GIB = 0.3
COMPILE_PER_LAYER_GIB = 0.03


@dataclasses.dataclass(frozen=True)
class HostEstimate:
    device: capacity.MemoryEstimate  # the arrays, term by term
    runtime_gib: float
    compile_gib: float
    loading_gib: float  # the checkpoint read while it loads
    available_gib: float  # spec.resources.memory, else this machine's memory
    available_from: str

    @property
    def arrays_gib(self) -> float:
        return self.device.total_gib

    @property
    def total_gib(self) -> float:
        """The peak: runtime and compile, plus the larger of the training arrays and the
        loading peak (the weights and the checkpoint being read)."""
        weights = self.device.terms.get("weights", 0.0) + self.device.terms.get(
            "reference/teacher", 0.0
        )
        return (
            self.runtime_gib + self.compile_gib + max(self.arrays_gib, weights + self.loading_gib)
        )

    @property
    def fits(self) -> bool:
        return self.total_gib <= self.available_gib

    def table(self) -> str:
        d = self.device
        lines = [
            f"{d.source}: {d.shape.params / 1e9:.2f}B parameters, {d.shape.layers} layers, "
            f"vocabulary {d.shape.vocab} ({d.origin})",
            f"cpu (host memory): {d.rows:g} rows x {d.length} tokens per micro-batch, "
            f"remat {d.remat}",
            "host memory:",
        ]
        lines += [f"  {name:<18}{d.terms.get(name, 0.0):8.2f} GiB" for name in capacity.TERMS]
        lines += [
            f"  {'runtime':<18}{self.runtime_gib:8.2f} GiB",
            f"  {'compile':<18}{self.compile_gib:8.2f} GiB",
            f"  {'loading':<18}{self.loading_gib:8.2f} GiB (at the start, not with the step)",
            f"  {'peak':<18}{self.total_gib:8.2f} GiB of {self.available_gib:.1f} GiB "
            f"({self.available_from}, {self.total_gib / self.available_gib:.0%})",
        ]
        return "\n".join(lines)


def machine_memory_gib() -> float:
    """This machine's physical memory (0 where the OS does not say)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / capacity.GIB
    except (ValueError, OSError, AttributeError):
        return 0.0


def estimate(spec: PostTrainJobSpec, placement: Placement) -> HostEstimate | None:
    """The host memory of a CPU job; None for an accelerator job or an unknown shape."""
    if placement.kind != "cpu":
        return None
    training = spec.training
    if str(training.remat) == "auto":  # the trainer's CPU choice (models.resolve_remat)
        training = training.model_copy(update={"remat": "none"})
    cpu_spec = spec.model_copy(update={"training": training})
    if spec.resources.memory:
        available = float(parse_quantity(spec.resources.memory)) / capacity.GIB
        available_from = "spec.resources.memory"
    else:
        available, available_from = machine_memory_gib(), "this machine"
    host = dataclasses.replace(
        placement, kind="host", devices_per_host=1, memory_gib_per_device=max(1, available)
    )
    device = capacity.estimate(cpu_spec, host, capacity.Layout(1, 1))
    if device is None:
        return None
    layers, read = device.shape.layers, device.shape.params
    if spec.technique == "distill":  # the teacher's forward compiles into the step
        teacher = spec.distill.teacher
        shape = model_shapes.shape(teacher.source, teacher.layers) or device.shape
        layers, read = layers + shape.layers / 3, max(read, shape.params)
    loading = read * 4 / capacity.GIB  # one checkpoint's float32 read at a time
    return HostEstimate(
        device=device,
        runtime_gib=RUNTIME_GIB,
        compile_gib=COMPILE_GIB + COMPILE_PER_LAYER_GIB * layers,
        loading_gib=loading,
        available_gib=available,
        available_from=available_from,
    )


SKIP_ENV = "POSTTRAIN_SKIP_MEMORY_CHECK"  # =1: `posttrain run` a job the estimate refuses


def on_this_machine(spec: PostTrainJobSpec) -> tuple[str, str | None]:
    """What `posttrain run` does about a job's host memory when JAX runs on this
    machine's CPU, as admission does on a cluster: ("refuse", why) when the estimate is
    more than capacity.BAND above this machine's memory, ("warn", why) within BAND of it,
    else ("fit", None); also "fit" for a model of no known shape. spec.resources.memory
    (a pod's) does not count here: this machine's does."""
    local = spec.model_copy(
        update={"resources": spec.resources.model_copy(update={"memory": None})}
    )
    est = estimate(local, catalog.resolve("cpu", None))
    if est is None or est.available_gib <= 0:
        return "fit", None
    need = (
        f"the job needs about {est.total_gib:.1f} GiB of host memory (posttrain estimate), "
        f"{est.total_gib / est.available_gib:.0%} of this machine's {est.available_gib:.1f} GiB"
    )
    if est.total_gib > capacity.REFUSE_ABOVE * est.available_gib:
        return "refuse", (
            f"spec.resources.accelerator: {need}; try LoRA, a smaller "
            "spec.training.batchSize or spec.data.maxLength, or spec.training.remat: layer "
            f"({SKIP_ENV}=1 runs it anyway)"
        )
    if est.total_gib > capacity.WARN_ABOVE * est.available_gib:
        return "warn", f"{need}: within the estimate's {capacity.BAND:.0%} of what it has"
    return "fit", None
