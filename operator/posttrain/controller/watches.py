"""What the operator watches, kept in kopf indexes (in memory): the cache every reconcile
reads instead of the API server.

- jobs by (namespace, name): the job without what the operator never reads (managed
  fields, annotations such as kubectl's last-applied copy), as compact JSON (`packed`);
- JobSets by (namespace, job name): `jobset_summary`, the few fields the phase, the
  ownership check and the scheduling fields need (not the pod templates);
- a summary of each pod (`phase.pod_state`) by (namespace, job name): only pods with the
  job-name label are streamed (a server-side label selector, see `selectors`);
- each Job of a JobSet (batch/v1, the job-name label too) by (namespace, job name): its
  UID and its controller's, so that only pods whose owner chain leads to the job's
  JobSet count (`phase.owned_pods`), not any pod that carries the label;
- a summary of each Kueue Workload (`phase.workload_state`) by (namespace, JobSet name):
  only Workloads of jobs (Kueue's job-uid label) are streamed, only those of JobSets kept;
- the JobSet controller's JobCreationFailed Events (`phase.refusal_event`) by (namespace,
  JobSet name), and the Job controller's FailedCreate Events of Jobs by (namespace, Job
  UID): only those Events are streamed (server-side field selectors, one on core/v1 and
  one on events.k8s.io/v1, the same Events seen through two APIs); the API server
  refusing a Job or a pod (invalid, forbidden by a policy, over a quota) says so nowhere
  else (`phase.job_refusal`, `phase.pod_refusal`);
- the names of the WorkloadPriorityClasses and PriorityClasses that exist (few, cluster
  scoped): while the class a queued JobSet names is missing, Kueue makes no Workload and
  says so only in its log (`phase.without_workload`);
- why each inactive ClusterQueue is inactive, as Kueue says on it: a Workload only says
  `ClusterQueue X is inactive` (`phase.with_cluster_queue`).

A queued job's position comes from Kueue's visibility API (`QueuePositions`): one read
per LocalQueue with waiting jobs every 10 s (1 s when one of them is not listed yet),
not one per job.

An index is a kopf mapping from a key to the values of every object that gave that key.
The index functions are coroutines: kopf calls them on its event loop, with no hop to a
worker thread per object (a replica starting with 1100 jobs and JobSets to list saw them
all in 20 s instead of about 30 s, one run each).
kopf runs no handler before every index holds its first listing, so a reconcile never
takes a JobSet that is not listed yet for a missing one.
"""

from __future__ import annotations

import dataclasses
import json
import threading
import time
from collections.abc import Callable
from typing import Any

import kopf

from posttrain.api.spec import GROUP, PLURAL, VERSION
from posttrain.controller import kube, phase, preflight
from posttrain.render.jobset import JOB_NAME_LABEL, JOBSET_API_VERSION, KUEUE_QUEUE_LABEL
from posttrain.render.preflight import PREFLIGHT_LABEL

JOBSET_GROUP, JOBSET_VERSION = JOBSET_API_VERSION.split("/")
KUEUE_GROUP, KUEUE_VERSION = "kueue.x-k8s.io", "v1beta2"
KUEUE_JOB_UID_LABEL = "kueue.x-k8s.io/job-uid"  # on every Workload Kueue makes for a job
# On each JobSet: the job's spec.scheduling fields it was made or last patched from.
SCHEDULING_ANNOTATION = "posttrain.dev/scheduling"
Key = tuple[str, str]
# The only Events streamed: the JobSet controller's, when a Job is refused.
REFUSAL_EVENTS = f"involvedObject.kind=JobSet,reason={phase.JOB_CREATION_FAILED}"
# ... and the Job controller's, when a pod is refused (events.k8s.io/v1's field names).
POD_REFUSAL_EVENTS = "regarding.kind=Job,reason=FailedCreate"


