"""Experiment tracking (spec.tracking): MLflow and Weights & Biases, from process 0 only.

What a run reports: the job's spec as flattened parameters (Secrets appear by reference
only: their names and keys, never a value), every scalar the trainer writes to
TensorBoard at the same step (`Tee`, which `progress.Progress` writes through), and at
the end the job's phase, its goodput, the exported adapter's config and model card and
eval.json as artifacts (the exported weights with spec.tracking.logWeights). The run is
tagged with the job's namespace, name, uid and the posttrain version.

A restarted job continues its run: the run ids are kept in output.uri/tracking.json,
beside the checkpoints, with the last step each tracker took; a resumed run reports no
step at or below it (nor below the last step the MLflow server holds), so the steps a
restart redoes are not reported twice.

A tracker that is down never stops training. Each tracker has its own thread and queue:
the training loop only appends to the queue; the thread sends, and retries what failed
(with backoff) until the run ends, when it has FLUSH_ENV seconds (default 30) to send
the rest. The queue holds at most MAX_QUEUED reports; past that the oldest metrics are
dropped (and counted). Failures are counted and said once in the log and in
status.progress.tracking.
"""

from __future__ import annotations

import collections
import importlib.util
import json
import logging
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from posttrain.api.spec import PostTrainJob
from posttrain.trainer import storage
from posttrain.trainer.tracking_clients import (
    DEFAULT_URI_ENV,
    MlflowBackend,
    Permanent,
    WandbBackend,
    flatten,
    mlflow_uri,
    said,
    tags,
)

log = logging.getLogger("posttrain.tracking")

STATE_FILE = "tracking.json"
FLUSH_ENV = "POSTTRAIN_TRACKING_FLUSH_SECONDS"
MAX_QUEUED = 20000
RETRY_MAX_S = 30.0  # the longest wait between two tries of a tracker that is down
# The exported files reported as artifacts without logWeights: adapter or model config,
# the model card.
EXPORT_ARTIFACTS = ("adapter_config.json", "config.json", "README.md")

EXTRAS = {
    "mlflow": ("mlflow", "the MLflow client"),
    "wandb": ("wandb", "the Weights & Biases client"),
}


