"""kopf handlers. Each reads, calls a pure function, writes; nothing is decided here.

- create/resume: render the job's objects and create the missing ones (idempotent: a
  retry, a restart or a second replica finds them and moves on), then set status.
- JobSet events and a periodic resync: recompute status with `phase.status_patch`.
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

from posttrain.api.spec import GROUP, PLURAL, VERSION
from posttrain.api.validate import validate
from posttrain.controller import kube, metrics
from posttrain.controller.phase import TERMINAL, changed, status_patch
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


def _write_status(ptj: dict[str, Any], jobset: dict[str, Any] | None) -> None:
    """Status from the JobSet, written only over the status it was computed from: handlers
    run concurrently, and one holding an older copy must not move the phase back."""
    for _ in range(5):
        meta = ptj["metadata"]
        previous = ptj.get("status") or {}
        patch = status_patch(
            jobset, ptj.get("spec") or {}, previous, _now(), meta.get("generation")
        )
        if not changed(previous, patch):
            return
        try:
            kube.patch_job_status(
                meta["namespace"], meta["name"], patch, meta.get("resourceVersion")
            )
            break
        except kube.Conflict:
            ptj = kube.get_job(meta["namespace"], meta["name"])
            jobset = kube.get_jobset(meta["namespace"], meta["name"])
            if ptj is None:
                return
    else:
        raise kube.temporary(RuntimeError("status kept changing while being written"))
    if patch.get("phase") != previous.get("phase"):
        kind = "Warning" if patch["phase"] == "Failed" else "Normal"
        kopf.event(ptj, type=kind, reason=patch["phase"], message=patch.get("message", ""))


def reconcile(ptj: dict[str, Any], logger: Any) -> None:
    """Create whatever of the job's objects is missing, then bring status up to date."""
    meta = ptj["metadata"]
    if _phase(ptj) in TERMINAL or meta.get("deletionTimestamp"):
        return
    job, errors = validate(ptj)
    if errors or job is None:
        message = "; ".join(str(e) for e in errors)
        kube.patch_job_status(
            meta["namespace"],
            meta["name"],
            {"phase": "Failed", "message": message, "observedGeneration": meta.get("generation")},
        )
        kopf.warn(ptj, reason="InvalidSpec", message=message)
        return
    *support, jobset = render(job, State.render_config)
    # The JobSet's pods need these first. A RoleBinding is checked against its Role (the
    # operator may only grant what it holds), so the Role must exist before it.
    kube.create_all(meta["namespace"], [o for o in support if o["kind"] != "RoleBinding"])
    kube.create_all(meta["namespace"], [o for o in support if o["kind"] == "RoleBinding"])
    created = kube.create_if_absent(meta["namespace"], jobset)
    if created is not None:
        log.info("created JobSet %s/%s", meta["namespace"], jobset["metadata"]["name"])
        kopf.info(
            ptj, reason="JobSetCreated", message=f"created JobSet {jobset['metadata']['name']}"
        )
    _write_status(ptj, created or kube.get_jobset(meta["namespace"], meta["name"]))


@kopf.on.resume(GROUP, VERSION, PLURAL)
@kopf.on.create(GROUP, VERSION, PLURAL)
@instrumented("create")
def on_create(body: kopf.Body, logger: Any, **_: Any) -> None:
    reconcile(dict(body), logger)


@kopf.timer(GROUP, VERSION, PLURAL, interval=RESYNC_SECONDS, initial_delay=RESYNC_SECONDS, idle=5)
@instrumented("resync")
def resync(body: kopf.Body, logger: Any, **_: Any) -> None:
    reconcile(dict(body), logger)


@kopf.on.event("jobset.x-k8s.io", "v1alpha2", "jobsets", labels={JOB_NAME_LABEL: kopf.PRESENT})
@instrumented("jobset")
def on_jobset_event(event: dict[str, Any], body: kopf.Body, logger: Any, **_: Any) -> None:
    meta = body["metadata"]
    ptj = kube.get_job(meta["namespace"], meta["labels"][JOB_NAME_LABEL])
    if ptj is None or ptj["metadata"].get("deletionTimestamp"):
        return
    owners = {r.get("uid") for r in meta.get("ownerReferences", [])}
    if ptj["metadata"]["uid"] not in owners:
        return  # a JobSet of an older job with the same name
    if event["type"] == "DELETED":
        if _phase(ptj) not in TERMINAL:
            kopf.warn(
                ptj, reason="JobSetDeleted", message="JobSet deleted out of band; creating it again"
            )
            reconcile(ptj, logger)
        return
    _write_status(ptj, dict(body))


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
