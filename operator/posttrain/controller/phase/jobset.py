"""The JobSet's word, and its Jobs': the phase from the JobSet's conditions and its
replicated jobs' status, with the pods' and Kueue's causes (`phase_from`), and the
controllers' Events when the API server refuses what they create: the JobSet
controller's Jobs (`job_refusal`), the Job controller's pods (`pod_refusal`)."""

from __future__ import annotations

import re
from collections.abc import Collection, Iterable
from typing import Any

from posttrain.api.spec import USER_ERROR_EXIT_CODE, Phase
from posttrain.controller.phase.kueue import _pod_priority_class, _queued
from posttrain.controller.phase.model import Cause, Observation, PodState, WorkloadState, _true
from posttrain.render.jobset import KUEUE_QUEUE_LABEL


def _condition(jobset: dict[str, Any], ctype: str) -> dict[str, Any] | None:
    return _true(jobset, ctype)


def jobset_finished(jobset: dict[str, Any]) -> bool:
    """Whether the JobSet controller has finished the JobSet (Completed or Failed): it
    then deletes the JobSet's running Jobs itself and makes no new one."""
    return bool(_condition(jobset, "Completed") or _condition(jobset, "Failed"))


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


# The JobSet controller's Event when the API server refuses one of its Jobs; it retries
# (with backoff) for as long as the JobSet exists, and says so nowhere else.
JOB_CREATION_FAILED = "JobCreationFailed"
# The Job controller's Event when the API server refuses one of a Job's pods.
POD_CREATION_FAILED_EVENT = "FailedCreate"
POD_CREATION_FAILED = "PodCreationFailed"
# createJobs' wrapping of each refused Job's error (several are joined by newlines).
_CREATION_FAILED = re.compile(r'^job "([^"]*)" creation failed with error: ')
# Refusals that pass with time: a namespace's ResourceQuota (jobs, pods or resources in
# use), a namespace on its way out, an API server not yet ready.
_TRANSIENT = (
    "exceeded quota",
    "status unknown for quota",
    "because it is being terminated",
    "not yet ready to handle request",
    "no PriorityClass with name",  # `missing_priority_class` says it, naming the field
)


def refusal_event(event: dict[str, Any]) -> tuple[str, str, str] | None:
    """A JobSet's JobCreationFailed Event or a Job's FailedCreate Event, in core/v1's
    shape or events.k8s.io/v1's, as (the UID of the JobSet or Job, when it was last
    seen, its message); None for any other Event."""
    involved = event.get("involvedObject") or event.get("regarding") or {}
    wanted = {"JobSet": JOB_CREATION_FAILED, "Job": POD_CREATION_FAILED_EVENT}
    if wanted.get(involved.get("kind")) != event.get("reason"):
        return None
    times = [
        event.get("lastTimestamp"),
        event.get("deprecatedLastTimestamp"),
        event.get("eventTime"),
        (event.get("series") or {}).get("lastObservedTime"),
        (event.get("metadata") or {}).get("creationTimestamp"),
    ]
    seen = max((t[:19] for t in times if isinstance(t, str)), default="")
    return involved.get("uid") or "", seen, str(event.get("message") or event.get("note") or "")


# Refusals that stay until someone changes the cluster's rules or the job: the object is
# invalid (422), a ValidatingAdmissionPolicy, Pod Security or a LimitRange's bounds.
_FINAL = re.compile(
    r" is invalid: |ValidatingAdmissionPolicy|violates PodSecurity"
    r"|(maximum|minimum) \S+ usage per (Container|Pod)"
)
# Not refusals to report, steps of an ordinary start or restart: JobSet's pod webhook
# holds the other pods of a slice until its first is placed (exclusive placement); a
# restart's new Job waits for the one of the attempt before to be gone.
_STEPS = ("follower pod node selector for topology domain not found", " already exists")


def refusal_is_final(error: str) -> bool:
    """Whether the API server's refusal stays (`_FINAL`). Anything else, a quota, a
    terminating namespace, a webhook's denial (webhooks such as JobSet's own deny for a
    while), RBAC, the job waits for with the refusal said."""
    return not any(t in error for t in _TRANSIENT) and bool(_FINAL.search(error))


def _refusal(message: str) -> bool:
    return bool(message) and not any(step in message for step in _STEPS)


def job_refusal(
    jobset: dict[str, Any] | None,
    events: Iterable[tuple[str, str, str]],
    jobs_made: int,
) -> Cause | None:
    """Why the JobSet has fewer Jobs than it asks for, when the API server refuses them:
    the latest of its JobCreationFailed Events (`refusal_event`), in the API server's
    own words. Final (the job fails) for a refusal that stays (`refusal_is_final`), else
    the job waits while the JobSet controller retries. None once every Job is made."""
    if jobset is None:
        return None
    uid = jobset.get("metadata", {}).get("uid")
    mine = [(seen, m) for owner, seen, m in events if owner == uid and _refusal(m)]
    if not mine or jobs_made >= _expected_jobs(jobset):
        return None
    errors = max(mine)[1].strip().splitlines()
    job = _CREATION_FAILED.match(errors[0])
    error = _CREATION_FAILED.sub("", errors[0], count=1)
    more = f" (and {len(errors) - 1} more Jobs)" if len(errors) > 1 else ""
    name = f"Job {job.group(1)}" if job else "a Job"
    if refusal_is_final(error):
        return Cause(
            JOB_CREATION_FAILED,
            f"the API server refuses the JobSet's {name}{more}: {error}",
            0,
            final=True,
        )
    return Cause(
        JOB_CREATION_FAILED,
        f"the API server refused the JobSet's {name}{more} (the JobSet controller "
        f"retries): {error}",
        1,
    )


def pod_refusal(
    jobset: dict[str, Any] | None,
    events: Iterable[tuple[str, str, str]],
    jobs: Iterable[str],
    pods_made: int,
) -> Cause | None:
    """Why the JobSet's Jobs have fewer pods than they ask for, when the API server
    refuses them (a ResourceQuota, a LimitRange, Pod Security): the latest FailedCreate
    Event of its Jobs (`jobs`: their UIDs), in the API server's own words; final as in
    `job_refusal`. None once every pod is made."""
    if jobset is None or pods_made >= _expected_pods(jobset):
        return None
    mine = set(jobs)
    latest = max(
        ((seen, m) for uid, seen, m in events if uid in mine and _refusal(m)),
        default=None,
    )
    if latest is None:
        return None
    error = latest[1].strip().splitlines()[0].removeprefix("Error creating: ")
    if refusal_is_final(error):
        return Cause(
            POD_CREATION_FAILED, f"the API server refuses the Jobs' pods: {error}", 0, final=True
        )
    return Cause(
        POD_CREATION_FAILED,
        f"the API server refused the Jobs' pods (the Job controller retries): {error}",
        1,
    )


def _expected_jobs(jobset: dict[str, Any]) -> int:
    return sum(int(r.get("replicas", 1)) for r in jobset.get("spec", {}).get("replicatedJobs", []))


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


def phase_from(
    jobset: dict[str, Any] | None,
    user_suspended: bool,
    pods: Iterable[PodState] = (),
    workload: WorkloadState | None = None,
    blocked: Cause | None = None,
) -> Observation:
    """The phase that a JobSet, its pods and its Workload mean for the PostTrainJob;
    `blocked`: why no pod can be made (`missing_priority_class`, `job_refusal`): the
    job fails when that is final."""
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
    if blocked is not None and blocked.final:
        return Observation(Phase.failed, blocked.reason, blocked.message, restarts)
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
