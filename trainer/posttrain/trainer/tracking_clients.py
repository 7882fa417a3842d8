"""The trackers experiment tracking reports to (spec.tracking), one class each: MLflow
and Weights & Biases, with what both name the same way (the run's name, its flattened
parameters, its tags). `posttrain.trainer.tracking` queues reports to them on a thread
of their own; a client call that fails raises, and `Permanent` when the tracker refused
the report (it answered), so it is dropped rather than retried."""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from posttrain.api.spec import PostTrainJob
from posttrain.trainer import storage

log = logging.getLogger("posttrain.tracking")

# The cluster's default MLflow tracking URI (the chart's tracking.mlflow.trackingUri,
# passed by the operator), used when the job sets none.
DEFAULT_URI_ENV = "POSTTRAIN_MLFLOW_TRACKING_URI"


def mlflow_uri(spec: Any) -> str | None:
    mlflow = spec.tracking.mlflow if spec.tracking else None
    if mlflow is None:
        return None
    return mlflow.tracking_uri or os.environ.get(DEFAULT_URI_ENV) or None


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


def said(e: BaseException, limit: int = 200) -> str:
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
                raise Permanent(said(e)) from e
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
