"""Multi-host setup from the environment the renderer puts into each pod.

JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES, POSTTRAIN_JOB_INDEX and
POSTTRAIN_PODS_PER_JOB come from the JobSet; JOB_COMPLETION_INDEX from the Indexed Job.
The process id is job_index * pods_per_job + completion_index. JAX_PROCESS_ID, when set,
wins (handy for running several processes by hand on one machine).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass

log = logging.getLogger("posttrain.distributed")


@dataclass(frozen=True)
class ProcessInfo:
    coordinator: str | None
    num_processes: int
    process_id: int

    @property
    def multi_process(self) -> bool:
        return self.num_processes > 1


def process_info(env: Mapping[str, str] | None = None) -> ProcessInfo:
    """Read this process's place in the job from the environment (pure)."""
    env = os.environ if env is None else env
    num = int(env.get("JAX_NUM_PROCESSES", "1") or 1)
    if "JAX_PROCESS_ID" in env:
        pid = int(env["JAX_PROCESS_ID"])
    else:
        job_index = int(env.get("POSTTRAIN_JOB_INDEX", "0") or 0)
        pods = int(env.get("POSTTRAIN_PODS_PER_JOB", "1") or 1)
        pid = job_index * pods + int(env.get("JOB_COMPLETION_INDEX", "0") or 0)
    if not 0 <= pid < num:
        raise ValueError(f"process id {pid} is outside 0..{num - 1} (JAX_NUM_PROCESSES={num})")
    return ProcessInfo(env.get("JAX_COORDINATOR_ADDRESS"), num, pid)


def initialize(info: ProcessInfo) -> None:
    """Start jax.distributed when the job has several processes (before any JAX use)."""
    if not info.multi_process or os.environ.get("JAX_PLATFORMS") == "proxy":
        return  # one process, or Pathways: a single controller drives every host
    import jax

    if (os.environ.get("JAX_PLATFORMS") or "cpu").startswith("cpu"):
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    log.info(
        "jax.distributed: process %d of %d via %s",
        info.process_id,
        info.num_processes,
        info.coordinator,
    )
    jax.distributed.initialize(
        coordinator_address=info.coordinator,
        num_processes=info.num_processes,
        process_id=info.process_id,
    )
