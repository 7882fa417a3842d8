"""The pods' word: why a pod does not run (the scheduler's PodScheduled condition, the
kubelet's container states) and which pods are a job's (their owner chain)."""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any

from posttrain.controller.phase.model import Cause, PodState

REPLICATED_JOB_LABEL = "jobset.sigs.k8s.io/replicatedjob-name"
JOB_INDEX_LABEL = "jobset.sigs.k8s.io/job-index"
RESTART_ATTEMPT_LABEL = "jobset.sigs.k8s.io/restart-attempt"
# Container waiting reasons that are only steps of a normal start.
STARTING = {"ContainerCreating", "PodInitializing"}
# The kubelet's ImagePullBackOff message: `Back-off pulling image "IMAGE": ERROR: MESSAGE`
# of the last pull (ERROR ErrImagePull, RegistryUnavailable, ...).
BACK_OFF = re.compile(r'^Back-off pulling image "[^"]*"(: [A-Za-z]+: )?')


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
        started_at=status.get("startTime"),
    )
