"""Kueue's word: a job's Workload (admitted, or why not), its queue position, an inactive
ClusterQueue's reason, and the priority class Kueue waits for."""

from __future__ import annotations

import re
from collections.abc import Callable, Collection
from typing import Any

from posttrain.api.spec import Phase
from posttrain.controller.phase.model import Observation, WorkloadState, _true
from posttrain.render.jobset import KUEUE_PRIORITY_LABEL, KUEUE_QUEUE_LABEL


def workload_state(workload: dict[str, Any]) -> WorkloadState:
    """The summary of a Kueue Workload that `phase_from` decides from: admitted, or why
    not, in Kueue's words (its QuotaReserved/Admitted/Evicted conditions)."""
    name = (workload.get("metadata") or {}).get("name")
    if (workload.get("spec") or {}).get("active") is False:
        return WorkloadState(
            False, "Deactivated", "the Workload is deactivated (spec.active)", name, False
        )
    if _true(workload, "Admitted"):
        return WorkloadState(True, name=name)
    for ctype in ("Evicted", "Preempted"):
        if (c := _true(workload, ctype)) and c.get("reason") != "Deactivated":
            # (An eviction for a deactivation that is over stays until Kueue queues it.)
            return WorkloadState(False, c.get("reason") or ctype, c.get("message"), name)
    for c in (workload.get("status") or {}).get("conditions") or []:
        if (
            c.get("type") in ("QuotaReserved", "Admitted")
            and c.get("status") == "False"
            and c.get("message")
        ):
            return WorkloadState(False, c.get("reason") or "Pending", c["message"], name)
    return WorkloadState(False, name=name)


def workload_activation(user_suspended: bool, workload: WorkloadState | None) -> bool | None:
    """The spec.active a job's Kueue Workload must be set to, or None when it is right.

    Kueue starts a suspended job whose Workload it has admitted (it unsuspends the
    JobSet), so spec.scheduling.suspend alone cannot stop a job Kueue manages: Kueue's
    own way is to deactivate the Workload, which evicts it (the pods go, the quota is
    given back) and keeps the JobSet suspended; active again, it queues anew."""
    if workload is None or workload.name is None or workload.active != user_suspended:
        return None
    return not user_suspended


INACTIVE_CLUSTER_QUEUE = re.compile(r"^ClusterQueue (\S+) is inactive$")


def cluster_queue_inactive(cluster_queue: dict[str, Any]) -> str | None:
    """Why Kueue keeps a ClusterQueue inactive (its Active=False condition's message, e.g.
    `Can't admit new workloads: references missing ResourceFlavor(s): x.`), else None."""
    for c in (cluster_queue.get("status") or {}).get("conditions") or []:
        if c.get("type") == "Active" and c.get("status") == "False":
            return c.get("message") or c.get("reason") or "inactive"
    return None


def with_cluster_queue(
    state: WorkloadState, inactive: Callable[[str], str | None]
) -> WorkloadState:
    """A Workload's `ClusterQueue X is inactive` with why, from X's own condition
    (`inactive(name)`: an inactive ClusterQueue's message, else None)."""
    match = INACTIVE_CLUSTER_QUEUE.match(state.message or "")
    if match and (why := inactive(match.group(1))):
        return WorkloadState(state.admitted, state.reason, f"{state.message}: {why}")
    return state


def _pod_priority_class(jobset: dict[str, Any]) -> str | None:
    """The first PriorityClass a replicated job's pods name (the one Kueue reads)."""
    for r in jobset.get("spec", {}).get("replicatedJobs") or []:
        pod_spec = (((r.get("template") or {}).get("spec") or {}).get("template") or {}).get(
            "spec"
        ) or {}
        if pod_spec.get("priorityClassName"):
            return pod_spec["priorityClassName"]
    return None


def without_workload(
    jobset: dict[str, Any] | None,
    workload_priority_classes: Collection[str] | None,
    priority_classes: Collection[str] | None,
) -> WorkloadState | None:
    """Why Kueue has made no Workload for a queued JobSet, when the class it takes the
    priority from does not exist; None when nothing says so. Kueue takes the priority
    from the JobSet's WorkloadPriorityClass label, else from its pods' PriorityClass, and
    while that class is missing it makes no Workload and records no Event: its error, in
    the words used here, is only in its own log. The collections hold the names of the
    classes that exist (None: not known)."""
    if jobset is None or not (labels := jobset.get("metadata", {}).get("labels") or {}).get(
        KUEUE_QUEUE_LABEL
    ):
        return None
    if name := labels.get(KUEUE_PRIORITY_LABEL):
        known, kind = workload_priority_classes, "WorkloadPriorityClass.kueue.x-k8s.io"
        field = "spec.scheduling.workloadPriorityClass"
    elif name := _pod_priority_class(jobset):
        known, kind = priority_classes, "PriorityClass.scheduling.k8s.io"
        field = "spec.scheduling.priorityClass"
    else:
        return None
    if known is None or name in known:
        return None
    return WorkloadState(
        False,
        "PriorityClassNotFound",
        f'{kind} "{name}" not found: Kueue makes no Workload until it exists ({field})',
    )


def queue_positions(summary: dict[str, Any]) -> dict[str, tuple[int, int]]:
    """Positions (from 1) in its LocalQueue and its ClusterQueue of each pending Workload
    by name, from a PendingWorkloadsSummary of Kueue's visibility API."""
    return {
        item["metadata"]["name"]: (
            int(item.get("positionInLocalQueue", 0)) + 1,
            int(item.get("positionInClusterQueue", 0)) + 1,
        )
        for item in summary.get("items") or []
        if (item.get("metadata") or {}).get("name")
    }


def waits_in_queue(workload: WorkloadState | None) -> bool:
    """Whether a Workload waits in its queue, so that Kueue's visibility API has its
    position (asked once per LocalQueue, see watches)."""
    return (
        workload is not None and bool(workload.name) and workload.active and not (workload.admitted)
    )


def _queued(jobset: dict[str, Any], workload: WorkloadState | None, restarts: int) -> Observation:
    queue = jobset.get("metadata", {}).get("labels", {}).get(KUEUE_QUEUE_LABEL)
    where = f"Kueue queue {queue!r}"
    if workload is not None and workload.position:
        in_local, in_cluster = workload.position
        where += f", position {in_local}" + (
            f" ({in_cluster} in its ClusterQueue)" if in_cluster != in_local else ""
        )
    if workload is not None and workload.message:
        return Observation(
            Phase.queued,
            workload.reason or "WaitingForAdmission",
            f"{where}: {workload.message}",
            restarts,
        )
    if workload is not None and workload.position:
        return Observation(Phase.queued, "WaitingForAdmission", where, restarts)
    return Observation(Phase.queued, "WaitingForAdmission", f"waiting for {where}", restarts)
