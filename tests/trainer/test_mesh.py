"""The device mesh on simulated TPU slices and GPU hosts, laid out as the real devices
report themselves to JAX (``device_kind`` as in jax's mesh_utils / test_util: v6e is
"TPU v6 lite", v5p "TPU v5" with one device per chip (megacore), tpu7x "TPU7x" with two
devices per chip; a 4-chip TPU host holds a 2x2x1 block of the slice; XLA gives each GPU host
its own ``slice_index``): data parallelism crosses slices only on ``dp``, ``fsdp`` and ``tp``
never leave a slice."""

from __future__ import annotations

import dataclasses
import itertools
import logging
from collections.abc import Sequence
from pathlib import Path

import jax
import numpy as np
import pytest

from posttrain.trainer import mesh as mesh_lib
from posttrain.trainer import models

pytestmark = pytest.mark.trainer
FIXTURES = Path(__file__).parent / "fixtures"


@dataclasses.dataclass(frozen=True)
class TpuDevice:
    id: int
    coords: tuple[int, int, int]
    core_on_chip: int
    slice_index: int
    process_index: int
    device_kind: str
    platform: str = "tpu"


@dataclasses.dataclass(frozen=True)
class GpuDevice:  # CUDA devices carry no coords / core_on_chip
    id: int
    slice_index: int
    process_index: int
    device_kind: str = "NVIDIA H100 80GB HBM3"
    platform: str = "gpu"


@dataclasses.dataclass(frozen=True)
class CpuDevice:  # under jax.distributed every CPU device says slice_index 0
    id: int
    process_index: int
    slice_index: int = 0
    device_kind: str = "cpu"
    platform: str = "cpu"


def tpu_slices(
    kind: str, topology: tuple[int, int, int], cores: int = 1, slices: int = 1
) -> list[TpuDevice]:
    """jax.devices() of `slices` TPU slices of `topology` chips, 4-chip hosts (2x2x1) in
    x-major order, ids unique over the job."""
    x, y, z = topology
    host = (min(2, x), min(2, y), 1)
    hosts = [(hx, hy, hz) for hz in range(z) for hy in range(0, y, 2) for hx in range(0, x, 2)]
    per_slice = x * y * z * cores
    devices = []
    for s in range(slices):
        for h, (hx, hy, hz) in enumerate(hosts):
            chips = [
                (hx + dx, hy + dy, hz)
                for dy in range(host[1])
                for dx in range(host[0])
                if hx + dx < x and hy + dy < y
            ]
            for chip, core in itertools.product(chips, range(cores)):
                devices.append(
                    TpuDevice(
                        id=s * per_slice + len(devices) % per_slice,
                        coords=chip,
                        core_on_chip=core,
                        slice_index=s,
                        process_index=s * len(hosts) + h,
                        device_kind=kind,
                    )
                )
    assert len(devices) == slices * per_slice
    return devices


def gpu_hosts(hosts: int, gpus: int = 8) -> list[GpuDevice]:
    return [GpuDevice(h * gpus + g, h, h) for h in range(hosts) for g in range(gpus)]


def _slice_of(d) -> int:
    return d.slice_index


def assert_dcn_only_on_dp(mesh: jax.sharding.Mesh, slice_of=_slice_of) -> None:
    grid = mesh.devices
    assert len({d.id for d in grid.flat}) == grid.size  # every device once
    # Each dp entry is one whole slice: fsdp and tp groups never cross a slice ...
    for dp in range(grid.shape[0]):
        assert len({slice_of(d) for d in grid[dp].flat}) == 1, dp
    # ... and every data-parallel group (the devices along dp) has one device per slice.
    for f, t in itertools.product(range(grid.shape[1]), range(grid.shape[2])):
        assert [slice_of(d) for d in grid[:, f, t]] == sorted({slice_of(d) for d in grid.flat})


