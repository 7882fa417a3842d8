"""Decide a PostTrainJob's status from what runs it: pure functions, table-tested, one
module per source of cause (as JobSet keeps one file per policy): `pods` (the scheduler
and the kubelet), `kueue` (the Workload and its queue), `jobset` (the JobSet and its
Jobs: `phase_from`), `status` (the status written from an observation), over `model`.

The inputs are the JobSet, a summary of each of its pods (`pod_state`) and of its Kueue
Workload (`workload_state`); the controller gathers those from its watches.
`status_patch(...)` returns the status fields the operator owns (phase, message,
conditions, restarts, times). It never touches `progress`, which the trainer writes.

Running means the trainer runs: every pod of the leader slice (the first replicated job,
index 0) has all its containers running. Until then the job is Pending (Restarting after
a restart) with the reason it waits, from the real sources: Kueue's Workload conditions,
the scheduler's PodScheduled condition, the kubelet's container states, the JobSet
controller's Events when the API server refuses its Jobs (failed when that is final).
"""

from __future__ import annotations

from posttrain.controller.phase.jobset import (
    JOB_CREATION_FAILED,
    job_refusal,
    jobset_finished,
    missing_priority_class,
    phase_from,
    pod_refusal,
    refusal_event,
    refusal_is_final,
)
from posttrain.controller.phase.kueue import (
    INACTIVE_CLUSTER_QUEUE,
    cluster_queue_inactive,
    queue_positions,
    waits_in_queue,
    with_cluster_queue,
    without_workload,
    workload_activation,
    workload_state,
)
from posttrain.controller.phase.model import (
    CONDITION_MESSAGE_MAX,
    CONDITION_TYPES,
    MESSAGE_MAX,
    TERMINAL,
    WARNINGS,
    Cause,
    Observation,
    PodState,
    WorkloadState,
)
from posttrain.controller.phase.pods import (
    BACK_OFF,
    JOB_INDEX_LABEL,
    REPLICATED_JOB_LABEL,
    RESTART_ATTEMPT_LABEL,
    STARTING,
    controller_uid,
    owned_pods,
    pod_state,
)
from posttrain.controller.phase.status import (
    changed,
    conditions_for,
    observation_patch,
    one_line,
    outputs_for,
    status_patch,
    status_reason,
)

__all__ = [
    "BACK_OFF",
    "CONDITION_MESSAGE_MAX",
    "CONDITION_TYPES",
    "Cause",
    "INACTIVE_CLUSTER_QUEUE",
    "JOB_CREATION_FAILED",
    "JOB_INDEX_LABEL",
    "MESSAGE_MAX",
    "Observation",
    "PodState",
    "REPLICATED_JOB_LABEL",
    "RESTART_ATTEMPT_LABEL",
    "STARTING",
    "TERMINAL",
    "WARNINGS",
    "WorkloadState",
    "changed",
    "cluster_queue_inactive",
    "conditions_for",
    "controller_uid",
    "job_refusal",
    "jobset_finished",
    "missing_priority_class",
    "observation_patch",
    "one_line",
    "outputs_for",
    "owned_pods",
    "phase_from",
    "pod_refusal",
    "pod_state",
    "queue_positions",
    "refusal_event",
    "refusal_is_final",
    "status_patch",
    "status_reason",
    "waits_in_queue",
    "with_cluster_queue",
    "without_workload",
    "workload_activation",
    "workload_state",
]
