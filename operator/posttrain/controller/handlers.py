"""kopf handlers. Each reads, calls a pure function, writes; nothing is decided here.

- create/resume: render the job's objects and create the missing ones (idempotent: a
  retry, a restart or a second replica finds them and moves on), then set status. An
  object that exists and is not the job's own (owner UID) is never used, and one the API
  server refuses fails the job (`kube.Refused`): once, with the server's message.
- JobSet, pod and Kueue Workload events and a periodic resync: recompute status with
  `phase.status_patch` from what the indexes of `watches` hold (no reads).
- A JobSet deleted out of band while the job is unfinished is created again (the trainer
  resumes from its last checkpoint); a finished job's JobSet is left gone.
- spec.scheduling.suspend / workloadPriorityClass / ttlSecondsAfterFinished changes go to the
  JobSet (`scheduling_patch`); other spec changes are refused by the CRD's transition rules.
"""

from __future__ import annotations

import datetime
import functools
import logging
import time
from collections.abc import Callable
from typing import Any

import kopf

from posttrain.api.spec import GROUP, PLURAL, VERSION, Phase
from posttrain.api.validate import validate
from posttrain.controller import kube, metrics, watches
from posttrain.controller.phase import (
    TERMINAL,
    WARNINGS,
    Observation,
    changed,
    observation_patch,
    status_patch,
    status_reason,
    workload_activation,
)
from posttrain.render import RenderConfig, render
from posttrain.render.jobset import JOB_NAME_LABEL, scheduling_patch

RESYNC_SECONDS = 30.0
log = logging.getLogger("posttrain.operator")


class State:
    """Operator-wide settings, set once by `posttrain operator` before kopf starts."""

    render_config = RenderConfig()


def _now() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def instrumented(name: str) -> Callable:
    """Count calls, errors and latency of a handler in Prometheus metrics."""

    def wrap(fn: Callable) -> Callable:
        @functools.wraps(fn)
        def run(*args: Any, **kwargs: Any) -> Any:
            start = time.monotonic()
            metrics.RECONCILES.labels(name).inc()
            try:
                return fn(*args, **kwargs)
            except Exception:
                metrics.ERRORS.labels(name).inc()
                raise
            finally:
                metrics.LATENCY.labels(name).observe(time.monotonic() - start)

        return run

    return wrap


def _phase(obj: dict[str, Any]) -> str | None:
    return (obj.get("status") or {}).get("phase")


def _write(ptj: dict[str, Any], decide: Callable[[dict[str, Any]], dict[str, Any]]) -> None:
    """Write the status `decide(job)` returns, only over the status it was computed from:
    handlers run concurrently, and one holding an older copy must not move the phase
    back. An Event reports each new phase."""
    for _ in range(5):
        meta = ptj["metadata"]
        previous = ptj.get("status") or {}
        patch = decide(ptj)
        if not changed(previous, patch):
            return
        try:
            kube.patch_job_status(
                meta["namespace"], meta["name"], patch, meta.get("resourceVersion")
            )
            break
        except kube.Conflict:
            ptj = kube.get_job(meta["namespace"], meta["name"])
            if ptj is None:
                return
    else:
        raise kube.temporary(RuntimeError("status kept changing while being written"))
    _report(ptj, previous, patch)


def _report(ptj: dict[str, Any], previous: dict[str, Any], patch: dict[str, Any]) -> None:
    """An Event for each new phase, and for each new reason to act on (Unschedulable, then
    ImagePullBackOff, ...): named by that reason (a failure too), else by the phase."""
    reason = status_reason(patch)
    warning = patch["phase"] == "Failed" or reason in WARNINGS
    if patch["phase"] == previous.get("phase") and not (
        warning and reason != status_reason(previous)
    ):
        return
    kopf.event(
        ptj,
        type="Warning" if warning else "Normal",
        reason=(reason if warning else None) or patch["phase"],
        message=patch.get("message", ""),
    )