def selectors(settings: kopf.OperatorSettings) -> None:
    """Server-side label selectors: the API server streams only the pods, JobSets and
    Workloads that can belong to a job, not every one in the cluster."""
    settings.watching.label_selectors[("v1", "pods")] = JOB_NAME_LABEL
    settings.watching.label_selectors[("batch", "v1", "jobs")] = JOB_NAME_LABEL
    settings.watching.label_selectors[(JOBSET_GROUP, JOBSET_VERSION, "jobsets")] = JOB_NAME_LABEL
    settings.watching.label_selectors[(KUEUE_GROUP, KUEUE_VERSION, "workloads")] = (
        KUEUE_JOB_UID_LABEL
    )
    settings.watching.field_selectors[("v1", "events")] = REFUSAL_EVENTS
    settings.watching.field_selectors[("events.k8s.io", "v1", "events")] = POD_REFUSAL_EVENTS


def jobset_owned(body: kopf.Body, **_: Any) -> bool:
    return any(
        r.get("kind") == "JobSet" and r.get("apiVersion") == JOBSET_API_VERSION
        for r in body["metadata"].get("ownerReferences") or []
    )


def _meta(meta: dict[str, Any], *keys: str) -> dict[str, Any]:
    return {k: meta[k] for k in keys if meta.get(k) is not None}


def job_summary(body: dict[str, Any]) -> dict[str, Any]:
    """What reconciling a job reads of it."""
    meta = body.get("metadata") or {}
    return {
        "apiVersion": body.get("apiVersion"),
        "kind": body.get("kind"),
        "metadata": _meta(
            meta,
            "name",
            "namespace",
            "uid",
            "generation",
            "resourceVersion",
            "deletionTimestamp",
            "labels",
        ),  # fmt: skip
        "spec": body.get("spec") or {},
        "status": body.get("status") or {},
    }


def jobset_summary(body: dict[str, Any]) -> dict[str, Any]:
    """What the phase (`phase.phase_from`), the ownership check and the scheduling fields
    read of a JobSet: a JobSet in the same shape, without its pod templates (but their
    PriorityClass)."""
    meta, spec = body.get("metadata") or {}, body.get("spec") or {}
    annotations = meta.get("annotations") or {}
    replicated = []
    for r in spec.get("replicatedJobs") or []:
        job_spec = (r.get("template") or {}).get("spec") or {}
        pod_spec = (job_spec.get("template") or {}).get("spec") or {}
        template: dict[str, Any] = {"parallelism": job_spec.get("parallelism")}
        if pod_spec.get("priorityClassName"):  # Kueue's priority without a label
            template["template"] = {"spec": {"priorityClassName": pod_spec["priorityClassName"]}}
        replicated.append(
            {
                "name": r.get("name"),
                "replicas": r.get("replicas", 1),
                "template": {"spec": template},
            }
        )
    summary_meta = _meta(meta, "name", "namespace", "uid", "resourceVersion", "labels")
    summary_meta["ownerReferences"] = [
        _meta(r, "apiVersion", "kind", "name", "uid") for r in meta.get("ownerReferences") or []
    ]
    if SCHEDULING_ANNOTATION in annotations:
        summary_meta["annotations"] = {SCHEDULING_ANNOTATION: annotations[SCHEDULING_ANNOTATION]}
    return {
        "metadata": summary_meta,
        "spec": {
            **_meta(spec, "suspend", "ttlSecondsAfterFinished"),
            "replicatedJobs": replicated,
        },
        "status": body.get("status") or {},
    }


def packed(summary: dict[str, Any]) -> bytes:
    """A job summary as compact JSON: the job index holds each job this way, a quarter
    or less of the memory of the decoded dicts (and the event they came from is freed
    whole)."""
    return json.dumps(summary, separators=(",", ":")).encode()


