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

log = logging.getLogger("posttrain.tracking")

STATE_FILE = "tracking.json"
FLUSH_ENV = "POSTTRAIN_TRACKING_FLUSH_SECONDS"
# The cluster's default MLflow tracking URI (the chart's tracking.mlflow.trackingUri,
# passed by the operator), used when the job sets none.
DEFAULT_URI_ENV = "POSTTRAIN_MLFLOW_TRACKING_URI"
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


def mlflow_uri(spec: Any) -> str | None:
    mlflow = spec.tracking.mlflow if spec.tracking else None
    if mlflow is None:
        return None
    return mlflow.tracking_uri or os.environ.get(DEFAULT_URI_ENV) or None


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


def flatten(value: Any, prefix: str = "") -> dict[str, str]:
    """A spec (as on the wire) as parameters: dotted keys, lists as JSON."""
    out: dict[str, str] = {}
    if isinstance(value, dict):
        for key, item in value.items():
            out.update(flatten(item, f"{prefix}.{key}" if prefix else str(key)))
    elif isinstance(value, list):
        out[prefix] = json.dumps(value, sort_keys=True)
    else:
        out[prefix] = json.dumps(value) if not isinstance(value, str) else value
    return out


def run_name(template: str, job: PostTrainJob) -> str:
    meta = job.metadata
    return template.format(
        name=meta.name,
        namespace=meta.namespace or "default",
        uid=meta.uid or "",
        technique=str(job.spec.technique),
    )


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("posttrain")
    except PackageNotFoundError:
        return "unknown"


def tags(job: PostTrainJob) -> dict[str, str]:
    meta = job.metadata
    out = {
        "posttrain.namespace": meta.namespace or "default",
        "posttrain.name": meta.name,
        "posttrain.version": _version(),
        "posttrain.technique": str(job.spec.technique),
    }
    if meta.uid:
        out["posttrain.uid"] = meta.uid
    return out


def _said(e: BaseException, limit: int = 200) -> str:
    text = f"{type(e).__name__}: {e}".replace("\n", " ")
    return text if len(text) <= limit else text[: limit - 3] + "..."


class Permanent(Exception):
    """A report the tracker refused (it answered): dropped, not retried."""


# --- the trackers ------------------------------------------------------------------------


