"""What one reconcile of a job does, decided from the job and what the watches observed
of it: pure functions, table-tested. `phase.status_patch` decides the status; this adds
when to make the job's objects, which Events to post, what the JobSet needs of the
job's mutable spec.scheduling fields, and how a failed job's JobSet is stopped
(`stop_failed`). `reconcile` gathers the inputs and carries it out.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from posttrain.api.spec import Phase
from posttrain.controller import deadline
from posttrain.controller.phase import (
    TERMINAL,
    WARNINGS,
    Cause,
    Observation,
    PodState,
    WorkloadState,
    changed,
    jobset_finished,
    observation_patch,
    status_patch,
    status_reason,
    workload_activation,
)
from posttrain.controller.watches import SCHEDULING_ANNOTATION
from posttrain.render.jobset import KUEUE_PRIORITY_LABEL, scheduling_patch

SCHEDULING_FIELDS = ("suspend", "ttlSecondsAfterFinished", "workloadPriorityClass")


@dataclass(frozen=True)
class Event:
    type: str  # Normal or Warning
    reason: str
    message: str


@dataclass(frozen=True)
class Observed:
    """The job's children as the watches last saw them."""

    jobset: dict[str, Any] | None = None  # the JobSet the job owns (by UID)
    pods: tuple[PodState, ...] = ()
    workload: WorkloadState | None = None
    blocked: Cause | None = None  # why no pod can be made (phase.missing_priority_class)
    # The operator already ended the Jobs of the JobSet's current attempt (`restart`).
    restart_requested: bool = False
    # The job's preflight pods (`preflight.pod_state`), before its JobSet is made.
    preflight: tuple[Any, ...] = ()
    # Every job's preflight pods and Jobs of a program key (watches.preflight_of_key).
    preflight_of_key: Callable[[str], tuple[list[Any], list[Any]]] | None = None


@dataclass
class Actions:
    create: bool = False  # make the job's objects: its JobSet is not there
    status: dict[str, Any] | None = None  # the status patch, when the status changes
    events: list[Event] = field(default_factory=list)  # posted once the status is written
    jobset_patch: dict[str, Any] = field(default_factory=dict)
    jobset_events: list[Event] = field(default_factory=list)  # once the JobSet is patched
    workload_active: bool | None = None  # the Workload's spec.active, when it must change
    # The trainer stopped reporting: end the Jobs of the JobSet's current attempt (the
    # JobSet controller restarts it, counted against maxRestarts); this Event once done.
    restart: Event | None = None
    check_in: float | None = None  # look again in this many seconds (a deadline to check)


def status_event(previous: dict[str, Any], patch: dict[str, Any]) -> Event | None:
    """An Event for each new phase, and for each new reason to act on (Unschedulable, then
    ImagePullBackOff, ...): named by that reason (a failure too), else by the phase."""
    if not patch:
        return None
    reason = status_reason(patch)
    warning = patch["phase"] == "Failed" or reason in WARNINGS
    if patch["phase"] == previous.get("phase") and not (
        warning and reason != status_reason(previous)
    ):
        return None
    return Event(
        "Warning" if warning else "Normal",
        (reason if warning else None) or patch["phase"],
        patch.get("message", ""),
    )


def status_write(previous: dict[str, Any], patch: dict[str, Any]) -> Actions:
    """Write `patch` (and its Event) only when it changes the status."""
    if not changed(previous, patch):
        return Actions()
    event = status_event(previous, patch)
    return Actions(status=patch, events=[event] if event else [])


def desired_scheduling(spec: dict[str, Any]) -> dict[str, Any]:
    scheduling = spec.get("scheduling") or {}
    return {k: scheduling.get(k) for k in SCHEDULING_FIELDS if k != "suspend"} | {
        "suspend": bool(scheduling.get("suspend"))
    }


def scheduling_annotation(spec: dict[str, Any]) -> str:
    """The value of the JobSet's SCHEDULING_ANNOTATION for a job's spec."""
    return json.dumps(desired_scheduling(spec), sort_keys=True)


def scheduling_update(spec: dict[str, Any], jobset: dict[str, Any]) -> tuple[dict, list[Event]]:
    """The JobSet merge patch for the job's spec.scheduling fields that changed since
    the JobSet was made or last patched (its SCHEDULING_ANNOTATION), with a Suspending or
    Resuming Event. Kueue suspends and resumes JobSets itself: only a change of the
    job's own spec.scheduling.suspend moves the JobSet's, and a job in a Kueue queue is
    resumed by Kueue alone."""
    desired = desired_scheduling(spec)
    meta = jobset.get("metadata") or {}
    try:
        applied = json.loads((meta.get("annotations") or {})[SCHEDULING_ANNOTATION])
    except (KeyError, TypeError, ValueError):  # made before the annotation existed
        applied = {
            "suspend": desired["suspend"],
            "ttlSecondsAfterFinished": (jobset.get("spec") or {}).get("ttlSecondsAfterFinished"),
            "workloadPriorityClass": (meta.get("labels") or {}).get(KUEUE_PRIORITY_LABEL),
        }
    patch = scheduling_patch(applied, desired)
    if not patch:
        return {}, []
    if (spec.get("scheduling") or {}).get("queue") and not desired["suspend"]:
        # Kueue starts the JobSet once it admits the Workload again (the Workload is
        # active again: `workload_activation`); started here, ahead of that admission,
        # Kueue would suspend it again and the job would flap Pending, Queued, Pending.
        patch.get("spec", {}).pop("suspend", None)
        if not patch.get("spec", True):
            patch.pop("spec")
    patch.setdefault("metadata", {})["annotations"] = {
        SCHEDULING_ANNOTATION: json.dumps(desired, sort_keys=True)
    }
    events = []
    if bool(applied.get("suspend")) != desired["suspend"]:
        events.append(
            Event(
                "Normal",
                "Suspending" if desired["suspend"] else "Resuming",
                "spec.scheduling.suspend changed",
            )
        )
    return patch, events