def shed(body: kopf.Body, *keep: str) -> None:
    """Drop from kopf's own copy of an event what nothing reads once it is indexed: the
    managed fields, the annotations, and every top-level field but `keep` (the event
    handlers read only the metadata, and a job's status).

    kopf holds each event until its handlers have run, and runs none before every kind
    is listed: a replica starting with 1100 jobs and their JobSets present held every
    body at once, and its RSS peaked at 178 MiB against 141 for a leader that saw them
    arrive."""
    raw = getattr(body, "_src", None)  # the event's dict, which kopf's Body views
    if not isinstance(raw, dict):
        return
    meta = raw.get("metadata")
    if isinstance(meta, dict):
        meta.pop("managedFields", None)
        meta.pop("annotations", None)
    for key in [k for k in raw if k not in ("apiVersion", "kind", "metadata", *keep)]:
        del raw[key]


@kopf.index(GROUP, VERSION, PLURAL)
async def job_index(namespace: str, name: str, body: kopf.Body, **_: Any) -> dict[Key, bytes]:
    job = packed(job_summary(dict(body)))
    shed(body, "spec", "status")
    return {(namespace, name): job}


@kopf.index(JOBSET_GROUP, JOBSET_VERSION, "jobsets", labels={JOB_NAME_LABEL: kopf.PRESENT})
async def jobset_index(
    namespace: str, labels: kopf.Labels, body: kopf.Body, **_: Any
) -> dict[Key, Any]:
    summary = jobset_summary(dict(body))
    shed(body)
    return {(namespace, labels[JOB_NAME_LABEL]): summary}


@kopf.index("v1", "pods", labels={JOB_NAME_LABEL: kopf.PRESENT, PREFLIGHT_LABEL: kopf.ABSENT})
async def pod_index(
    namespace: str, labels: kopf.Labels, body: kopf.Body, **_: Any
) -> dict[Key, Any]:
    if body["metadata"].get("deletionTimestamp"):
        shed(body)
        return {}
    state = phase.pod_state(dict(body))
    shed(body)
    return {(namespace, labels[JOB_NAME_LABEL]): state}


@kopf.index("v1", "pods", labels={JOB_NAME_LABEL: kopf.PRESENT, PREFLIGHT_LABEL: kopf.PRESENT})
async def preflight_index(
    namespace: str, labels: kopf.Labels, body: kopf.Body, **_: Any
) -> dict[Key, Any]:
    """The preflight's pods (`preflight.pod_state`: its answer is in their termination
    message), by (namespace, job name); kept apart from the trainer's pods."""
    if body["metadata"].get("deletionTimestamp"):
        shed(body)
        return {}
    state = preflight.pod_state(dict(body), PREFLIGHT_LABEL)
    shed(body)
    # Also by program key: another job of the same program takes its answer.
    return {(namespace, labels[JOB_NAME_LABEL]): state, by_key(namespace, state.key): state}


@kopf.index(
    "batch", "v1", "jobs", labels={JOB_NAME_LABEL: kopf.PRESENT, PREFLIGHT_LABEL: kopf.PRESENT}
)
async def preflight_job_index(
    namespace: str, labels: kopf.Labels, body: kopf.Body, **_: Any
) -> dict[Key, Any]:
    """The preflight Jobs by program key (`preflight.job_state`): a job whose program is
    being compiled for another job waits for that answer instead of compiling it again."""
    state = preflight.job_state(dict(body), JOB_NAME_LABEL)
    return {by_key(namespace, labels[PREFLIGHT_LABEL]): state}


def by_key(namespace: str, key_label: str) -> Key:
    """The index key of a program key's preflight pods and Jobs (no job name has ':')."""
    return (namespace, f"key:{key_label}")


@kopf.index("batch", "v1", "jobs", labels={JOB_NAME_LABEL: kopf.PRESENT})
async def batch_job_index(
    namespace: str, labels: kopf.Labels, body: kopf.Body, **_: Any
) -> dict[Key, Any]:
    owned = (body["metadata"].get("uid"), phase.controller_uid(dict(body), "JobSet"))
    shed(body)
    return {(namespace, labels[JOB_NAME_LABEL]): owned}