def _torus_line(group: Sequence[TpuDevice]) -> bool:
    """The chips of `group` share all coordinates but one (a line of the torus)."""
    coords = np.array([d.coords for d in group])
    return sum(len(set(coords[:, i])) > 1 for i in range(3)) <= 1


CASES = {
    # name: (devices, fsdp, tp, expected mesh shape)
    "v6e-16 x 2 slices": (tpu_slices("TPU v6 lite", (4, 4, 1), slices=2), None, 1, (2, 16, 1)),
    "v6e-16 x 2 slices, tp 4": (tpu_slices("TPU v6 lite", (4, 4, 1), slices=2), 4, 4, (2, 4, 4)),
    "v6e-256 x 2 slices": (tpu_slices("TPU v6 lite", (16, 16, 1), slices=2), None, 1, (2, 256, 1)),
    "v6e-256 x 2 slices, tp 8": (
        tpu_slices("TPU v6 lite", (16, 16, 1), slices=2),
        None,
        8,
        (2, 32, 8),
    ),
    "v5p-128 (4x4x4)": (tpu_slices("TPU v5", (4, 4, 4)), None, 1, (1, 64, 1)),
    "v5p-128 (4x4x4), tp 4": (tpu_slices("TPU v5", (4, 4, 4)), None, 4, (1, 16, 4)),
    "v5p-128 x 4 slices, tp 4": (tpu_slices("TPU v5", (4, 4, 4), slices=4), 16, 4, (4, 16, 4)),
    "tpu7x-128 (4x4x4, 2 cores)": (tpu_slices("TPU7x", (4, 4, 4), cores=2), None, 1, (1, 128, 1)),
    "tpu7x-128 x 2 slices, tp 2": (
        tpu_slices("TPU7x", (4, 4, 4), cores=2, slices=2),
        None,
        2,
        (2, 64, 2),
    ),
    "2 x 8 H100": (gpu_hosts(2), None, 1, (2, 8, 1)),
    "2 x 8 H100, tp 8": (gpu_hosts(2), None, 8, (2, 1, 8)),
    "4 x 8 H100, tp 4": (gpu_hosts(4), 2, 4, (4, 2, 4)),
}


@pytest.mark.parametrize("name", CASES)
def test_mesh_keeps_fsdp_and_tp_inside_a_slice(name, caplog):
    devices, fsdp, tp, shape = CASES[name]
    with caplog.at_level(logging.WARNING, logger=mesh_lib.__name__):
        mesh = mesh_lib.make_mesh(fsdp, tp, devices, env={})
    assert mesh.axis_names == ("dp", "fsdp", "tp")
    assert tuple(mesh.shape.values()) == shape
    assert set(mesh.axis_types) == {jax.sharding.AxisType.Auto}
    assert_dcn_only_on_dp(mesh)
    assert not caplog.records, "mesh_utils placed every one of these device sets"
    grid = mesh.devices
    if grid[0, 0, 0].platform == "tpu" and tp > 1:
        # tp runs along one physical axis of the torus (v5p, v6e) or over a chip's two
        # cores (tpu7x), not in id order across hosts.
        for group in grid.reshape(-1, tp):
            assert _torus_line(group), [d.coords for d in group]
    if grid[0, 0, 0].platform == "gpu":  # a GPU host's devices are neighbours on tp
        for group in grid.reshape(-1, tp):
            assert len({d.process_index for d in group}) == 1


def test_jax_make_mesh_refuses_what_make_mesh_lays_out():
    """Why the trainer builds its own: jax.make_mesh refuses several slices."""
    devices = tpu_slices("TPU v6 lite", (4, 4, 1), slices=2)
    with pytest.raises(AssertionError, match="cores_per_chip"):  # 2 overlapping tori
        jax.make_mesh((32, 1), ("fsdp", "tp"), devices=devices)
    with pytest.raises(ValueError, match="multi-slice"):
        jax.make_mesh((16, 1), ("fsdp", "tp"), devices=gpu_hosts(2))


