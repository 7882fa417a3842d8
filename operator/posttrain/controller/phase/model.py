"""What a job's phase is decided from and what it decides: the observations, causes and
summaries every source of cause (`pods`, `kueue`, `jobset`) shares."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from posttrain.api.spec import Phase

TERMINAL = {Phase.succeeded, Phase.failed}
CONDITION_TYPES = ["Queued", "Running", "Suspended", "Succeeded", "Failed"]
# status.message is a printer column: one line, short enough for a terminal; the
# condition carries the whole (one-line) text.
MESSAGE_MAX = 200
CONDITION_MESSAGE_MAX = 4000
# Reasons a user has to act on: their transitions are Warning Events.
WARNINGS = {
    "Unschedulable",
    "OOMKilled",
    "CrashLoopBackOff",
    "ErrImagePull",
    "InvalidImageName",
    "CreateContainerConfigError",
    "CreateContainerError",
    "Inadmissible",
    "Evicted",
    "PriorityClassNotFound",
    "JobCreationFailed",
    "PodCreationFailed",
}


@dataclass(frozen=True)
class Observation:
    phase: Phase
    reason: str
    message: str
    restarts: int = 0


@dataclass(frozen=True)
class Cause:
    """Why a pod does not run, in the words of the component that knows."""

    reason: str
    message: str
    rank: int  # lower: more telling (a container OOMKilled beats a pod waiting for it)
    final: bool = False  # no retry can fix it: the job fails with this cause


@dataclass(frozen=True)
class PodState:
    """What the phase needs of one pod."""

    name: str
    replicated_job: str
    job_index: int
    attempt: int | None  # the JobSet restart it belongs to
    running: bool  # every container runs
    done: bool  # succeeded
    cause: Cause | None = None
    owner_uid: str | None = None  # its controller, a Job (see `owned_pods`)
    started_at: str | None = None  # status.startTime: when the kubelet started it


@dataclass(frozen=True)
class WorkloadState:
    """What the phase needs of a Kueue Workload."""

    admitted: bool
    reason: str | None = None
    message: str | None = None
    name: str | None = None  # None: Kueue has made none (see without_workload)
    active: bool = True  # spec.active
    position: tuple[int, int] | None = None  # in its LocalQueue, its ClusterQueue (from 1)


def _true(obj: dict[str, Any], ctype: str) -> dict[str, Any] | None:
    for c in (obj.get("status") or {}).get("conditions") or []:
        if c.get("type") == ctype and c.get("status") == "True":
            return c
    return None