def stop_failed(
    phase: str | None, jobset: dict[str, Any] | None, workload: WorkloadState | None
) -> Actions:
    """What stops the JobSet of a job in `phase` when the job failed and the JobSet
    controller has not finished the JobSet itself (a refusal of its Jobs or pods that
    stays): the JobSet suspended (kept to look at; its Jobs suspended, so the Job
    controller makes no pod) and, under Kueue, its Workload deactivated, which evicts it
    and gives its quota back (Kueue starts a suspended JobSet whose Workload it
    admitted). Nothing for a finished JobSet (its controller removed its Jobs), nor
    once both are stopped; a JobSet Kueue started again is suspended again."""
    if phase != Phase.failed or jobset is None or jobset_finished(jobset):
        return Actions()
    actions = Actions(workload_active=workload_activation(True, workload))
    if not (jobset.get("spec") or {}).get("suspend"):
        actions.jobset_patch = {"spec": {"suspend": True}}
        message = "the job failed: its JobSet is suspended (no pods, no Kueue quota)"
        actions.jobset_events = [Event("Normal", "JobSetSuspended", message)]
    return actions


def stalled(
    job: dict[str, Any], observed: Observed, patch: dict[str, Any], why: str, now: str
) -> Actions:
    """A running job whose trainer stopped reporting (`deadline.check`): its JobSet
    restarted while spec.scheduling.maxRestarts allows (the JobSet's own restarts count
    too), Restarting with `why` until the JobSet controller has restarted it; else the
    job failed with `why` and its JobSet stopped."""
    spec, previous = job.get("spec") or {}, job.get("status") or {}
    restarts = int(patch.get("restarts") or 0)
    allowed = int((spec.get("scheduling") or {}).get("maxRestarts", 3))
    generation = job["metadata"].get("generation")
    if restarts < allowed:
        if observed.restart_requested:  # its Jobs are ending: the status says so already
            return Actions()
        message = f"{why}: restarting the JobSet (restart {restarts + 1} of {allowed})"
        obs = Observation(Phase.restarting, deadline.REASON, message, restarts)
        written = status_write(previous, observation_patch(obs, spec, previous, now, generation))
        # One Event, for the restart (the status's own would say the same).
        return Actions(status=written.status, restart=Event("Warning", deadline.REASON, message))
    message = f"{why}; no restarts left (spec.scheduling.maxRestarts {allowed})"
    obs = Observation(Phase.failed, deadline.REASON, message, restarts)
    failed = observation_patch(obs, spec, previous, now, generation)
    written = status_write(previous, failed)
    stop = stop_failed(Phase.failed, observed.jobset, observed.workload)
    return replace(stop, status=written.status, events=written.events)


def decide(job: dict[str, Any], observed: Observed, now: str) -> Actions:
    """Everything a reconcile of `job` does given what is observed of its children."""
    if job["metadata"].get("deletionTimestamp"):
        return Actions()
    previous = job.get("status") or {}
    if previous.get("phase") in TERMINAL:  # nothing more, but a failed job's JobSet stops
        return stop_failed(previous["phase"], observed.jobset, observed.workload)
    if observed.jobset is None:
        gone = [Event("Warning", "JobSetDeleted", "JobSet deleted out of band; creating it again")]
        return Actions(create=True, events=gone if previous.get("jobSetName") else [])
    meta, spec = job["metadata"], job.get("spec") or {}
    patch = status_patch(
        observed.jobset,
        spec,
        previous,
        now,
        meta.get("generation"),
        observed.pods,
        observed.workload,
        observed.blocked,
    )
    actions = status_write(previous, patch)
    if patch.get("phase") == Phase.failed:  # it fails now: no scheduling change matters
        stop = stop_failed(patch["phase"], observed.jobset, observed.workload)
        return replace(stop, status=actions.status, events=actions.events)
    if patch.get("phase") == Phase.running:
        verdict = deadline.check(
            spec, previous.get("progress"), int(patch.get("restarts") or 0), observed.pods, now
        )
        if verdict.stalled is not None:
            return stalled(job, observed, patch, verdict.stalled, now)
        actions.check_in = verdict.check_in
    actions.jobset_patch, actions.jobset_events = scheduling_update(spec, observed.jobset)
    # Kueue starts a suspended JobSet whose Workload it admitted: the user's suspend
    # deactivates the Workload (Kueue's own way to stop a job).
    suspend = bool((spec.get("scheduling") or {}).get("suspend"))
    actions.workload_active = workload_activation(suspend, observed.workload)
    return actions
