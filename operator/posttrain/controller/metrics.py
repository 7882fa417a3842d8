"""Prometheus metrics and the HTTP endpoint that serves them with /healthz.

Operator-wide series carry no job labels. The per-job gauges (`posttrain_job_*`) carry
`job_namespace` and `job_name` (not `namespace`/`job`, which Prometheus's own target
labels take) and exist only while a job is active: a job that succeeds, fails or is
deleted drops them, so their number is the number of active jobs, not of jobs ever run.
"""

from __future__ import annotations

import datetime
import threading
import time
from collections import Counter as Tally
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from prometheus_client import CONTENT_TYPE_LATEST, Counter, Gauge, Histogram, generate_latest

from posttrain.controller.phase.model import CONDITION_TYPES

RECONCILES = Counter("posttrain_reconciles_total", "Handler invocations", ["handler"])
ERRORS = Counter("posttrain_reconcile_errors_total", "Handler invocations that raised", ["handler"])
LATENCY = Histogram("posttrain_reconcile_seconds", "Handler latency", ["handler"])
JOBS = Gauge("posttrain_jobs", "PostTrainJobs by phase", ["phase"])
for _phase in ("Pending", "Queued", "Running", "Restarting", "Suspended", "Succeeded", "Failed"):
    JOBS.labels(_phase).set(0)
LEADER = Gauge("posttrain_leader", "1 while this replica holds the leader Lease")
PROGRESS_DEADLINE = Counter(
    "posttrain_progress_deadline_exceeded_total",
    "Jobs whose trainer reported no progress within spec.scheduling.progressDeadlineSeconds, "
    "by what the operator did: restart (their JobSet) or fail",
    ["action"],
)
for _action in ("restart", "fail"):
    PROGRESS_DEADLINE.labels(_action)
JOB_LABELS = ["job_namespace", "job_name"]
PREFLIGHT = Counter(
    "posttrain_preflight_total",
    "TPU jobs' preflight answers (spec.preflight), by result (Fits, DoesNotFit, Unknown) "
    "and whether a cached answer of the same program gave it",
    ["result", "cached"],
)
PHASE_ENTERED = Gauge(
    "posttrain_job_phase_entered_timestamp_seconds",
    "When an active PostTrainJob entered its current phase (Unix time)",
    [*JOB_LABELS, "phase"],
)
RESTARTS = Gauge(
    "posttrain_job_restarts", "Whole-job restarts of an active PostTrainJob", JOB_LABELS
)
PROGRESS = Gauge(
    "posttrain_job_progress_ratio",
    "Completed over total steps of an active PostTrainJob, as its trainer reports",
    JOB_LABELS,
)
TOKENS = Gauge(
    "posttrain_job_tokens_per_second",
    "Training throughput of an active PostTrainJob, as its trainer reports",
    JOB_LABELS,
)
ACTIVE_PHASES = ("Pending", "Queued", "Running", "Restarting", "Suspended")


@dataclass(frozen=True)
class JobSeries:
    """The per-job gauge values of one active PostTrainJob."""

    namespace: str
    name: str
    phase: str
    phase_entered: float
    restarts: int
    progress: float | None
    tokens_per_second: float | None


_phases: dict[str, str] = {}
_counts: Tally[str] = Tally()
_series: dict[str, JobSeries] = {}
_lock = threading.Lock()


def _timestamp(text: Any) -> float | None:
    try:
        return datetime.datetime.fromisoformat(str(text).replace("Z", "+00:00")).timestamp()
    except ValueError:
        return None


def _newest_transition(body: dict[str, Any]) -> float | None:
    # The phase's conditions only: the Preflight condition flips while the job stays Pending.
    times = [
        t
        for c in (body.get("status") or {}).get("conditions") or []
        if c.get("type") in CONDITION_TYPES
        and (t := _timestamp(c.get("lastTransitionTime"))) is not None
    ]
    return max(times) if times else _timestamp(body.get("metadata", {}).get("creationTimestamp"))