class MlflowBackend:
    name = "mlflow"

    def __init__(self, job: PostTrainJob):
        # The client's own retries would hold the thread for minutes; this thread retries.
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
        os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "10")
        from mlflow.tracking import MlflowClient

        settings = job.spec.tracking.mlflow
        self.uri = mlflow_uri(job.spec)
        self.client = MlflowClient(tracking_uri=self.uri)
        self.experiment = settings.experiment or job.metadata.namespace or "default"
        self.run_name = run_name(settings.run_name, job)
        self.run_id: str | None = None
        self.experiment_id: str | None = None

    def _call(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        from mlflow.exceptions import RestException

        try:
            return fn(*args, **kwargs)
        except RestException as e:  # the server answered: retrying changes nothing
            if getattr(e, "error_code", "") in (
                "RESOURCE_DOES_NOT_EXIST",
                "INVALID_PARAMETER_VALUE",
            ):
                raise Permanent(_said(e)) from e
            raise

    def open(self, state: dict[str, Any], job_tags: dict[str, str]) -> int:
        """Create (or continue) the run; returns the last step it holds (-1: none)."""
        run = None
        if state.get("runId"):
            try:
                run = self._call(self.client.get_run, state["runId"])
            except Permanent as e:  # deleted on the server: a new run
                log.warning(
                    "tracking: mlflow run %s is gone (%s); starting a new one", state["runId"], e
                )
        if run is not None:
            self.run_id, self.experiment_id = run.info.run_id, run.info.experiment_id
            self._call(self.client.update_run, self.run_id, status="RUNNING")
            last = -1
            for key in run.data.metrics:
                history = self._call(self.client.get_metric_history, self.run_id, key)
                last = max([last, *(m.step for m in history)])
            return last
        experiment = self.client.get_experiment_by_name(self.experiment)
        if experiment is None:
            self.experiment_id = self._call(self.client.create_experiment, self.experiment)
        else:
            self.experiment_id = experiment.experiment_id
        run = self._call(
            self.client.create_run, self.experiment_id, run_name=self.run_name, tags=job_tags
        )
        self.run_id = run.info.run_id
        return -1

    def state(self) -> dict[str, Any]:
        return {"runId": self.run_id, "experimentId": self.experiment_id}

    def link(self) -> str | None:
        if self.run_id is None or not self.uri.startswith(("http://", "https://")):
            return None
        return f"{self.uri.rstrip('/')}/#/experiments/{self.experiment_id}/runs/{self.run_id}"

    def params(self, params: dict[str, str]) -> None:
        from mlflow.entities import Param

        items = [Param(k[:250], v[:6000]) for k, v in params.items()]
        for i in range(0, len(items), 100):  # the server's limit per batch
            self._call(self.client.log_batch, self.run_id, params=items[i : i + 100])

    def metrics(self, rows: list[tuple[int, dict[str, float], int]]) -> None:
        from mlflow.entities import Metric

        items = [
            Metric(key, float(value), ts, step)
            for step, values, ts in rows
            for key, value in values.items()
        ]
        for i in range(0, len(items), 1000):
            self._call(self.client.log_batch, self.run_id, metrics=items[i : i + 1000])

    def tags(self, values: dict[str, str]) -> None:
        from mlflow.entities import RunTag

        items = [RunTag(k, v) for k, v in values.items()]
        self._call(self.client.log_batch, self.run_id, tags=items)

    def artifact(self, local: Path, path: str | None) -> None:
        if local.is_dir():
            self._call(self.client.log_artifacts, self.run_id, str(local), path)
        else:
            self._call(self.client.log_artifact, self.run_id, str(local), path)

    def finish(self, phase: str) -> None:
        status = {"Succeeded": "FINISHED", "Failed": "FAILED"}.get(phase, "KILLED")
        self._call(self.client.set_terminated, self.run_id, status)


class WandbBackend:
    name = "wandb"

    def __init__(self, job: PostTrainJob, scratch: Path):
        import wandb

        self.wandb = wandb
        self.settings = job.spec.tracking.wandb
        self.job = job
        self.run: Any = None
        self.output_uri = job.spec.output.uri
        # Offline, the run's files go under output.uri/wandb/ (`wandb sync` them later);
        # with a gs:// output they are written here and uploaded at the end.
        remote = storage.is_gcs(self.output_uri)
        self.dir = (scratch / "wandb-run") if remote else Path(self.output_uri)
        self.upload = remote and self.settings.mode == "offline"

    def open(self, state: dict[str, Any], job_tags: dict[str, str]) -> int:
        s = self.settings
        if s.base_url:
            os.environ["WANDB_BASE_URL"] = s.base_url
        self.dir.mkdir(parents=True, exist_ok=True)
        self.run = self.wandb.init(
            project=s.project,
            entity=s.entity,
            name=run_name(s.run_name, self.job),
            id=state.get("runId"),
            resume="allow",
            dir=str(self.dir),
            mode=s.mode,
            config=flatten(self.job.spec.to_wire()),
            tags=[f"{k.removeprefix('posttrain.')}:{v}"[:64] for k, v in job_tags.items()],
            reinit="create_new",
            # init_timeout: an unreachable W&B fails this try within it (then retried),
            # and holds the process's exit no longer (W&B's default is 90 s).
            settings=self.wandb.Settings(
                console="off",
                silent=True,
                x_disable_stats=True,
                x_disable_machine_info=True,
                init_timeout=15,
            ),
        )
        return int(state.get("reportedStep", -1))

    def state(self) -> dict[str, Any]:
        return {"runId": self.run.id if self.run is not None else None}

    def link(self) -> str | None:
        return getattr(self.run, "url", None) if self.settings.mode == "online" else None

    def params(self, params: dict[str, str]) -> None:
        pass  # passed to init as the run's config

    def metrics(self, rows: list[tuple[int, dict[str, float], int]]) -> None:
        for step, values, _ in rows:
            self.run.log(dict(values), step=step)

    def tags(self, values: dict[str, str]) -> None:
        for key, value in values.items():
            self.run.summary[key] = value

    def artifact(self, local: Path, path: str | None) -> None:
        artifact = self.wandb.Artifact(
            f"{self.run.id}-{(path or local.name).replace('/', '-')}", "posttrain"
        )
        if local.is_dir():
            artifact.add_dir(str(local), name=path)
        else:
            artifact.add_file(str(local), name=f"{path}/{local.name}" if path else local.name)
        self.run.log_artifact(artifact)

    def finish(self, phase: str) -> None:
        self.run.finish(exit_code=0 if phase == "Succeeded" else 1)
        if self.upload:
            storage.upload_dir(self.dir / "wandb", storage.join(self.output_uri, "wandb"))


# --- the queue and its thread ------------------------------------------------------------


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
            self.error = _said(e)
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
            log.warning("tracking: cannot stage artifacts: %s", _said(e))
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
