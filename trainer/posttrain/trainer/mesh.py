"""The trainer's device mesh: axes ``('dp', 'fsdp', 'tp')``, data parallel over slices.

A job's devices come in slices: a TPU slice (chips joined by ICI), or a GPU host (XLA gives
each host its own ``slice_index``; NVLink joins its GPUs; a GB200 NVL72 rack is one slice).
Between slices there is only the data-centre network (DCN), so:

- ``dp`` has one entry per slice. Only data parallelism crosses the DCN: the parameters are
  replicated over ``dp`` and the gradients are all-reduced over it once per step.
- ``fsdp`` and ``tp`` stay inside a slice. Each slice holds a whole model, its parameters
  sharded over ``fsdp`` x ``tp`` as the Tunix models' sharding configs name them.

``jax.make_mesh`` refuses devices of several slices; here every slice gets its own ICI mesh
from ``jax.experimental.mesh_utils.create_device_mesh`` (the physical torus of a TPU slice,
device ids on GPUs), first without and then with splitting physical axes, and the slices are
stacked along ``dp`` in ``slice_index`` order, as ``create_hybrid_device_mesh`` does. Where
mesh_utils knows no layout for the devices (a device kind whose cores it cannot place, a
shape its torus assignment cannot split), the slice's devices are laid out in process order
(a host's devices next to each other on the innermost axes), and a warning says so.

Where the slices come from: the devices' ``slice_index``, which libtpu sets from the
``MEGASCALE_*`` variables the renderer puts into a multi-slice JobSet, XLA sets per GPU host,
and Pathways sets per slice. CPU devices know no slices (under ``jax.distributed`` every one
says ``slice_index`` 0); there, ``MEGASCALE_NUM_SLICES`` (the same variable) above 1 splits the processes into that many consecutive groups, in the order the
renderer numbers them (``posttrain.trainer.distributed``: job index x pods per job +
completion index, one Job per slice), so a multi-process CPU run is laid out and trains as
that multi-slice job would.

The Tunix models constrain their activations' batch dimension to ``'fsdp'`` alone, which
would make every slice compute the whole global batch; ``shard_batch_over_slices`` gives a
Tunix ``ModelConfig`` activations sharded over ``('dp', 'fsdp')`` instead.

Tunix applies those constraints only under the legacy ``with mesh:`` context (and never on
CPU); under ``jax.set_mesh``, which the trainer uses, they did nothing, and XLA laid the
activations out from the FSDP-sharded weights: over 8 devices each one held the whole
batch's logits and MLP activations (3.5x to 3.9x the memory per device of the
batch-split steps of tests/trainer/test_capacity_xla.py over 8 devices). ``constrain`` applies them under ``jax.set_mesh`` (on
every platform, dropping axes that do not divide a dimension), and the Tunix model modules
use it (installed on import).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np
from jax.experimental import mesh_utils

log = logging.getLogger(__name__)

AXES = ("dp", "fsdp", "tp")
BATCH_AXES = AXES  # a global batch is split over every device
ACTIVATION_BATCH = ("dp", "fsdp")  # the batch dimension of the models' activations
SLICES_ENV = "MEGASCALE_NUM_SLICES"


def slices(
    devices: Sequence[Any], env: Mapping[str, str] | None = None, process_count: int = 1
) -> list[list[Any]]:
    """``devices`` grouped by slice, in slice order (pure).

    By ``slice_index``; on CPU (or devices without one) ``env[MEGASCALE_NUM_SLICES]``
    consecutive groups of the job's ``process_count`` processes (one group: no such variable).
    """
    env = os.environ if env is None else env
    if devices[0].platform != "cpu" and all(
        getattr(d, "slice_index", None) is not None for d in devices
    ):
        key = lambda d: d.slice_index  # noqa: E731
    else:
        count = int(env.get(SLICES_ENV) or 1)
        if count < 1 or process_count % count:
            raise ValueError(
                f"{SLICES_ENV}={count} does not split the job's {process_count} processes "
                "into equal slices"
            )
        key = lambda d: d.process_index * count // process_count  # noqa: E731
    groups: dict[int, list[Any]] = {}
    for d in devices:
        groups.setdefault(key(d), []).append(d)
    return [groups[k] for k in sorted(groups)]


def make_mesh(
    fsdp: int | None = None,
    tp: int = 1,
    devices: Sequence[Any] | None = None,
    env: Mapping[str, str] | None = None,
    process_count: int | None = None,
) -> jax.sharding.Mesh:
    """A ``('dp', 'fsdp', 'tp')`` mesh over ``devices`` (all devices by default).

    ``dp`` is the number of slices; ``fsdp`` x ``tp`` is each slice (``fsdp=None`` takes
    every device of a slice left after ``tp``). ``env`` and ``process_count`` (default: this
    process's environment and ``jax.process_count()``) place CPU devices in slices.
    """
    devices = list(devices if devices is not None else jax.devices())
    count = jax.process_count() if process_count is None else process_count
    groups = slices(devices, env, count)
    sizes = sorted({len(g) for g in groups})
    if len(sizes) > 1:
        raise ValueError(f"mesh: the {len(groups)} slices differ in size ({sizes} devices)")
    per_slice = sizes[0]
    if fsdp is None:
        fsdp = max(1, per_slice // tp)
    if fsdp * tp != per_slice:
        where = f" in each of {len(groups)} slices" if len(groups) > 1 else ""
        raise ValueError(
            f"mesh fsdp={fsdp} x tp={tp} needs {fsdp * tp} devices; there are {per_slice}{where}"
        )
    grid = np.concatenate([_slice_grid(g, (1, fsdp, tp)) for g in groups], axis=0)
    log.log(
        logging.INFO if len(devices) > 1 else logging.DEBUG,
        "mesh dp=%d x fsdp=%d x tp=%d: %d %s devices, one dp entry per slice",
        len(groups),
        fsdp,
        tp,
        len(devices),
        devices[0].device_kind,
    )
    return jax.sharding.Mesh(grid, AXES, axis_types=(jax.sharding.AxisType.Auto,) * len(AXES))


def _slice_grid(devices: list[Any], shape: tuple[int, ...]) -> np.ndarray:
    """The devices of one slice as an array of ``shape``, placed for its ICI."""
    reasons = []
    for split in (False, True):
        try:
            return mesh_utils.create_device_mesh(shape, devices, allow_split_physical_axes=split)
        except (AssertionError, NotImplementedError, ValueError) as e:
            reasons.append(str(e).splitlines()[0] if str(e) else type(e).__name__)
    log.warning(
        "mesh: no physical layout for %d %r devices as %s (%s); placing them in process order",
        len(devices),
        devices[0].device_kind,
        "x".join(map(str, shape)),
        reasons[-1],
    )
    ordered = sorted(devices, key=lambda d: (d.process_index, d.id))
    grid = np.empty(len(ordered), dtype=object)
    grid[:] = ordered
    return grid.reshape(shape)


def shard_batch_over_slices(config: Any) -> Any:
    """A Tunix ``ModelConfig`` whose activations (``shd_config.act_*``) have their batch
    dimension over ``('dp', 'fsdp')`` where Tunix says ``'fsdp'``."""
    shd = config.shd_config
    changes = {
        f.name: (ACTIVATION_BATCH, *getattr(shd, f.name)[1:])
        for f in dataclasses.fields(shd)
        if f.name.startswith("act_") and getattr(shd, f.name)[:1] == ("fsdp",)
    }
    return dataclasses.replace(config, shd_config=dataclasses.replace(shd, **changes))


def constrain(x: Any, spec: Sequence[Any]) -> Any:
    """``x`` constrained to ``spec`` (mesh axis names per dimension) on the mesh that
    ``jax.set_mesh`` set, axes that are not in the mesh or do not divide their dimension
    dropped; ``x`` itself outside a mesh or on a mesh of one device."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or mesh.size == 1:
        return x
    spec = tuple(spec) + (None,) * (x.ndim - len(spec))
    out = []
    for axes, dim in zip(spec, x.shape, strict=True):
        names = () if axes is None else (axes if isinstance(axes, tuple) else (axes,))
        names = tuple(a for a in names if a in mesh.shape)
        size = math.prod(mesh.shape[a] for a in names)
        out.append(names if names and size > 1 and dim % size == 0 else None)
    return jax.lax.with_sharding_constraint(x, jax.sharding.PartitionSpec(*out))


def _install_constraints() -> None:
    """The Tunix model modules' activation constraints through ``constrain``."""
    from tunix.models.gemma import model as gemma2
    from tunix.models.llama3 import model as llama3
    from tunix.models.qwen2 import model as qwen2
    from tunix.models.qwen3 import model as qwen3
    from tunix.utils import sharding_utils

    for module in (gemma2, llama3, qwen2, qwen3):
        module.shard = constrain
    original = sharding_utils.shard  # gemma3's; eager=True places an array (kept)

    def shard(x: Any, s: Sequence[Any], eager: bool = False) -> Any:
        return original(x, s, eager=True) if eager else constrain(x, s)

    if getattr(original, "__module__", None) != __name__:
        sharding_utils.shard = shard


_install_constraints()