def phase_entered(body: dict[str, Any], previous: JobSeries | None, now: float) -> float | None:
    """When the job entered its phase (Unix time), given what the operator last saw of it
    (`previous`, None since it started) and the time now.

    The newest lastTransitionTime of its conditions (or its creation before it has any):
    entering a phase flips a condition, and the status survives an operator restart or
    a new leader. Restarting flips none (the Running condition stays True across a
    restart), so a phase change that moved no condition is dated now, and so is a job
    first seen Restarting (the restart's own time is in no status field: an alert waits
    a whole threshold rather than firing early)."""
    phase = (body.get("status") or {}).get("phase") or "Pending"
    flipped = _newest_transition(body)
    if previous is None:
        return now if phase == "Restarting" else flipped
    if flipped is not None and flipped > previous.phase_entered:
        return flipped  # a transition since (even one whose events were missed)
    return previous.phase_entered if previous.phase == phase else now


def job_series(
    body: dict[str, Any], previous: JobSeries | None = None, now: float | None = None
) -> JobSeries | None:
    """The per-job gauges of a PostTrainJob, or None once it is no longer active."""
    status = body.get("status") or {}
    phase = status.get("phase") or "Pending"
    entered = phase_entered(body, previous, time.time() if now is None else now)
    if phase not in ACTIVE_PHASES or entered is None:
        return None
    progress = status.get("progress") or {}
    step, total = progress.get("step"), progress.get("totalSteps")
    tokens = progress.get("tokensPerSecond")
    return JobSeries(
        namespace=body["metadata"]["namespace"],
        name=body["metadata"]["name"],
        phase=phase,
        phase_entered=entered,
        restarts=int(status.get("restarts") or 0),
        progress=min(step / total, 1.0) if step is not None and total else None,
        tokens_per_second=float(tokens) if isinstance(tokens, int | float) else None,
    )


def _count(phase: str | None, change: int) -> None:
    """Move the posttrain_jobs gauge of `phase` by `change` (kept as counts: an event
    costs the same however many jobs there are)."""
    if phase is not None:
        _counts[phase] += change
        JOBS.labels(phase).set(_counts[phase])


def _drop_series(old: JobSeries) -> None:
    job = (old.namespace, old.name)
    PHASE_ENTERED.remove(*job, old.phase)
    RESTARTS.remove(*job)
    for gauge, value in ((PROGRESS, old.progress), (TOKENS, old.tokens_per_second)):
        if value is not None:
            gauge.remove(*job)


def _set_series(uid: str, new: JobSeries | None) -> None:
    old = _series.pop(uid, None)
    if old is not None and old != new:
        _drop_series(old)
    if new is None:
        return
    _series[uid] = new
    job = (new.namespace, new.name)
    PHASE_ENTERED.labels(*job, new.phase).set(new.phase_entered)
    RESTARTS.labels(*job).set(new.restarts)
    for gauge, value in ((PROGRESS, new.progress), (TOKENS, new.tokens_per_second)):
        if value is not None:
            gauge.labels(*job).set(value)


def observe_job(uid: str, phase: str) -> None:
    with _lock:
        old, _phases[uid] = _phases.get(uid), phase
        if old != phase:
            _count(old, -1)
            _count(phase, +1)


def observe_job_series(body: dict[str, Any]) -> None:
    """Set the per-job gauges from a PostTrainJob (drops them once it has finished)."""
    uid = body["metadata"]["uid"]
    with _lock:
        _set_series(uid, job_series(body, _series.get(uid)))


def forget_job(uid: str) -> None:
    with _lock:
        _count(_phases.pop(uid, None), -1)
        _set_series(uid, None)


class Heartbeat:
    """Liveness: the main loops beat; /healthz fails when they stop beating."""

    last = time.monotonic()
    limit = 60.0

    @classmethod
    def beat(cls) -> None:
        cls.last = time.monotonic()

    @classmethod
    def alive(cls) -> bool:
        return time.monotonic() - cls.last < cls.limit


class _Handler(BaseHTTPRequestHandler):
    def do_GET(self) -> None:  # noqa: N802 (http.server API)
        if self.path.startswith("/healthz"):
            ok = Heartbeat.alive()
            body, code, ctype = (
                (b"ok\n" if ok else b"stalled\n"),
                (200 if ok else 503),
                "text/plain",
            )
        elif self.path.startswith("/metrics"):
            body, code, ctype = generate_latest(), 200, CONTENT_TYPE_LATEST
        else:
            body, code, ctype = b"not found\n", 404, "text/plain"
        self.send_response(code)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


def serve(port: int, host: str = "0.0.0.0") -> ThreadingHTTPServer:
    """Serve /metrics and /healthz in a background thread."""
    server = ThreadingHTTPServer((host, port), _Handler)
    threading.Thread(target=server.serve_forever, name="metrics", daemon=True).start()
    return server
