"""XLA's CPU settings for the trainer process, set before JAX starts its CPU backend.

XLA's default CPU scheduler orders a step for concurrency: it computes a rematerialised
layer's recomputation as early as it can, so a step with spec.training.remat: layer (or
block) holds what it would hold without remat. The memory-minimising scheduler waits for
the backward pass, as an accelerator's does, so remat saves host memory on CPU too
(tests/trainer/test_capacity_xla.py compiles the rematerialised steps with it; the CPU
examples' measured peaks are in docs/user-guide.md, "Running locally"). Only XLA's CPU
backend reads it; a setting of the flag already in XLA_FLAGS wins.
"""

from __future__ import annotations

import os
from collections.abc import MutableMapping
from typing import Any

from posttrain.api import rollout_split

SCHEDULER_FLAG = "xla_cpu_enable_concurrency_optimized_scheduler"
MEMORY_SCHEDULER = f"--{SCHEDULER_FLAG}=false"


def apply(environ: MutableMapping[str, str] = os.environ) -> str:
    """Adds MEMORY_SCHEDULER to XLA_FLAGS unless they set the scheduler; returns them."""
    flags = environ.get("XLA_FLAGS", "")
    if SCHEDULER_FLAG not in flags:
        flags = f"{flags} {MEMORY_SCHEDULER}".strip()
        environ["XLA_FLAGS"] = flags
    return flags


DEVICE_COUNT_FLAG = "xla_force_host_platform_device_count"
MAX_HOST_DEVICES = 64


def host_devices(spec: Any) -> int | None:
    """The CPU devices a CPU job's placement asks for: a disaggregated GRPO sampler needs
    the fewest devices its spec.grpo.rollout splits into whole trainer and sampler shares
    (samplerFraction 0.5: 2); None when one device does (XLA's default)."""
    if spec.resources.accelerator != "cpu" or not rollout_split.is_disaggregated(spec):
        return None
    for devices in range(2, MAX_HOST_DEVICES + 1):
        found, problem = rollout_split.split(spec, devices)
        if found is not None and problem is None:
            return devices
    return None


def apply_devices(spec: Any, environ: MutableMapping[str, str] = os.environ) -> int | None:
    """Give a CPU job the host devices its placement asks for (XLA_FLAGS, before JAX
    starts its CPU backend), unless XLA_FLAGS already set a count; returns the count."""
    devices = host_devices(spec)
    flags = environ.get("XLA_FLAGS", "")
    if devices is None or DEVICE_COUNT_FLAG in flags:
        return None
    environ["XLA_FLAGS"] = f"{flags} --{DEVICE_COUNT_FLAG}={devices}".strip()
    return devices
