"""Start-up check in a pod: JAX sees the devices the job was given (count and kind).

A TPU or GPU job on an image without that backend, or on a node whose driver does not
work, would otherwise fail late or train on the wrong devices. The check runs after
jax.distributed starts (multi-host JAX needs that first) and names the image
(POSTTRAIN_IMAGE, set by the renderer) and what JAX found:

- the image lacks the job's backend (no libtpu, no jax-cuda plugin): a user error
  (exit 65, the JobSet fails at once; restarting would not help);
- the backend is there but sees other devices or none (a node problem): a crash, which
  the JobSet restarts, maybe onto another node.

Under Pathways (JAX_PLATFORMS=proxy) the single JAX client sees every slice's devices:
their kind and total count are checked.
"""

from __future__ import annotations

import importlib.metadata
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from posttrain.api.spec import USER_ERROR_EXIT_CODE, PostTrainJob
from posttrain.catalog import TPU_GENERATIONS, Placement, resolve

# jax Device.platform of each accelerator kind
PLATFORM = {"tpu": "tpu", "gpu": "gpu", "cpu": "cpu"}
# The package that gives JAX each backend; the image has it or not at all.
BACKEND_PACKAGES = {"tpu": ("libtpu",), "gpu": ("jax-cuda12-plugin", "jax-cuda13-plugin")}
BUILD_ARG = {"tpu": "tpu", "gpu": "cuda12"}
# v4 and v5p join a chip's two TensorCores into one JAX device (megacore); tpu7x shows
# each TensorCore as a device.
MEGACORE = {"v4", "v5p"}
CRASH_EXIT_CODE = 1


class Device(Protocol):
    platform: str
    device_kind: str


class DeviceMismatch(Exception):
    def __init__(self, message: str, exit_code: int) -> None:
        super().__init__(message)
        self.exit_code = exit_code


@dataclass(frozen=True)
class Expected:
    kind: str  # tpu, gpu or cpu
    per_process: int | None  # devices each process sees; None: not checked (CPU, Pathways)
    total: int | None  # devices of the whole job; None: not checked (CPU)
    pathways: bool = False  # JAX_PLATFORMS=proxy: the backend is the Pathways proxy


def expected(job: PostTrainJob, pathways: bool) -> Expected:
    """What JAX must see in one process of this job (pure)."""
    res = job.spec.resources
    placement: Placement = resolve(
        res.accelerator, res.topology, res.gpus_per_node, res.machine_type
    )
    per_host = placement.devices_per_host
    if placement.is_tpu:
        gen = TPU_GENERATIONS[placement.generation or ""]
        per_host *= 1 if gen.name in MEGACORE else gen.cores_per_chip
        total = per_host * placement.hosts * res.slices
        return Expected("tpu", None if pathways else per_host, total, pathways)
    if placement.kind == "gpu":
        return Expected("gpu", per_host, per_host * res.nodes)
    return Expected("cpu", None, None)


def _describe(devices: Sequence[Device]) -> str:
    if not devices:
        return "no devices"
    kinds: dict[str, int] = {}
    for d in devices:
        name = f"{d.platform} ({d.device_kind})"
        kinds[name] = kinds.get(name, 0) + 1
    return ", ".join(f"{n} x {k}" for k, n in kinds.items())


def problem(want: Expected, local: Sequence[Device], total: int) -> str | None:
    """Why these devices are not what the job was given, or None (pure)."""
    platform = PLATFORM[want.kind]
    wrong = [d for d in local if d.platform != platform]
    if wrong or not local:
        return f"JAX sees {_describe(local)}, the job needs {platform} devices"
    if want.per_process is not None and len(local) != want.per_process:
        return (
            f"JAX sees {_describe(local)} in this process, the job was given "
            f"{want.per_process} per host"
        )
    if want.total is not None and total != want.total:
        return f"JAX sees {total} {platform} devices in all, the job was given {want.total}"
    return None


def has_backend(kind: str, installed: Callable[[str], bool]) -> bool:
    """Whether the image carries JAX's backend for this kind (CPU always)."""
    packages = BACKEND_PACKAGES.get(kind)
    return packages is None or any(installed(p) for p in packages)


def _installed(package: str) -> bool:
    try:
        importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return False
    return True


def diagnose(
    want: Expected,
    image: str,
    devices: Callable[[], tuple[Sequence[Device], int]],
    installed: Callable[[str], bool] = _installed,
) -> DeviceMismatch | None:
    """The error to stop with, or None when JAX sees what the job was given (pure given
    its callables: `devices` returns (this process's devices, the job's device count))."""
    if not want.pathways and not has_backend(want.kind, installed):
        hint = f"build it with --build-arg ACCELERATOR={BUILD_ARG[want.kind]}"
        return DeviceMismatch(
            f"image {image} has no JAX {want.kind.upper()} backend (none of "
            f"{', '.join(BACKEND_PACKAGES[want.kind])} installed): use the operator's "
            f"{want.kind.upper()} trainer image or a spec.image with it ({hint})",
            USER_ERROR_EXIT_CODE,
        )
    try:
        local, total = devices()
    except RuntimeError as e:  # the backend did not start: driver, device files
        return DeviceMismatch(
            f"image {image}: JAX could not start its {want.kind.upper()} backend on this node: {e}",
            CRASH_EXIT_CODE,
        )
    if why := problem(want, local, total):
        return DeviceMismatch(f"image {image}: {why}", CRASH_EXIT_CODE)
    return None


def _jax_devices() -> tuple[Sequence[Any], int]:
    import jax

    return jax.local_devices(), jax.device_count()


def check(job: PostTrainJob) -> None:
    """Raise DeviceMismatch unless JAX sees the devices this job was given."""
    pathways = os.environ.get("JAX_PLATFORMS") == "proxy"
    image = os.environ.get("POSTTRAIN_IMAGE", "(unknown image)")
    if error := diagnose(expected(job, pathways), image, _jax_devices):
        raise error