def test_an_unknown_device_kind_falls_back_to_process_order(caplog):
    """A TPU kind mesh_utils cannot place (two devices per chip, unknown to it) is laid out
    host by host, a host's devices next to each other, with a warning."""
    devices = tpu_slices("TPU v99", (4, 4, 1), cores=2, slices=2)
    with caplog.at_level(logging.WARNING, logger=mesh_lib.__name__):
        mesh = mesh_lib.make_mesh(None, 8, devices, env={})
    assert tuple(mesh.shape.values()) == (2, 4, 8)
    assert_dcn_only_on_dp(mesh)
    for group in mesh.devices.reshape(-1, 8):  # tp = one host's 8 devices
        assert len({d.process_index for d in group}) == 1
    assert "no physical layout for 32 'TPU v99' devices as 1x4x8" in caplog.text


def test_cpu_processes_as_slices():
    """CPU devices know no slices: MEGASCALE_NUM_SLICES splits the processes into
    consecutive groups, as the renderer numbers them."""
    devices = [CpuDevice(p * 2 + i, p) for p in range(4) for i in range(2)]
    env = {mesh_lib.SLICES_ENV: "2"}

    def slice_of(d):
        return d.process_index // 2

    for fsdp, tp, shape in ((None, 1, (2, 4, 1)), (2, 2, (2, 2, 2))):
        mesh = mesh_lib.make_mesh(fsdp, tp, devices, env=env, process_count=4)
        assert tuple(mesh.shape.values()) == shape
        assert_dcn_only_on_dp(mesh, slice_of)
    assert [len(g) for g in mesh_lib.slices(devices, env, process_count=4)] == [4, 4]
    assert len(mesh_lib.slices(devices, {}, process_count=4)) == 1
    # One process's devices (a host-local mesh) are one slice.
    assert len(mesh_lib.slices(devices[2:4], env, process_count=4)) == 1
    with pytest.raises(ValueError, match="MEGASCALE_NUM_SLICES=3 does not split the job's 4"):
        mesh_lib.slices(devices, {mesh_lib.SLICES_ENV: "3"}, process_count=4)


def test_make_mesh_errors():
    with pytest.raises(
        ValueError, match="fsdp=3 x tp=2 needs 6 devices; there are 8 in each of 2 slices"
    ):
        mesh_lib.make_mesh(3, 2, gpu_hosts(2), env={})
    uneven = gpu_hosts(2)[:-1]
    with pytest.raises(ValueError, match=r"the 2 slices differ in size \(\[7, 8\] devices\)"):
        mesh_lib.make_mesh(None, 1, uneven, env={})


def test_make_mesh_on_this_process():
    mesh = models.make_mesh()  # re-exported where the trainer's callers find it
    assert mesh.axis_names == ("dp", "fsdp", "tp")
    assert mesh.shape["dp"] == 1 and mesh.devices.size == len(jax.devices())
    with pytest.raises(ValueError, match="needs 6 devices"):
        models.make_mesh(3, 2)


@pytest.mark.parametrize("family", models.FAMILIES)
def test_activations_are_sharded_over_slices_too(family):
    """The models the trainer loads split their activations' batch over dp and fsdp (Tunix
    says fsdp alone: every slice would compute the whole batch)."""
    config = models.model_info(FIXTURES / family)[0].config
    tunix = type(config.shd_config).get_default_sharding()
    acts = [f.name for f in dataclasses.fields(tunix) if f.name.startswith("act_")]
    assert acts
    for name in acts:
        assert getattr(tunix, name)[0] == "fsdp"
        assert getattr(config.shd_config, name) == (("dp", "fsdp"), *getattr(tunix, name)[1:])
    for f in dataclasses.fields(tunix):  # parameters as Tunix shards them
        if not f.name.startswith("act_"):
            assert getattr(config.shd_config, f.name) == getattr(tunix, f.name)