@kopf.index(KUEUE_GROUP, KUEUE_VERSION, "workloads", when=jobset_owned)
async def workload_index(namespace: str, body: kopf.Body, **_: Any) -> dict[Key, Any]:
    owner = next(r for r in body["metadata"]["ownerReferences"] if r.get("kind") == "JobSet")
    state = phase.workload_state(dict(body))
    shed(body)
    return {(namespace, owner["name"]): (owner.get("uid"), state)}


@kopf.index("v1", "events")
async def refusal_index(namespace: str, body: kopf.Body, **_: Any) -> dict[Key, Any]:
    refusal = phase.refusal_event(dict(body))
    name = (body.get("involvedObject") or {}).get("name")
    shed(body, "involvedObject")
    return {(namespace, name): refusal} if refusal and name else {}


@kopf.index("events.k8s.io", "v1", "events")
async def pod_refusal_index(namespace: str, body: kopf.Body, **_: Any) -> dict[Key, Any]:
    refusal = phase.refusal_event(dict(body))
    shed(body, "regarding")
    return {(namespace, refusal[0]): refusal} if refusal and refusal[0] else {}


@kopf.index(KUEUE_GROUP, KUEUE_VERSION, "workloadpriorityclasses")
async def workload_priority_class_index(name: str, **_: Any) -> dict[str, str]:
    return {"names": name}


@kopf.index("scheduling.k8s.io", "v1", "priorityclasses")
async def priority_class_index(name: str, **_: Any) -> dict[str, str]:
    return {"names": name}


@kopf.index(KUEUE_GROUP, KUEUE_VERSION, "clusterqueues")
async def inactive_cluster_queue_index(name: str, body: kopf.Body, **_: Any) -> dict[str, str]:
    why = phase.cluster_queue_inactive(dict(body))
    return {name: why} if why else {}


def _values(index: kopf.Index | None, key: Key) -> list[Any]:
    """The values under key. Reconciles read in threads while the event loop updates the
    indexes: a copy that raced with an update is taken again."""
    if index is None:
        return []
    for _ in range(10):
        try:
            return list(index.get(key, ()))
        except RuntimeError:  # changed size during iteration
            continue
    return list(index.get(key, ()))


def job(indexes: dict[str, Any], namespace: str, name: str) -> dict[str, Any] | None:
    """The job's summary as last streamed (a fresh copy: the caller may change it)."""
    found = _values(indexes.get("job_index"), (namespace, name))
    return json.loads(found[0]) if found else None


def jobset(indexes: dict[str, Any], namespace: str, name: str, uid: str) -> dict[str, Any] | None:
    """The job's JobSet as last streamed: the one the job (UID) owns."""
    for js in _values(indexes.get("jobset_index"), (namespace, name)):
        if uid in {r.get("uid") for r in js["metadata"].get("ownerReferences") or []}:
            return js
    return None


def pods(
    indexes: dict[str, Any], namespace: str, name: str, jobset_body: dict[str, Any] | None
) -> list[phase.PodState]:
    """The pods of the job's JobSet: those whose owner chain leads to it."""
    if jobset_body is None:
        return []
    return phase.owned_pods(
        _values(indexes.get("pod_index"), (namespace, name)),
        _values(indexes.get("batch_job_index"), (namespace, name)),
        jobset_body["metadata"].get("uid") or "",
    )


def preflight_pods(
    indexes: dict[str, Any], namespace: str, name: str
) -> list[preflight.PreflightPod]:
    """The job's preflight pods (any program key: `preflight.next_step` picks)."""
    return _values(indexes.get("preflight_index"), (namespace, name))


