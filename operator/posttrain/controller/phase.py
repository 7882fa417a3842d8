"""Decide a PostTrainJob's status from what runs it: pure functions, table-tested.

The inputs are the JobSet, a summary of each of its pods (`pod_state`) and of its Kueue
Workload (`workload_state`); the controller gathers those from its watches.
`status_patch(...)` returns the status fields the operator owns (phase, message,
conditions, restarts, times). It never touches `progress`, which the trainer writes.

Running means the trainer runs: every pod of the leader slice (the first replicated job,
index 0) has all its containers running. Until then the job is Pending (Restarting after
a restart) with the reason it waits, from the real sources: Kueue's Workload conditions,
the scheduler's PodScheduled condition, the kubelet's container states.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass
from typing import Any

from posttrain.api.locations import GS, PATH, location_error
from posttrain.api.spec import USER_ERROR_EXIT_CODE, Phase
from posttrain.render.jobset import KUEUE_PRIORITY_LABEL, KUEUE_QUEUE_LABEL

TERMINAL = {Phase.succeeded, Phase.failed}
CONDITION_TYPES = ["Queued", "Running", "Suspended", "Succeeded", "Failed"]
# status.message is a printer column: one line, short enough for a terminal; the
# condition carries the whole (one-line) text.
MESSAGE_MAX = 200
CONDITION_MESSAGE_MAX = 4000

REPLICATED_JOB_LABEL = "jobset.sigs.k8s.io/replicatedjob-name"
JOB_INDEX_LABEL = "jobset.sigs.k8s.io/job-index"
RESTART_ATTEMPT_LABEL = "jobset.sigs.k8s.io/restart-attempt"
# Container waiting reasons that are only steps of a normal start.
STARTING = {"ContainerCreating", "PodInitializing"}
# The kubelet's ImagePullBackOff message: `Back-off pulling image "IMAGE": ERROR: MESSAGE`
# of the last pull (ERROR ErrImagePull, RegistryUnavailable, ...).
BACK_OFF = re.compile(r'^Back-off pulling image "[^"]*"(: [A-Za-z]+: )?')
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


def _condition(jobset: dict[str, Any], ctype: str) -> dict[str, Any] | None:
    return _true(jobset, ctype)


def _container_cause(pod_name: str, spec: dict[str, Any], cs: dict[str, Any]) -> Cause | None:
    name = cs.get("name", "?")
    for state in (cs.get("state") or {}, cs.get("lastState") or {}):
        if (state.get("terminated") or {}).get("reason") == "OOMKilled":
            resources = next(
                (
                    c.get("resources") or {}
                    for c in spec.get("containers", []) + spec.get("initContainers", [])
                    if c.get("name") == name
                ),
                {},
            )
            limit = (resources.get("limits") or {}).get("memory")
            request = (resources.get("requests") or {}).get("memory")
            where = (
                f"its limit {limit}"
                if limit
                else "the node's memory (no memory limit"
                + (f"; it requested {request})" if request else ")")
            )
            return Cause(
                "OOMKilled",
                f"container {name} of pod {pod_name} was killed for using more memory than {where}",
                0,
            )
    waiting = (cs.get("state") or {}).get("waiting") or {}
    reason = waiting.get("reason")
    if not reason or reason in STARTING:
        return None
    detail = waiting.get("message") or ""
    if reason in ("ErrImagePull", "ImagePullBackOff", "InvalidImageName"):
        if reason == "ImagePullBackOff":
            # The kubelet alternates ErrImagePull and ImagePullBackOff while it retries; the
            # back-off's message wraps the pull's error. One reason and the pull's error
            # alone keep the status (and its Events) still.
            reason, detail = "ErrImagePull", BACK_OFF.sub("", detail, count=1)
        text = f"container {name} of pod {pod_name} cannot pull image {cs.get('image')!r}"
        return Cause(reason, f"{text}: {detail}" if detail else text, 1)
    if reason == "CrashLoopBackOff":
        last = (cs.get("lastState") or {}).get("terminated") or {}
        exit_code = f", last exit code {last['exitCode']}" if "exitCode" in last else ""
        return Cause(
            reason,
            f"container {name} of pod {pod_name} keeps crashing "
            f"({cs.get('restartCount', 0)} restarts{exit_code})",
            1,
        )
    text = f"container {name} of pod {pod_name}: {reason}"
    return Cause(reason, f"{text}: {detail}" if detail else text, 1)


def controller_uid(obj: dict[str, Any], kind: str) -> str | None:
    """The UID of `obj`'s controller (its ownerReference with controller: true) when that
    is a `kind`."""
    for ref in (obj.get("metadata") or {}).get("ownerReferences") or []:
        if ref.get("controller") and ref.get("kind") == kind:
            return ref.get("uid")
    return None


def owned_pods(
    pods: Iterable[PodState], jobs: Iterable[tuple[str, str | None]], jobset_uid: str
) -> list[PodState]:
    """The pods whose owner chain leads to the JobSet: each pod's controller is a Job
    (`jobs`: (Job UID, its controller's UID)) whose controller is the JobSet. A pod that
    only carries a job's name label counts for nothing."""
    mine = {uid for uid, owner in jobs if owner == jobset_uid}
    return [p for p in pods if p.owner_uid is not None and p.owner_uid in mine]


def pod_state(pod: dict[str, Any]) -> PodState:
    """The summary of one of a JobSet's pods that `phase_from` decides from."""
    meta, spec, status = pod.get("metadata", {}), pod.get("spec", {}), pod.get("status") or {}
    labels = meta.get("labels") or {}
    name = meta.get("name", "?")
    statuses = status.get("containerStatuses") or []
    running = (
        status.get("phase") == "Running"
        and len(statuses) >= len(spec.get("containers") or [None])
        and all("running" in (cs.get("state") or {}) for cs in statuses)
    )
    causes = [
        c
        for cs in (status.get("initContainerStatuses") or []) + statuses
        if (c := _container_cause(name, spec, cs))
    ]
    for c in status.get("conditions") or []:
        if c.get("type") == "PodScheduled" and c.get("status") == "False":
            if c.get("reason") == "SchedulingGated":
                gates = ", ".join(g.get("name", "?") for g in spec.get("schedulingGates") or [])
                causes.append(
                    Cause("SchedulingGated", f"pod {name} is held by scheduling gates {gates}", 3)
                )
            else:
                # The scheduler's summary; what follows ". preemption:" is its own bookkeeping.
                message = (c.get("message") or "").split(" preemption:")[0].rstrip()
                causes.append(
                    Cause(c.get("reason") or "Unschedulable", f"pod {name}: {message}", 2)
                )
    attempt = labels.get(RESTART_ATTEMPT_LABEL)
    return PodState(
        owner_uid=controller_uid(pod, "Job"),
        name=name,
        replicated_job=labels.get(REPLICATED_JOB_LABEL, ""),
        job_index=int(labels.get(JOB_INDEX_LABEL) or 0),
        attempt=int(attempt) if attempt and attempt.isdigit() else None,
        running=running,
        done=status.get("phase") == "Succeeded",
        cause=min(causes, key=lambda c: c.rank) if causes else None,
    )


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


def missing_priority_class(
    jobset: dict[str, Any] | None, priority_classes: Collection[str] | None
) -> Cause | None:
    """Why a JobSet outside Kueue has no pods, when the PriorityClass its pods name does
    not exist: the Job controller creates none (the API server refuses each, `no
    PriorityClass with name X was found`) and says so only in the Job's Events. None
    when nothing says so (`priority_classes`: the names that exist, None: not known)."""
    if jobset is None or priority_classes is None:
        return None
    if (jobset.get("metadata", {}).get("labels") or {}).get(KUEUE_QUEUE_LABEL):
        return None  # Kueue's case: without_workload
    name = _pod_priority_class(jobset)
    if not name or name in priority_classes:
        return None
    return Cause(
        "PriorityClassNotFound",
        f'PriorityClass.scheduling.k8s.io "{name}" not found: the Job controller creates no '
        "pods until it exists (spec.scheduling.priorityClass)",
        1,
    )


def _leader(jobset: dict[str, Any]) -> tuple[str, int, int]:
    """The first replicated job's name, its pods per Job, and its Jobs."""
    first = (jobset.get("spec", {}).get("replicatedJobs") or [{}])[0]
    pods = int(((first.get("template") or {}).get("spec") or {}).get("parallelism") or 1)
    return first.get("name", ""), pods, int(first.get("replicas", 1))


def _expected_pods(jobset: dict[str, Any]) -> int:
    return sum(
        int(r.get("replicas", 1))
        * int(((r.get("template") or {}).get("spec") or {}).get("parallelism") or 1)
        for r in jobset.get("spec", {}).get("replicatedJobs", [])
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


def phase_from(
    jobset: dict[str, Any] | None,
    user_suspended: bool,
    pods: Iterable[PodState] = (),
    workload: WorkloadState | None = None,
    blocked: Cause | None = None,
) -> Observation:
    """The phase that a JobSet, its pods and its Workload mean for the PostTrainJob;
    `blocked`: why no pod can be made (`missing_priority_class`)."""
    if jobset is None:
        return Observation(Phase.pending, "Creating", "creating the JobSet")
    status = jobset.get("status") or {}
    restarts = int(status.get("restarts") or 0)
    # Pods of an earlier attempt are on their way out.
    pods = [p for p in pods if p.attempt is None or p.attempt == restarts]
    causes = sorted((p.cause for p in pods if p.cause), key=lambda c: c.rank)
    if c := _condition(jobset, "Completed"):
        return Observation(
            Phase.succeeded, "Completed", c.get("message") or "training finished", restarts
        )
    if c := _condition(jobset, "Failed"):
        if c.get("reason") == "FailJobSetFailurePolicyAction":
            # Only the UserError rule fails the JobSet at once (see render.jobset).
            return Observation(
                Phase.failed,
                "InvalidInput",
                f"the trainer exited with code {USER_ERROR_EXIT_CODE}: an error in the job's "
                "own input (data, model or config) that a restart cannot fix; its log names "
                f"the field or file ({c.get('message', '')})",
                restarts,
            )
        message = c.get("message") or "JobSet failed"
        if causes and causes[0].rank == 0:
            return Observation(
                Phase.failed, causes[0].reason, f"{causes[0].message} ({message})", restarts
            )
        return Observation(Phase.failed, c.get("reason") or "JobSetFailed", message, restarts)
    if user_suspended and (
        jobset.get("spec", {}).get("suspend") or (workload is not None and workload.name)
    ):
        # With Kueue, Suspended from the user's word on: Kueue may start the JobSet once
        # more before it sees the Workload deactivated, and then stops it for good.
        return Observation(
            Phase.suspended, "Suspended", "suspended by spec.scheduling.suspend", restarts
        )
    if jobset.get("spec", {}).get("suspend"):
        if jobset.get("metadata", {}).get("labels", {}).get(KUEUE_QUEUE_LABEL):
            return _queued(jobset, workload, restarts)
        return Observation(Phase.suspended, "Suspended", "the JobSet is suspended", restarts)
    if workload is not None and not workload.admitted:
        # Kueue has not admitted it (or evicted it) and suspends it again: a user's resume
        # before admission, or an eviction on its way. Queued, not a moment of Pending.
        return _queued(jobset, workload, restarts)
    leader, leader_pods, leader_jobs = _leader(jobset)
    expected = _expected_pods(jobset)
    up = sum(1 for p in pods if p.running or p.done)
    leader_up = sum(
        1 for p in pods if p.replicated_job == leader and p.job_index == 0 and (p.running or p.done)
    )
    # Ready Jobs have all their pods ready, so running: the JobSet may know before the
    # pods' own events arrive.
    jobs = {r.get("name"): r for r in status.get("replicatedJobsStatus") or []}
    ready_jobs = int(jobs.get(leader, {}).get("ready") or 0) + int(
        jobs.get(leader, {}).get("succeeded") or 0
    )
    if pods:
        count = f"{up} of {expected} pods running"
    else:
        count = f"{ready_jobs} of {leader_jobs} {leader} jobs ready"
    if leader_up >= leader_pods or ready_jobs >= leader_jobs:
        return Observation(Phase.running, "Running", count, restarts)
    waiting = causes[0] if causes else blocked
    if restarts:
        return Observation(
            Phase.restarting,
            waiting.reason if waiting else "Restarting",
            f"restart {restarts}: {waiting.message if waiting else count}",
            restarts,
        )
    if waiting:
        return Observation(Phase.pending, waiting.reason, waiting.message, restarts)
    if pods:
        return Observation(Phase.pending, "PodsStarting", count, restarts)
    return Observation(Phase.pending, "WaitingForPods", "waiting for pods to start", restarts)


def conditions_for(
    obs: Observation, previous: list[dict[str, Any]], now: str, generation: int | None
) -> list[dict[str, Any]]:
    """One condition per type; lastTransitionTime moves only when status flips."""
    before = {c.get("type"): c for c in previous or []}
    true_types = {
        Phase.queued: {"Queued"},
        Phase.running: {"Running"},
        Phase.restarting: {"Running"},
        Phase.suspended: {"Suspended"},
        Phase.succeeded: {"Succeeded"},
        Phase.failed: {"Failed"},
        Phase.pending: set(),
    }[obs.phase]
    # A Pending job has no True condition; Running=False says why it does not run.
    explained = true_types or {"Running"}
    out = []
    for ctype in CONDITION_TYPES:
        status = "True" if ctype in true_types else "False"
        old = before.get(ctype, {})
        cond = {
            "type": ctype,
            "status": status,
            "reason": obs.reason if ctype in explained else f"Not{ctype}",
            "message": obs.message if ctype in explained else f"phase is {obs.phase}",
            "lastTransitionTime": old.get("lastTransitionTime", now)
            if old.get("status") == status
            else now,
        }
        if generation is not None:
            cond["observedGeneration"] = generation
        out.append(cond)
    return out


def outputs_for(output_uri: Any) -> dict[str, str]:
    """Where the job's outputs go; nothing for a URI validate refuses (it may carry a
    credential, `gs://TOKEN@bucket`, which never reaches the status)."""
    if not isinstance(output_uri, str) or not output_uri:
        return {}
    if location_error(output_uri, (PATH, GS)) is not None:
        return {}
    base = output_uri.rstrip("/")
    return {
        "checkpoints": f"{base}/checkpoints",
        "tensorboard": f"{base}/tensorboard",
        "hfExport": f"{base}/hf",
    }


def one_line(text: str, limit: int = MESSAGE_MAX) -> str:
    """`text` as one line of at most `limit` characters: control characters (newlines,
    ESC, ...) escaped, so that text from elsewhere cannot forge lines or terminal codes."""
    out = "".join(
        c if c.isprintable() else c.encode("unicode_escape").decode("ascii") for c in text
    )
    return out if len(out) <= limit else out[: limit - 1] + "…"


def _patch(
    obs: Observation,
    jobset: dict[str, Any] | None,
    spec: dict[str, Any],
    previous: dict[str, Any],
    now: str,
    generation: int | None,
) -> dict[str, Any]:
    message = obs.message
    obs = Observation(obs.phase, obs.reason, one_line(message, CONDITION_MESSAGE_MAX), obs.restarts)
    patch: dict[str, Any] = {
        "phase": str(obs.phase),
        "message": one_line(message),
        "conditions": conditions_for(obs, previous.get("conditions", []), now, generation),
        "restarts": obs.restarts,
    }
    output = spec.get("output")
    if outputs := outputs_for(output.get("uri") if isinstance(output, dict) else None):
        patch["outputs"] = outputs
    if generation is not None:
        patch["observedGeneration"] = generation
    if jobset is not None:
        patch["jobSetName"] = jobset["metadata"]["name"]
    if obs.phase in (Phase.running, Phase.restarting, Phase.succeeded, Phase.failed):
        patch["startTime"] = previous.get("startTime") or now
    if obs.phase in TERMINAL:
        patch["completionTime"] = previous.get("completionTime") or now
    return patch


def status_patch(
    jobset: dict[str, Any] | None,
    spec: dict[str, Any],
    previous: dict[str, Any] | None,
    now: str,
    generation: int | None,
    pods: Iterable[PodState] = (),
    workload: WorkloadState | None = None,
    blocked: Cause | None = None,
) -> dict[str, Any]:
    """The status fields the operator owns, given the JobSet (None before it exists), the
    summaries of its pods and of its Kueue Workload (None without Kueue), and why no pod
    can be made (`missing_priority_class`)."""
    previous = previous or {}
    pods = list(pods)
    user_suspended = bool(spec.get("scheduling", {}).get("suspend"))
    obs = phase_from(jobset, user_suspended, pods, workload, blocked)
    if previous.get("phase") in TERMINAL and obs.phase not in TERMINAL:
        # A finished job stays finished, even once ttlSecondsAfterFinished removed its JobSet.
        return {}
    if (
        previous.get("phase") == Phase.running
        and obs.phase == Phase.pending
        and obs.reason in ("WaitingForPods", "PodsStarting")
        and all(p.running or p.done for p in pods)
    ):
        # Between pods finishing and their Jobs being marked complete nothing is active
        # (and a pod's events may trail the JobSet's): a running job does not go back to
        # Pending for that.
        obs = Observation(Phase.running, "Running", "pods finishing", obs.restarts)
    return _patch(obs, jobset, spec, previous, now, generation)


def status_reason(status: dict[str, Any]) -> str | None:
    """The reason of a status's phase: the True condition's, or for Pending the Running
    condition's (why it does not run)."""
    conditions = status.get("conditions") or []
    for c in conditions:
        if c.get("status") == "True":
            return c.get("reason")
    return next((c.get("reason") for c in conditions if c.get("type") == "Running"), None)


def observation_patch(
    obs: Observation,
    spec: dict[str, Any],
    previous: dict[str, Any] | None,
    now: str,
    generation: int | None,
) -> dict[str, Any]:
    """Status for a job whose objects could not all be made (invalid spec, refused by the
    API server, a foreign object in the way, a leftover to wait for); empty once the job
    has finished."""
    previous = previous or {}
    if previous.get("phase") in TERMINAL:
        return {}
    return _patch(obs, None, spec, previous, now, generation)


def changed(previous: dict[str, Any] | None, patch: dict[str, Any]) -> bool:
    """Whether applying patch would change anything but timestamps-only noise."""
    previous = previous or {}
    return any(previous.get(k) != v for k, v in patch.items())
