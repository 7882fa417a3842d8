"""Accelerators posttrain can place a job on: TPU slices, NVIDIA GPUs and CPU.

Data tables plus pure functions. `resolve(accelerator, topology, gpus_per_node)` turns
the user's `spec.resources` into a `Placement` the renderer uses, or raises
`CatalogError` listing the valid choices.

TPU device names count TensorCores (v5p-128 = 64 chips); v5e and v6e have one core per
chip, v4, v5p and tpu7x two. A host has 4 chips, except 1-chip topologies.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

TPU_RESOURCE = "google.com/tpu"
GPU_RESOURCE = "nvidia.com/gpu"
TPU_ACCELERATOR_LABEL = "cloud.google.com/gke-tpu-accelerator"
TPU_TOPOLOGY_LABEL = "cloud.google.com/gke-tpu-topology"
GPU_ACCELERATOR_LABEL = "cloud.google.com/gke-accelerator"
NODEPOOL_LABEL = "cloud.google.com/gke-nodepool"


class CatalogError(ValueError):
    """An accelerator request that does not exist; the message lists valid choices."""


_CUBES = (
    "2x2x1",
    "2x2x2",
    "2x2x4",
    "2x4x4",
    "4x4x4",
    "4x4x8",
    "4x8x8",
    "8x8x8",
    "8x8x16",
    "8x16x16",
    "16x16x16",
    "16x16x24",
)
_PLANES = ("1x1", "2x2", "2x4", "4x4", "4x8", "8x8", "8x16", "16x16")


@dataclass(frozen=True)
class TpuGeneration:
    name: str  # as in the device name prefix: v6e, v5p, ...
    aliases: tuple[str, ...]
    cores_per_chip: int
    node_label: str  # value of cloud.google.com/gke-tpu-accelerator
    topologies: tuple[str, ...]
    pathways_type: str  # instance type prefix for pathways-rm, e.g. tpuv6e
    hbm_gib_per_chip: int
    bf16_tflops_per_chip: float


TPU_GENERATIONS: dict[str, TpuGeneration] = {
    g.name: g
    for g in (
        TpuGeneration("v4", (), 2, "tpu-v4-podslice", _CUBES[:-1], "tpuv4", 32, 275),
        TpuGeneration("v5e", ("v5litepod",), 1, "tpu-v5-lite-podslice", _PLANES, "tpuv5e", 16, 197),
        TpuGeneration("v5p", (), 2, "tpu-v5p-slice", _CUBES, "tpuv5", 95, 459),
        TpuGeneration("v6e", (), 1, "tpu-v6e-slice", _PLANES, "tpuv6e", 32, 918),
        TpuGeneration("tpu7x", (), 2, "tpu7x", _CUBES[:-1], "tpu7x", 192, 2307),
    )
}


@dataclass(frozen=True)
class GpuType:
    name: str  # value of cloud.google.com/gke-accelerator
    max_per_node: int
    memory_gib: int
    bf16_tflops: float


GPU_TYPES: dict[str, GpuType] = {
    g.name: g
    for g in (
        GpuType("nvidia-tesla-a100", 16, 40, 312),
        GpuType("nvidia-a100-80gb", 8, 80, 312),
        GpuType("nvidia-h100-80gb", 8, 80, 989),
        GpuType("nvidia-h100-mega-80gb", 8, 80, 989),
        GpuType("nvidia-h200-141gb", 8, 141, 989),
        GpuType("nvidia-b200", 8, 180, 2250),
        GpuType("nvidia-l4", 8, 24, 121),
    )
}


@dataclass(frozen=True)
class Placement:
    """Where each host of a job runs, resolved from spec.resources."""

    kind: str  # "tpu", "gpu" or "cpu"
    accelerator: str  # canonical name: v6e-256, nvidia-h100-80gb, cpu
    hosts: int  # hosts per slice (TPU) or 1 (GPU/CPU: nodes come from the spec)
    devices_per_host: int  # chips per TPU host, GPUs per node, 0 for CPU
    node_selector: dict[str, str]
    resource_name: str | None  # google.com/tpu, nvidia.com/gpu or None
    topology: str | None = None
    generation: str | None = None
    pathways_instance_type: str | None = None  # e.g. tpuv6e:16x16
    memory_gib_per_device: int = 0
    bf16_tflops_per_device: float = 0.0

    @property
    def is_tpu(self) -> bool:
        return self.kind == "tpu"


def _chips(topology: str) -> int:
    return math.prod(int(d) for d in topology.split("x"))


def tpu_device_names() -> list[str]:
    """Every valid TPU device name, e.g. v6e-256, v5p-128."""
    names = []
    for gen in TPU_GENERATIONS.values():
        for topo in gen.topologies:
            names.append(f"{gen.name}-{_chips(topo) * gen.cores_per_chip}")
    return sorted(set(names), key=lambda n: (n.split("-")[0], int(n.split("-")[1])))


def _generation(prefix: str) -> TpuGeneration | None:
    for gen in TPU_GENERATIONS.values():
        if prefix == gen.name or prefix in gen.aliases:
            return gen
    return None


def is_tpu_name(accelerator: str) -> bool:
    """True when the name looks like a TPU device name (a known generation prefix)."""
    m = re.fullmatch(r"([a-z0-9]+)-(\d+)", accelerator)
    return bool(m and _generation(m.group(1)))


def _valid_choices() -> str:
    tpus = ", ".join(tpu_device_names())
    gpus = ", ".join(GPU_TYPES)
    return f"TPU slices: {tpus}; GPUs: {gpus}; or cpu"


def resolve_tpu(accelerator: str, topology: str | None = None) -> Placement:
    m = re.fullmatch(r"([a-z0-9]+)-(\d+)", accelerator)
    gen = _generation(m.group(1)) if m else None
    if gen is None:
        raise CatalogError(f"unknown accelerator {accelerator!r}; valid: {_valid_choices()}")
    cores = int(m.group(2))
    valid_names = [f"{gen.name}-{_chips(t) * gen.cores_per_chip}" for t in gen.topologies]
    if cores % gen.cores_per_chip:
        raise CatalogError(
            f"{accelerator!r}: {gen.name} has {gen.cores_per_chip} TensorCores per chip, so "
            f"the count must be a multiple of {gen.cores_per_chip}; valid: {', '.join(valid_names)}"
        )
    chips = cores // gen.cores_per_chip
    shapes = [t for t in gen.topologies if _chips(t) == chips]
    if not shapes:
        raise CatalogError(
            f"no {gen.name} slice has {chips} chips ({accelerator!r}); valid: {', '.join(valid_names)}"
        )
    if topology is None:
        topology = shapes[0]
    elif topology not in gen.topologies:
        raise CatalogError(
            f"topology {topology!r} does not exist for {gen.name}; valid: {', '.join(gen.topologies)}"
        )
    elif _chips(topology) != chips:
        raise CatalogError(
            f"topology {topology!r} has {_chips(topology)} chips but {accelerator!r} has "
            f"{chips}; valid for {accelerator}: {', '.join(shapes)}"
        )
    chips_per_host = 1 if chips == 1 else 4
    canonical = f"{gen.name}-{cores}"
    return Placement(
        kind="tpu",
        accelerator=canonical,
        hosts=chips // chips_per_host,
        devices_per_host=chips_per_host,
        node_selector={TPU_ACCELERATOR_LABEL: gen.node_label, TPU_TOPOLOGY_LABEL: topology},
        resource_name=TPU_RESOURCE,
        topology=topology,
        generation=gen.name,
        pathways_instance_type=f"{gen.pathways_type}:{topology}",
        memory_gib_per_device=gen.hbm_gib_per_chip,
        bf16_tflops_per_device=gen.bf16_tflops_per_chip,
    )


def resolve(
    accelerator: str, topology: str | None = None, gpus_per_node: int | None = None
) -> Placement:
    """Resolve spec.resources into a Placement, or raise CatalogError naming valid choices."""
    if accelerator == "cpu":
        if topology:
            raise CatalogError("topology applies to TPU slices only, not cpu")
        return Placement("cpu", "cpu", 1, 0, {}, None)
    if accelerator in GPU_TYPES:
        if topology:
            raise CatalogError(f"topology applies to TPU slices only, not {accelerator}")
        gpu = GPU_TYPES[accelerator]
        count = gpus_per_node or gpu.max_per_node
        if count > gpu.max_per_node:
            raise CatalogError(
                f"{accelerator} nodes have at most {gpu.max_per_node} GPUs; got {count}"
            )
        return Placement(
            kind="gpu",
            accelerator=accelerator,
            hosts=1,
            devices_per_host=count,
            node_selector={GPU_ACCELERATOR_LABEL: accelerator},
            resource_name=GPU_RESOURCE,
            memory_gib_per_device=gpu.memory_gib,
            bf16_tflops_per_device=gpu.bf16_tflops,
        )
    if gpus_per_node is not None:
        raise CatalogError(f"gpusPerNode applies to GPU types only, not {accelerator!r}")
    return resolve_tpu(accelerator, topology)