def preflight_of_key(
    indexes: dict[str, Any], namespace: str, key_label: str
) -> tuple[list[preflight.PreflightPod], list[preflight.PreflightJob]]:
    """Every job's preflight pods and Jobs of one program key in the namespace."""
    key = by_key(namespace, key_label)
    return (
        _values(indexes.get("preflight_index"), key),
        _values(indexes.get("preflight_job_index"), key),
    )


def workload(
    indexes: dict[str, Any], namespace: str, jobset_body: dict[str, Any] | None
) -> phase.WorkloadState | None:
    if jobset_body is None:
        return None
    meta = jobset_body["metadata"]
    for uid, state in _values(indexes.get("workload_index"), (namespace, meta["name"])):
        if uid == meta.get("uid"):
            state = phase.with_cluster_queue(state, _inactive(indexes))
            queue = (meta.get("labels") or {}).get(KUEUE_QUEUE_LABEL)
            if queue and phase.waits_in_queue(state):
                position = POSITIONS.get(namespace, queue, state.name)
                state = dataclasses.replace(state, position=position)
            return state
    return phase.without_workload(
        jobset_body,
        _names(indexes, "workload_priority_class_index"),
        _names(indexes, "priority_class_index"),
    )


def blocked(
    indexes: dict[str, Any],
    namespace: str,
    jobset_body: dict[str, Any] | None,
    pods_made: int = 0,
) -> phase.Cause | None:
    """Why the JobSet's Jobs are not made, or make no pod, as far as the indexes know.
    (A JobSet has its job's name: the Jobs' index and the Events' share the key.)"""
    if jobset_body is None:
        return None
    key = (namespace, jobset_body["metadata"]["name"])
    uid = jobset_body["metadata"].get("uid")
    jobs = [job for job, owner in _values(indexes.get("batch_job_index"), key) if owner == uid]
    pod_refusals = [
        refusal
        for job in jobs
        for refusal in _values(indexes.get("pod_refusal_index"), (namespace, job))
    ]
    return (
        phase.job_refusal(jobset_body, _values(indexes.get("refusal_index"), key), len(jobs))
        or phase.missing_priority_class(jobset_body, _names(indexes, "priority_class_index"))
        or phase.pod_refusal(jobset_body, pod_refusals, jobs, pods_made)
    )


class QueuePositions:
    """Positions of pending Workloads from Kueue's visibility API, one read per
    LocalQueue at most every `ttl` seconds however many of its jobs are decided; a
    Workload the last read did not list (new since) is asked for again after `retry`
    seconds at the soonest (a queue without the API, or gone, too)."""

    def __init__(
        self,
        fetch: Callable[[str, str], dict[str, Any] | None],
        ttl: float = 10.0,
        retry: float = 1.0,
    ):
        self.fetch, self.ttl, self.retry = fetch, ttl, retry
        self.lock = threading.Lock()
        self.seen: dict[Key, tuple[float, dict[str, tuple[int, int]]]] = {}

    def get(self, namespace: str, queue: str, workload: str | None) -> tuple[int, int] | None:
        with self.lock:  # handlers run in threads: one read per queue, the others wait
            at, positions = self.seen.get((namespace, queue), (-self.ttl, {}))
            age = time.monotonic() - at
            if age >= self.ttl or (age >= self.retry and (workload or "") not in positions):
                summary = self.fetch(namespace, queue)
                positions = phase.queue_positions(summary) if summary else {}
                self.seen[(namespace, queue)] = (time.monotonic(), positions)
        return positions.get(workload or "")


POSITIONS = QueuePositions(lambda ns, queue: kube.pending_workloads(ns, queue))


def _inactive(indexes: dict[str, Any]) -> Callable[[str], str | None]:
    def why(name: str) -> str | None:
        found = _values(indexes.get("inactive_cluster_queue_index"), name)
        return found[0] if found else None

    return why


def _names(indexes: dict[str, Any], index: str) -> set[str] | None:
    return set(_values(indexes[index], "names")) if index in indexes else None
