"""How a GRPO job's devices split between the trainer and the sampler
(spec.grpo.rollout): one rule, checked at admission (from the catalog's host and device
counts), shown in the rendered JobSet and the job's status, and applied by the trainer
(to the devices it finds)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# The JobSet annotation that says how a disaggregated GRPO job's devices split; the
# operator repeats it in status.message (the MESSAGE column) while the job runs.
ANNOTATION = "posttrain.dev/rollout-placement"


@dataclass(frozen=True)
class Split:
    trainer_devices: int
    sampler_devices: int
    slices: int  # slices of the job (1 unless TPU multi-slice)
    sampler_slices: int  # 0 when the sampler takes a share of one slice

    def describe(self) -> str:
        """One line for the status message and the JobSet annotation."""
        if self.sampler_slices:
            t = self.slices - self.sampler_slices
            return (
                f"trainer {t} slice{'s' * (t > 1)} ({self.trainer_devices} devices), "
                f"sampler {self.sampler_slices} slice{'s' * (self.sampler_slices > 1)} "
                f"({self.sampler_devices} devices)"
            )
        return f"trainer {self.trainer_devices} devices, sampler {self.sampler_devices} devices"


def is_disaggregated(spec: Any) -> bool:
    return spec.grpo is not None and str(spec.grpo.rollout.placement) == "disaggregated"


def split(spec: Any, devices: int) -> tuple[Split | None, tuple[str, str] | None]:
    """The split of `devices` (all the job's devices) that spec.grpo.rollout asks for, or
    (None, (field, message)) when it cannot work. (None, None) when colocated."""
    if not is_disaggregated(spec):
        return None, None
    rollout, slices = spec.grpo.rollout, spec.resources.slices
    if rollout.sampler_slices is not None:
        if rollout.sampler_slices >= slices:
            return None, (
                "spec.grpo.rollout.samplerSlices",
                f"{rollout.sampler_slices} sampler slices leave none of the "
                f"{slices} (resources.slices) to the trainer",
            )
        per_slice = devices // slices
        sampler = rollout.sampler_slices * per_slice
        return Split(devices - sampler, sampler, slices, rollout.sampler_slices), None
    field = "spec.grpo.rollout.samplerFraction"
    if devices < 2:
        return None, (
            field,
            "the job has a single device: a sampler share leaves none to the trainer; use "
            "placement colocated",
        )
    fraction = rollout.sampler_fraction or 0.0
    share = fraction * devices
    sampler = round(share)
    if abs(share - sampler) > 1e-6 or not 1 <= sampler <= devices - 1:
        whole = ", ".join(f"{n / devices:g} = {n}" for n in range(1, min(devices, 4)))
        return None, (
            field,
            f"{fraction:g} of the job's {devices} devices is {share:g} devices; the sampler "
            f"and the trainer each need a whole number of devices ({whole})",
        )
    return Split(devices - sampler, sampler, slices, 0), None


def describe(spec: Any, devices: int | None) -> str | None:
    """How the job's devices split (None when colocated). `devices` None (CPU, counted by
    the trainer): the share as the spec gives it."""
    if not is_disaggregated(spec):
        return None
    if devices is not None:
        found, _ = split(spec, devices)
        if found is not None:
            return found.describe()
    rollout = spec.grpo.rollout
    if rollout.sampler_slices is not None:
        return f"sampler {rollout.sampler_slices} of {spec.resources.slices} slices"
    return f"sampler {rollout.sampler_fraction:g} of the devices"


def multi_host_error(spec: Any, hosts: int) -> tuple[str, str] | None:
    """Disaggregation moves weights between meshes of one program: over several hosts
    that needs Pathways (one controller sees every device)."""
    if is_disaggregated(spec) and hosts > 1 and not spec.resources.pathways.enabled:
        return (
            "spec.grpo.rollout.placement",
            f"disaggregated placement over {hosts} hosts needs resources.pathways.enabled: "
            "without one controller that sees every device, weights cannot move between "
            "the trainer's and the sampler's meshes",
        )
    return None


def job_devices(job: Any, placement: Any) -> int | None:
    """Every device of the job on its catalog placement (None for CPU: the trainer
    counts what it finds)."""
    res = job.spec.resources
    if placement.is_tpu:
        return placement.hosts * placement.devices_per_host * res.slices
    if placement.kind == "gpu":
        return res.nodes * max(placement.devices_per_host, 1)
    return None