def _write_status(
    ptj: dict[str, Any], jobset: dict[str, Any] | None, indexes: dict[str, Any]
) -> None:
    """Status from the JobSet, its pods and its Workload as the watches last saw them
    (the JobSet given is the newer one; after a conflict, the indexed one)."""

    def decide(current: dict[str, Any]) -> dict[str, Any]:
        meta = current["metadata"]
        ns, name = meta["namespace"], meta["name"]
        js = jobset
        if current is not ptj:
            js = watches.jobset(indexes, ns, name, meta["uid"]) or jobset
        return status_patch(
            js,
            current.get("spec") or {},
            current.get("status"),
            _now(),
            meta.get("generation"),
            watches.pods(indexes, ns, name),
            watches.workload(indexes, ns, js),
        )

    meta, spec = ptj["metadata"], ptj.get("spec") or {}
    workload = watches.workload(indexes, meta["namespace"], jobset)
    suspend = bool((spec.get("scheduling") or {}).get("suspend"))
    if (active := workload_activation(suspend, workload)) is not None and workload:
        kube.set_workload_active(meta["namespace"], workload.name, active)
    _write(ptj, decide)


def _set(ptj: dict[str, Any], obs: Observation) -> None:
    """Status for a job whose objects could not all be made."""
    _write(
        ptj,
        lambda current: observation_patch(
            obs,
            current.get("spec") or {},
            current.get("status"),
            _now(),
            current["metadata"].get("generation"),
        ),
    )


def _fail(ptj: dict[str, Any], reason: str, message: str) -> None:
    """The job cannot run: Failed with `reason` and `message`, a Warning Event, no retry."""
    meta = ptj["metadata"]
    log.warning("job %s/%s failed: %s: %s", meta["namespace"], meta["name"], reason, message)
    _set(ptj, Observation(Phase.failed, reason, message))


def _children(ptj: dict[str, Any], objects: list[dict[str, Any]], full: bool) -> dict[str, Any]:
    """Create whatever of the job's objects is missing and return its JobSet. Every object
    that exists already must be the job's own (owner UID), else kube.Refused. Without
    `full`, the job's status already names its JobSet (all objects were made): only the
    JobSet is read, and the rest is made again only if it is gone."""
    namespace, name = ptj["metadata"]["namespace"], ptj["metadata"]["name"]
    *support, jobset = objects
    if not full and (existing := kube.get_jobset(namespace, name)) is not None:
        return kube.owned(namespace, existing, jobset)
    # The JobSet's pods need these first. A RoleBinding is checked against its Role (the
    # operator may only grant what it holds), so the Role must exist before it.
    kube.create_all(namespace, [o for o in support if o["kind"] != "RoleBinding"])
    kube.create_all(namespace, [o for o in support if o["kind"] == "RoleBinding"])
    stored, created = kube.create_or_get_owned(namespace, jobset)
    if created:
        log.info("created JobSet %s/%s", namespace, jobset["metadata"]["name"])
        kopf.info(
            ptj, reason="JobSetCreated", message=f"created JobSet {jobset['metadata']['name']}"
        )
    return stored


def reconcile(ptj: dict[str, Any], indexes: dict[str, Any], *, full: bool | None = None) -> None:
    """Create whatever of the job's objects is missing, then bring status up to date. A job
    whose objects cannot be made (invalid, refused by the API server, a foreign object in
    the way) fails with the reason, once."""
    meta = ptj["metadata"]
    if _phase(ptj) in TERMINAL or meta.get("deletionTimestamp"):
        return
    job, errors = validate(ptj)
    if errors or job is None:
        _fail(ptj, "InvalidSpec", "; ".join(str(e) for e in errors))
        return
    if full is None:
        full = not (ptj.get("status") or {}).get("jobSetName")
    try:
        jobset = _children(ptj, render(job, State.render_config), full)
    except kube.Refused as e:
        _fail(ptj, e.reason, str(e))
        return
    except kube.Leftover as e:
        _set(ptj, Observation(Phase.pending, "WaitingForLeftover", str(e)))
        raise
    _write_status(ptj, jobset, indexes)


@kopf.on.resume(GROUP, VERSION, PLURAL)
@kopf.on.create(GROUP, VERSION, PLURAL)
@instrumented("create")
def on_create(body: kopf.Body, **kwargs: Any) -> None:
    reconcile(dict(body), kwargs)


