"""Accelerators posttrain can place a job on: TPU slices, NVIDIA GPUs and CPU.

Data tables plus pure functions. `resolve(accelerator, topology, gpus_per_node,
machine_type)` turns the user's `spec.resources` into a `Placement` the renderer uses, or
raises `CatalogError` listing the valid choices.

TPU device names count TensorCores (v5p-128 = 64 chips); v5e and v6e have one core per
chip, v4, v5p and tpu7x two. Each TPU VM (GKE machine type) holds 1, 4 or 8 chips: a
slice of topology 2x4 is two ct6e-standard-4t hosts or one ct6e-standard-8t host, and
the renderer selects the machine type so a job never lands on the other kind of pool.
The shapes and machine types follow GKE's documentation and xpk's system
characteristics table (tests/unit/data/ holds a copy; test_catalog compares them).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from functools import cached_property

TPU_RESOURCE = "google.com/tpu"
GPU_RESOURCE = "nvidia.com/gpu"
TPU_ACCELERATOR_LABEL = "cloud.google.com/gke-tpu-accelerator"
TPU_TOPOLOGY_LABEL = "cloud.google.com/gke-tpu-topology"
GPU_ACCELERATOR_LABEL = "cloud.google.com/gke-accelerator"
NODEPOOL_LABEL = "cloud.google.com/gke-nodepool"
INSTANCE_TYPE_LABEL = "node.kubernetes.io/instance-type"


class CatalogError(ValueError):
    """An accelerator request that does not exist; the message lists valid choices and
    `field` names the setting of spec.resources at fault."""

    def __init__(self, message: str, field: str = "accelerator"):
        super().__init__(message)
        self.field = field


_SUB_CUBES = ("2x2x1", "2x2x2", "2x2x4", "2x4x4")
_MULTI_HOST_PLANES = ("2x4", "4x4", "4x8", "8x8", "8x16", "16x16")


def _cuboids(max_cubes: int, *, ordered: bool = True) -> tuple[str, ...]:
    """3-D slice shapes: the shapes smaller than a 4x4x4 cube, then every AxBxC whose
    edges are multiples of 4 (up to 256) and that holds at most `max_cubes` 4x4x4 cubes;
    `ordered` keeps only A <= B <= C (v4 also offers the permutations)."""
    shapes = []
    for a in range(1, 65):
        for b in range(a if ordered else 1, 65):
            if a * b > max_cubes:
                break
            for c in range(b if ordered else 1, min(64, max_cubes // (a * b)) + 1):
                shapes.append(f"{4 * a}x{4 * b}x{4 * c}")
    return _SUB_CUBES + tuple(shapes)


@dataclass(frozen=True)
class TpuMachine:
    """A GKE TPU machine type (one VM, one Kubernetes node) and the slice shapes it forms."""

    name: str  # value of node.kubernetes.io/instance-type, e.g. ct6e-standard-4t
    chips: int  # chips per VM
    topologies: tuple[str, ...]


@dataclass(frozen=True)
class TpuGeneration:
    name: str  # as in the device name prefix: v6e, v5p, ...
    aliases: tuple[str, ...]
    cores_per_chip: int
    node_label: str  # value of cloud.google.com/gke-tpu-accelerator
    machines: tuple[TpuMachine, ...]  # the first one offering a shape is its default
    pathways_type: str  # instance type prefix for pathways-rm, e.g. tpuv6e
    hbm_gib_per_chip: int
    bf16_tflops_per_chip: float

    @cached_property
    def topologies(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(t for m in self.machines for t in m.topologies))


def _machines(prefix: str, one: str | None, four: tuple[str, ...], eight: tuple[str, ...] = ()):
    """Machine types `<prefix>-1t` (1x1 or 1x1x1), `-4t` and `-8t` with their shapes."""
    out = []
    if one:
        out.append(TpuMachine(f"{prefix}-1t", 1, (one,)))
    out.append(TpuMachine(f"{prefix}-4t", 4, four))
    if eight:
        out.append(TpuMachine(f"{prefix}-8t", 8, eight))
    return tuple(out)


TPU_GENERATIONS: dict[str, TpuGeneration] = {
    g.name: g
    for g in (
        TpuGeneration(
            "v4", (), 2, "tpu-v4-podslice",
            _machines("ct4p-hightpu", None, _cuboids(64, ordered=False)),
            "tpuv4", 32, 275,
        ),
        TpuGeneration(
            "v5e", ("v5litepod",), 1, "tpu-v5-lite-podslice",
            _machines("ct5lp-hightpu", "1x1", ("2x2", *_MULTI_HOST_PLANES), ("2x4",)),
            "tpuv5e", 16, 197,
        ),
        TpuGeneration(
            "v5p", (), 2, "tpu-v5p-slice",
            _machines("ct5p-hightpu", None, _cuboids(140)),
            "tpuv5", 95, 459,
        ),
        TpuGeneration(
            "v6e", (), 1, "tpu-v6e-slice",
            _machines("ct6e-standard", "1x1", ("2x2", *_MULTI_HOST_PLANES), ("2x4",)),
            "tpuv6e", 32, 918,
        ),
        TpuGeneration(
            "tpu7x", (), 2, "tpu7x",
            _machines("tpu7x-standard", "1x1x1", _cuboids(144)),
            "tpu7x", 192, 2307,
        ),
    )
}  # fmt: skip


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
        GpuType("nvidia-gb200", 4, 186, 2500),  # A4X: Arm (Grace) hosts
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
    machine_type: str | None = None  # TPU VM type, e.g. ct6e-standard-4t
    memory_gib_per_device: int = 0
    bf16_tflops_per_device: float = 0.0

    @property
    def is_tpu(self) -> bool:
        return self.kind == "tpu"

    @property
    def jax_platforms(self) -> str:
        """JAX_PLATFORMS of the trainer (not under Pathways): tpu, cuda or cpu. Naming the
        platform makes JAX fail at start where it is missing instead of falling back."""
        return {"tpu": "tpu", "gpu": "cuda"}.get(self.kind, "cpu")


def _dims(topology: str) -> list[int]:
    return [int(d) for d in topology.split("x")]


def _chips(topology: str) -> int:
    return math.prod(_dims(topology))


def _most_compact(shapes: list[str]) -> str:
    """The default among shapes of one chip count: the shortest longest edge, then
    edges in ascending order, then the largest shortest edges (8x8x16 before 4x16x16)."""

    def key(topology: str) -> tuple:
        dims = _dims(topology)
        return (max(dims), dims != sorted(dims), [-d for d in dims])

    return min(shapes, key=key)


def _device_name(gen: TpuGeneration, topology: str) -> str:
    return f"{gen.name}-{_chips(topology) * gen.cores_per_chip}"


def _sizes(gen: TpuGeneration) -> list[str]:
    return sorted(
        {_device_name(gen, t) for t in gen.topologies}, key=lambda n: int(n.split("-")[1])
    )


def tpu_device_names() -> list[str]:
    """Every valid TPU device name, e.g. v6e-256, v5p-128."""
    return [name for gen in TPU_GENERATIONS.values() for name in _sizes(gen)]


def _generation(prefix: str) -> TpuGeneration | None:
    for gen in TPU_GENERATIONS.values():
        if prefix == gen.name or prefix in gen.aliases:
            return gen
    return None


def is_tpu_name(accelerator: str) -> bool:
    """True when the name looks like a TPU device name (a known generation prefix)."""
    m = re.fullmatch(r"([a-z0-9]+)-(\d+)", accelerator)
    return bool(m and _generation(m.group(1)))


def _short_list(names: list[str], most: int = 12) -> str:
    if len(names) <= most:
        return ", ".join(names)
    return f"{', '.join(names[: most - 2])}, ... {', '.join(names[-2:])} ({len(names)} in all)"


def _valid_choices() -> str:
    tpus = "; ".join(_short_list(_sizes(gen), 10) for gen in TPU_GENERATIONS.values())
    gpus = ", ".join(GPU_TYPES)
    return f"TPU slices: {tpus}; GPUs: {gpus}; or cpu"


def _tpu_machine(
    gen: TpuGeneration, accelerator: str, chips: int, topology: str, machine_type: str | None
) -> TpuMachine:
    if machine_type is None:
        return next(m for m in gen.machines if topology in m.topologies)
    by_name = {m.name: m for m in gen.machines}
    if machine_type not in by_name:
        raise CatalogError(
            f"machine type {machine_type!r} does not exist for {gen.name}; valid: "
            f"{', '.join(by_name)}",
            "machineType",
        )
    machine = by_name[machine_type]
    if topology not in machine.topologies:
        offered = [t for t in machine.topologies if _chips(t) == chips]
        raise CatalogError(
            f"{machine_type} hosts do not form {accelerator} slices of topology {topology}; "
            + (
                f"valid topologies: {', '.join(offered)}" if offered else "use another machine type"
            ),
            "machineType",
        )
    return machine


def resolve_tpu(
    accelerator: str, topology: str | None = None, machine_type: str | None = None
) -> Placement:
    m = re.fullmatch(r"([a-z0-9]+)-(\d+)", accelerator)
    gen = _generation(m.group(1)) if m else None
    if gen is None:
        raise CatalogError(f"unknown accelerator {accelerator!r}; valid: {_valid_choices()}")
    cores = int(m.group(2))
    if cores % gen.cores_per_chip:
        raise CatalogError(
            f"{accelerator!r}: {gen.name} has {gen.cores_per_chip} TensorCores per chip, so "
            f"the count must be a multiple of {gen.cores_per_chip}; valid: {_short_list(_sizes(gen))}"
        )
    chips = cores // gen.cores_per_chip
    shapes = [t for t in gen.topologies if _chips(t) == chips]
    if not shapes:
        raise CatalogError(
            f"no {gen.name} slice has {chips} chips ({accelerator!r}); valid: "
            f"{_short_list(_sizes(gen))}"
        )
    if topology is None:
        offered = [t for x in gen.machines if machine_type == x.name for t in x.topologies]
        topology = _most_compact([t for t in offered if t in shapes] or shapes)
    elif topology not in gen.topologies:
        raise CatalogError(
            f"topology {topology!r} does not exist for {gen.name}; valid: "
            f"{_short_list(list(gen.topologies))}",
            "topology",
        )
    elif _chips(topology) != chips:
        raise CatalogError(
            f"topology {topology!r} has {_chips(topology)} chips but {accelerator!r} has "
            f"{chips}; valid for {accelerator}: {', '.join(shapes)}",
            "topology",
        )
    machine = _tpu_machine(gen, accelerator, chips, topology, machine_type)
    chips_per_host = min(machine.chips, chips)
    return Placement(
        kind="tpu",
        accelerator=f"{gen.name}-{cores}",
        hosts=chips // chips_per_host,
        devices_per_host=chips_per_host,
        node_selector={
            TPU_ACCELERATOR_LABEL: gen.node_label,
            TPU_TOPOLOGY_LABEL: topology,
            INSTANCE_TYPE_LABEL: machine.name,
        },
        resource_name=TPU_RESOURCE,
        topology=topology,
        generation=gen.name,
        pathways_instance_type=f"{gen.pathways_type}:{topology}",
        machine_type=machine.name,
        memory_gib_per_device=gen.hbm_gib_per_chip,
        bf16_tflops_per_device=gen.bf16_tflops_per_chip,
    )


def resolve(
    accelerator: str,
    topology: str | None = None,
    gpus_per_node: int | None = None,
    machine_type: str | None = None,
) -> Placement:
    """Resolve spec.resources into a Placement, or raise CatalogError naming valid choices."""
    if accelerator == "cpu" or accelerator in GPU_TYPES:
        if topology:
            raise CatalogError(
                f"topology applies to TPU slices only, not {accelerator}", "topology"
            )
        if machine_type:
            raise CatalogError(
                f"machineType applies to TPU slices only, not {accelerator}", "machineType"
            )
    if accelerator == "cpu":
        return Placement("cpu", "cpu", 1, 0, {}, None)
    if accelerator in GPU_TYPES:
        gpu = GPU_TYPES[accelerator]
        count = gpus_per_node or gpu.max_per_node
        if count > gpu.max_per_node:
            raise CatalogError(
                f"{accelerator} nodes have at most {gpu.max_per_node} GPUs; got {count}",
                "gpusPerNode",
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
        raise CatalogError(
            f"gpusPerNode applies to GPU types only, not {accelerator!r}", "gpusPerNode"
        )
    return resolve_tpu(accelerator, topology, machine_type)
