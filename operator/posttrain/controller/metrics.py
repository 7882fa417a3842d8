"""Prometheus metrics and the HTTP endpoint that serves them with /healthz."""

from __future__ import annotations

import threading
import time
from collections import Counter as Tally
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from prometheus_client import CONTENT_TYPE_LATEST, Counter, Gauge, Histogram, generate_latest

RECONCILES = Counter("posttrain_reconciles_total", "Handler invocations", ["handler"])
ERRORS = Counter("posttrain_reconcile_errors_total", "Handler invocations that raised", ["handler"])
LATENCY = Histogram("posttrain_reconcile_seconds", "Handler latency", ["handler"])
JOBS = Gauge("posttrain_jobs", "PostTrainJobs by phase", ["phase"])
LEADER = Gauge("posttrain_leader", "1 while this replica holds the leader Lease")

_phases: dict[str, str] = {}
_lock = threading.Lock()


def _publish() -> None:
    counts = Tally(_phases.values())
    for phase in ("Pending", "Queued", "Running", "Restarting", "Suspended", "Succeeded", "Failed"):
        JOBS.labels(phase).set(counts.get(phase, 0))


def observe_job(uid: str, phase: str) -> None:
    with _lock:
        _phases[uid] = phase
        _publish()


def forget_job(uid: str) -> None:
    with _lock:
        _phases.pop(uid, None)
        _publish()


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