def _importable(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def missing_extras(spec: Any, importable: Callable[[str], bool] | None = None) -> list[str]:
    """One line per tracker the job asks for whose client library is not installed."""
    importable = importable or _importable
    tracking = spec.tracking
    out = []
    for name, (module, what) in EXTRAS.items():
        if tracking is not None and getattr(tracking, name) is not None and not importable(module):
            out.append(
                f"spec.tracking.{name} needs {what} in the trainer image: "
                f"pip install 'posttrain[{name}]'"
            )
    return out


def check(spec: Any) -> None:
    """Before anything loads: the trackers the job asks for can be used here (ValueError,
    naming the field, when not: the job's own error)."""
    if missing := missing_extras(spec):
        raise ValueError(missing[0])
    if spec.tracking is not None and spec.tracking.mlflow is not None and not mlflow_uri(spec):
        raise ValueError(
            "spec.tracking.mlflow.trackingUri: no tracking server (the job sets none, and "
            f"the cluster no default, {DEFAULT_URI_ENV})"
        )


class _Worker(threading.Thread):
    """Sends one tracker's reports in order; retries what failed, never raises."""

    def __init__(self, backend: Any, state: dict[str, Any], job_tags: dict[str, str], save):
        super().__init__(name=f"posttrain-tracking-{backend.name}", daemon=True)
        self.backend, self.state, self.job_tags, self._save = backend, state, job_tags, save
        self.queue: collections.deque = collections.deque()
        self.cond = threading.Condition()
        self.opened = False
        self.skip_through = int(state.get("reportedStep", -1))
        self.reported = self.skip_through
        self.failures = self.dropped = 0
        self.error: str | None = None
        self.closing = False
        self.deadline: float | None = None
        self.done = threading.Event()

    def put(self, kind: str, payload: Any) -> None:
        with self.cond:
            if len(self.queue) >= MAX_QUEUED:
                for i, (k, _) in enumerate(self.queue):
                    if k == "metrics":
                        del self.queue[i]
                        break
                self.dropped += 1
            self.queue.append((kind, payload))
            self.cond.notify()

    def _fail(self, e: BaseException, permanent: bool) -> None:
        self.failures += 1
        if self.error is None:
            self.error = said(e)
            log.warning(
                "tracking: %s %s (%s); training goes on, %s",
                self.backend.name,
                "refused a report" if permanent else "is unreachable",
                self.error,
                "the report is dropped" if permanent else "reports are kept and retried",
            )

    def _send(self, kind: str, payload: Any) -> None:
        b = self.backend
        if kind == "metrics":
            rows = [r for r in payload if r[0] > self.skip_through]
            if rows:
                b.metrics(rows)
                self.reported = max(self.reported, max(r[0] for r in rows))
        elif kind == "params":
            b.params(payload)
        elif kind == "tags":
            b.tags(payload)
        elif kind == "artifact":
            b.artifact(*payload)
        elif kind == "finish":
            b.finish(payload)

    def _next(self) -> tuple[str, Any, int]:
        """The next report (under the lock); consecutive metrics go together (up to 200)."""
        kind, payload = self.queue[0]
        if kind != "metrics":
            return kind, payload, 1
        rows, n = [], 0
        for k, p in self.queue:
            if k != "metrics" or n == 200:
                break
            rows.append(p)
            n += 1
        return "metrics", rows, n

    def run(self) -> None:
        backoff = 0.5
        while True:
            with self.cond:
                while not self.queue and not self.closing:
                    self.cond.wait()
                if not self.queue and self.closing:
                    break
                if self.deadline is not None and time.monotonic() > self.deadline:
                    break
            try:
                if not self.opened:
                    last = self.backend.open(self.state, self.job_tags)
                    self.skip_through = last  # the tracker's own (a new run: -1)
                    self.opened = True
                    self._save(
                        self.backend.name, {**self.backend.state(), "reportedStep": self.reported}
                    )
                with self.cond:
                    kind, payload, n = self._next()
                try:
                    self._send(kind, payload)
                except Permanent as e:
                    self._fail(e, permanent=True)
                with self.cond:
                    for _ in range(n):
                        self.queue.popleft()
                backoff = 0.5
            except Exception as e:  # noqa: BLE001 - a tracker never stops training
                self._fail(e, permanent=False)
                with self.cond:
                    wait = backoff
                    if self.deadline is not None:
                        wait = min(wait, max(0.0, self.deadline - time.monotonic()))
                    self.cond.wait(wait)
                backoff = min(backoff * 2, RETRY_MAX_S)
        self.done.set()

    def close(self, seconds: float) -> None:
        with self.cond:
            self.closing = True
            self.deadline = time.monotonic() + seconds
            self.cond.notify()
        self.done.wait(seconds + 1)
        unsent = len(self.queue)
        if unsent:
            log.warning(
                "tracking: %s: %d reports not sent in %.0f s (%s)",
                self.backend.name,
                unsent,
                seconds,
                self.error or "still sending",
            )
        if self.opened:
            self._save(self.backend.name, {**self.backend.state(), "reportedStep": self.reported})

    def status(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        if self.opened and (run_id := self.backend.state().get("runId")):
            out["runId"] = run_id
        if self.opened and (link := self.backend.link()):
            out["url"] = link
        if self.failures:
            out["failures"] = self.failures
            out["error"] = self.error
        if self.dropped:
            out["dropped"] = self.dropped
        return out


class Tracker:
    """The job's trackers (process 0 only); every method returns at once."""

    def __init__(self, job: PostTrainJob, backends: list[Any]):
        self.job = job
        self.state_uri = storage.join(job.spec.output.uri, STATE_FILE)
        self._lock = threading.Lock()
        self._state = self._read_state()
        self._last: dict[str, int] = {}  # the last step each key was reported at
        job_tags = tags(job)
        self.workers = [
            _Worker(b, dict(self._state.get(b.name, {})), job_tags, self._save) for b in backends
        ]
        params = flatten(job.spec.to_wire())
        for w in self.workers:
            w.put("params", params)
            w.start()
        self.closed = False

    def _read_state(self) -> dict[str, Any]:
        try:
            if storage.exists(self.state_uri):
                return json.loads(storage.read_text(self.state_uri))
        except Exception as e:  # noqa: BLE001 - a new run then
            log.warning("tracking: cannot read %s (%s); starting new runs", self.state_uri, e)
        return {}

    def _save(self, name: str, state: dict[str, Any]) -> None:
        with self._lock:
            self._state[name] = state
            try:
                storage.write_text(self.state_uri, json.dumps(self._state, indent=2) + "\n")
            except Exception as e:  # noqa: BLE001
                log.warning("tracking: cannot write %s: %s", self.state_uri, e)

    def scalars(self, step: int, values: dict[str, float]) -> None:
        """Report `values` at `step`; a key already reported at this step or a later one
        (goodput/* again at the end) is not reported twice."""
        values = {k: v for k, v in values.items() if step > self._last.get(k, -1)}
        if not values:
            return
        self._last.update(dict.fromkeys(values, step))
        ts = int(time.time() * 1000)
        for w in self.workers:
            w.put("metrics", (int(step), dict(values), ts))

    def tee(self, writer: Any) -> Tee:
        """`writer` (TensorBoard's), reporting each scalar here too."""
        return Tee(writer, self)

    def status(self) -> dict[str, Any]:
        """status.progress.tracking: each tracker's run id, link, failures."""
        return {w.backend.name: s for w in self.workers if (s := w.status())}

    def finish(
        self,
        phase: str,
        step: int,
        goodput: dict[str, Any] | None = None,
        export_dir: str | None = None,
        scratch: Path | None = None,
    ) -> None:
        """The run's end: phase and goodput, the artifacts, then send what is left."""
        if self.closed:
            return
        self.closed = True
        summary: dict[str, float] = {}
        if goodput and isinstance(goodput.get("goodput"), int | float):
            summary["goodput"] = float(goodput["goodput"])
        if summary:
            self.scalars(step, summary)
        staged = Path(tempfile.mkdtemp(prefix="posttrain-tracking-", dir=scratch))
        for w in self.workers:
            w.put("tags", {"posttrain.phase": phase})
        for local, path in self._artifacts(export_dir, staged):
            for w in self.workers:
                w.put("artifact", (local, path))
        for w in self.workers:
            w.put("finish", phase)
        seconds = float(os.environ.get(FLUSH_ENV, "30"))
        end = time.monotonic() + seconds
        for w in self.workers:
            w.close(max(0.0, end - time.monotonic()))
        shutil.rmtree(staged, ignore_errors=True)
        for w in self.workers:
            if w.failures:
                log.warning(
                    "tracking: %s: %d failed reports in this run (first: %s)",
                    w.backend.name,
                    w.failures,
                    w.error,
                )

    def _artifacts(self, export_dir: str | None, staged: Path) -> list[tuple[Path, str | None]]:
        out: list[tuple[Path, str | None]] = []
        try:
            eval_uri = storage.join(self.job.spec.output.uri, "eval.json")
            if storage.exists(eval_uri):
                (staged / "eval.json").write_bytes(storage.read_bytes(eval_uri))
                out.append((staged / "eval.json", None))
            if export_dir:
                hf = staged / "hf"
                if self.job.spec.tracking.log_weights:
                    if storage.is_gcs(export_dir):  # a local export is uploaded in place
                        out.append((storage.download_dir(export_dir, hf), "hf"))
                    else:
                        out.append((Path(export_dir), "hf"))
                else:
                    hf.mkdir()
                    for name in EXPORT_ARTIFACTS:
                        uri = storage.join(export_dir, name)
                        if storage.exists(uri):
                            (hf / name).write_bytes(storage.read_bytes(uri))
                            out.append((hf / name, "hf"))
        except Exception as e:  # noqa: BLE001 - artifacts are best effort
            log.warning("tracking: cannot stage artifacts: %s", said(e))
        return out


class Tee:
    """A TensorBoard writer that also reports each scalar to the tracker, at its step."""

    def __init__(self, writer: Any, tracker: Tracker):
        self.writer, self.tracker = writer, tracker

    def add_scalar(self, tag: str, value: float, step: int) -> None:
        self.writer.add_scalar(tag, value, step)
        self.tracker.scalars(step, {tag: float(value)})

    def __getattr__(self, name: str) -> Any:
        return getattr(self.writer, name)


_open: list[Tracker] = []


def start(job: PostTrainJob, is_main: bool, scratch: Path) -> Tracker | None:
    """The job's tracker on process 0 (None without spec.tracking, or elsewhere)."""
    close_open("Failed")  # a run of this process that ended without finishing
    if not is_main or job.spec.tracking is None:
        return None
    backends: list[Any] = []
    if job.spec.tracking.mlflow is not None:
        backends.append(MlflowBackend(job))
    if job.spec.tracking.wandb is not None:
        backends.append(WandbBackend(job, scratch))
    tracker = Tracker(job, backends)
    _open.append(tracker)
    return tracker


def finish(tracker: Tracker | None, phase: str, step: int, **kwargs: Any) -> None:
    if tracker is not None:
        tracker.finish(phase, step, **kwargs)
        if tracker in _open:
            _open.remove(tracker)


def close_open(phase: str) -> None:
    """Ends every tracker still open in this process (a run that raised) with `phase`."""
    while _open:
        finish(_open[0], phase, 0)