@kopf.timer(GROUP, VERSION, PLURAL, interval=RESYNC_SECONDS, initial_delay=RESYNC_SECONDS, idle=5)
@instrumented("resync")
def resync(body: kopf.Body, **kwargs: Any) -> None:
    reconcile(dict(body), kwargs)


def _job_of(namespace: str, name: str, indexes: dict[str, Any]) -> dict[str, Any] | None:
    """The job as last streamed; read once if the stream has not brought it yet."""
    ptj = watches.job(indexes, namespace, name) or kube.get_job(namespace, name)
    if ptj is None or ptj["metadata"].get("deletionTimestamp"):
        return None
    return ptj


@kopf.on.event(
    watches.JOBSET_GROUP, watches.JOBSET_VERSION, "jobsets", labels={JOB_NAME_LABEL: kopf.PRESENT}
)
@instrumented("jobset")
def on_jobset_event(event: dict[str, Any], body: kopf.Body, **kwargs: Any) -> None:
    meta = body["metadata"]
    ptj = _job_of(meta["namespace"], meta["labels"][JOB_NAME_LABEL], kwargs)
    if ptj is None or ptj["metadata"]["uid"] not in kube.owner_uids(dict(body)):
        return  # gone, or a JobSet of an older job with the same name (or someone else's)
    if event["type"] == "DELETED":
        if _phase(ptj) not in TERMINAL:
            kopf.warn(
                ptj, reason="JobSetDeleted", message="JobSet deleted out of band; creating it again"
            )
            reconcile(ptj, kwargs, full=True)
        return
    _write_status(ptj, dict(body), kwargs)


def _refresh(namespace: str, name: str, indexes: dict[str, Any]) -> None:
    """Recompute a job's status after an event of one of its pods or its Workload."""
    ptj = watches.job(indexes, namespace, name)
    if ptj is None or ptj["metadata"].get("deletionTimestamp") or _phase(ptj) in TERMINAL:
        return
    jobset = watches.jobset(indexes, namespace, name, ptj["metadata"]["uid"])
    if jobset is not None:  # before it, the create handler writes the status
        _write_status(ptj, jobset, indexes)


@kopf.on.event("v1", "pods", labels={JOB_NAME_LABEL: kopf.PRESENT})
@instrumented("pod")
def on_pod_event(namespace: str, labels: kopf.Labels, **kwargs: Any) -> None:
    _refresh(namespace, labels[JOB_NAME_LABEL], kwargs)


@kopf.on.event(watches.KUEUE_GROUP, watches.KUEUE_VERSION, "workloads", when=watches.jobset_owned)
@instrumented("workload")
def on_workload_event(namespace: str, body: kopf.Body, **kwargs: Any) -> None:
    for owner in body["metadata"].get("ownerReferences") or []:
        if owner.get("kind") == "JobSet":
            _refresh(namespace, owner["name"], kwargs)


@kopf.on.update(GROUP, VERSION, PLURAL, field="spec.scheduling")
@instrumented("scheduling")
def on_scheduling_change(old: Any, new: Any, body: kopf.Body, **_: Any) -> None:
    patch = scheduling_patch(old or {}, new or {})
    if not patch:
        return
    meta = body["metadata"]
    kube.patch_jobset(meta["namespace"], meta["name"], patch)
    if (old or {}).get("suspend") != (new or {}).get("suspend"):
        resumed = not (new or {}).get("suspend")
        kopf.info(
            dict(body),
            reason="Resuming" if resumed else "Suspending",
            message="spec.scheduling.suspend changed",
        )


@kopf.on.event(GROUP, VERSION, PLURAL)
def count_phases(event: dict[str, Any], body: kopf.Body, **_: Any) -> None:
    uid = body["metadata"]["uid"]
    if event["type"] == "DELETED":
        metrics.forget_job(uid)
    else:
        metrics.observe_job(uid, _phase(dict(body)) or "Pending")
        metrics.observe_job_series(dict(body))
