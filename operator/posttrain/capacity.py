"""Will a job fit in accelerator memory? A pure, deliberately rough estimate.

The parameter count comes from the model name (Qwen3-8B, SmolLM2-135M, gemma-3-1b...);
when the name carries none, no estimate is made. Per device:

    state       = params x bytes/param, sharded over every device (FSDP)
                  full fine-tune: weights + gradients in the model dtype, fp32 Adam
                  moments and (for 16-bit weights) an fp32 master copy;
                  LoRA: frozen weights only (adapters are small)
    activations = tokens per device x hidden x layers x 34 bytes (no rematerialisation),
                  with hidden and layers inferred from params (params ~ 12 x layers x hidden^2,
                  layers ~ hidden / 128)
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from posttrain.api.spec import PostTrainJobSpec
from posttrain.catalog import Placement

GIB = 1024**3
_SIZE = re.compile(r"(?<![\w.])(\d+(?:\.\d+)?)\s*([bBmM])(?![a-zA-Z])")
_DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}


def params_from_name(source: str) -> float | None:
    """Parameter count written in a model name: 'Qwen3-0.6B' -> 6e8; None if absent."""
    matches = _SIZE.findall(source.rsplit("/", 1)[-1]) or _SIZE.findall(source)
    if not matches:
        return None
    value, unit = matches[-1]
    return float(value) * (1e9 if unit in "bB" else 1e6)


@dataclass(frozen=True)
class MemoryEstimate:
    params: float
    devices: int
    state_gib: float
    activations_gib: float
    available_gib: float

    @property
    def total_gib(self) -> float:
        return self.state_gib + self.activations_gib

    @property
    def fits(self) -> bool:
        return self.total_gib <= self.available_gib

    def explain(self) -> str:
        return (
            f"{self.params / 1e9:.2f}B parameters need about {self.total_gib:.1f} GiB per device "
            f"({self.state_gib:.1f} GiB weights/gradients/optimizer over {self.devices} devices + "
            f"{self.activations_gib:.1f} GiB activations), but each device has "
            f"{self.available_gib:.0f} GiB"
        )


def estimate(spec: PostTrainJobSpec, placement: Placement) -> MemoryEstimate | None:
    """None for CPU jobs or when the model name gives no size."""
    params = params_from_name(spec.model.source)
    if params is None or placement.kind == "cpu" or not placement.memory_gib_per_device:
        return None
    res = spec.resources
    hosts = placement.hosts * res.slices if placement.is_tpu else res.nodes
    devices = max(1, hosts * placement.devices_per_host)
    width = _DTYPE_BYTES[spec.model.dtype]
    if spec.lora is None:
        per_param = 2 * width + 8 + (4 if width < 4 else 0)
    else:
        per_param = width
    state = params * per_param / devices
    hidden = (params * 128 / 12) ** (1 / 3)
    layers = max(1.0, hidden / 128)
    micro_batch = spec.training.batch_size / spec.training.gradient_accumulation
    tokens = micro_batch * spec.data.max_length / devices
    activations = tokens * hidden * layers * 34
    return MemoryEstimate(
        params, devices, state / GIB, activations / GIB, float(placement.memory_gib_per_device)
    )
