"""spec.tracking against real trackers: an MLflow tracking server (`mlflow server`, SQLite
store, artifact directory, on 127.0.0.1) read back through MlflowClient, and Weights &
Biases offline, read back from the run files it writes."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
from tb_events import scalars
from tiny_job import run_job, tiny_job
from tracking_servers import mlflow_server, wandb_records

from posttrain.trainer import tracking

pytestmark = pytest.mark.trainer
ROOT = Path(__file__).resolve().parents[2]
DATA = ROOT / "examples" / "data" / "chat-sft.jsonl"
UID = "0f9c3c1e-5d3b-4c1f-9a53-1b8d5c2f7e10"
TOKEN = "s3cr3t-token-value"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with mlflow_server(tmp_path_factory.mktemp("mlflow")) as s:
        yield s


def job(model_dir: Path, out: Path, tracking_spec: dict, *, steps: int = 4, every: int = 2):
    doc = tiny_job(
        model_dir,
        DATA,
        out,
        steps=steps,
        every=every,
        training={"logEverySteps": 1},
        tracking=tracking_spec,
    )
    doc["metadata"].update(namespace="team-a", uid=UID)
    doc["spec"]["checkpoint"]["async"] = False  # a crash never races a save
    return doc


class Statuses:
    """Where the trainer's status.progress patches go (instead of a PostTrainJob)."""

    def __init__(self, monkeypatch):
        from posttrain.trainer import loop

        self.patches: list[dict] = []
        monkeypatch.setattr(loop.StatusWriter, "from_env", classmethod(lambda cls: self))

    def patch(self, progress: dict) -> None:
        self.patches.append(json.loads(json.dumps(progress)))


def crash_after(monkeypatch, steps: set[int]) -> None:
    from posttrain.trainer import loop

    step = loop.Progress.step

    def failing_step(self, at, metrics, log_now):
        step(self, at, metrics, log_now)
        if at in steps:
            steps.remove(at)
            raise RuntimeError(f"injected failure after step {at}")

    monkeypatch.setattr(loop.Progress, "step", failing_step)


def test_mlflow_run_has_the_job_and_a_restart_continues_it(
    model_dir, server, tmp_path, monkeypatch, caplog
):
    from mlflow.tracking import MlflowClient

    monkeypatch.setenv("MLFLOW_TRACKING_TOKEN", TOKEN)  # as a pod gets it from its Secret
    out = tmp_path / "out"
    doc = job(
        model_dir,
        out,
        {
            "mlflow": {
                "trackingUri": server.url,
                "experiment": "tiny-sft",
                "runName": "{namespace}-{name}",
                "tokenSecret": {"name": "mlflow-token"},
            }
        },
    )
    held_out = tmp_path / "held-out.jsonl"
    held_out.write_text("".join(DATA.read_text().splitlines(keepends=True)[:8]))
    doc["spec"]["eval"] = {"source": str(held_out), "everySteps": 2, "samples": 0}
    crash_after(monkeypatch, {3})
    statuses = Statuses(monkeypatch)
    caplog.set_level(logging.INFO)
    with pytest.raises(RuntimeError, match="after step 3"):
        run_job(doc)  # checkpoint at 2: step 3 is redone
    result = run_job(doc)
    assert result.resumed_from == 2 and result.step == 4

    client = MlflowClient(server.url)
    experiment = client.get_experiment_by_name("tiny-sft")
    runs = client.search_runs([experiment.experiment_id])
    assert len(runs) == 1  # the restart continued the run
    # As the user guide finds it.
    found = client.search_runs([experiment.experiment_id], "tags.`posttrain.name` = 'tiny'")
    assert [r.info.run_id for r in found] == [runs[0].info.run_id]
    run = runs[0]
    assert run.info.run_name == "team-a-tiny" and run.info.status == "FINISHED"
    state = json.loads((out / tracking.STATE_FILE).read_text())
    assert state["mlflow"]["runId"] == run.info.run_id and state["mlflow"]["reportedStep"] == 4

    tags = run.data.tags
    assert tags["posttrain.namespace"] == "team-a" and tags["posttrain.name"] == "tiny"
    assert tags["posttrain.uid"] == UID and tags["posttrain.version"]
    assert tags["posttrain.phase"] == "Succeeded"
    params = run.data.params
    assert params["training.steps"] == "4" and params["model.source"] == str(model_dir)
    assert params["lora.rank"] == "4" and params["technique"] == "sft"
    assert params["tracking.mlflow.tokenSecret.name"] == "mlflow-token"
    # status.progress links to the run.
    (link,) = {json.dumps(p["tracking"]) for p in statuses.patches[-1:]}
    assert json.loads(link) == {
        "mlflow": {
            "runId": run.info.run_id,
            "url": f"{server.url}/#/experiments/{experiment.experiment_id}/runs/{run.info.run_id}",
        }
    }
    everything = json.dumps([params, tags, statuses.patches]) + caplog.text
    assert TOKEN not in everything

    # Every TensorBoard scalar at its steps, each step once.
    tb = scalars(out / "tensorboard")
    losses = client.get_metric_history(run.info.run_id, "train/loss")
    assert [m.step for m in losses] == [1, 2, 3, 4]
    # (TensorBoard may lack the crashed attempt's last events, never flushed.)
    tracked = {m.step: m.value for m in losses}
    assert tb["train/loss"] and tb["train/loss"].keys() <= tracked.keys()
    for at, value in tb["train/loss"].items():
        assert tracked[at] == pytest.approx(value, rel=1e-6), at
    for key in ("train/learning_rate", "train/tokens_per_second", "eval/loss", "goodput/goodput"):
        assert key in run.data.metrics, key
        steps = [m.step for m in client.get_metric_history(run.info.run_id, key)]
        assert len(steps) == len(set(steps)), (key, steps)
        assert set(tb[key]) <= set(steps), key
    assert [m.step for m in client.get_metric_history(run.info.run_id, "eval/loss")] == [0, 2, 4]
    assert run.data.metrics["goodput"] == pytest.approx(result.goodput["goodput"])

    # Artifacts: eval.json and the adapter's config and model card, not its weights.
    names = {a.path for a in client.list_artifacts(run.info.run_id)}
    assert names == {"eval.json", "hf"}
    hf = {a.path for a in client.list_artifacts(run.info.run_id, "hf")}
    assert hf == {"hf/adapter_config.json", "hf/README.md"}
    local = client.download_artifacts(run.info.run_id, "eval.json", str(tmp_path))
    assert Path(local).read_text() == (out / "eval.json").read_text()


def test_a_stopped_server_loses_no_training_and_gets_the_reports_later(
    model_dir, server, tmp_path, monkeypatch, caplog
):
    """The server stops after step 1 and is back after step 3: training goes on, the
    failure is said once, and every step reaches the run."""
    from mlflow.tracking import MlflowClient

    from posttrain.trainer import loop

    monkeypatch.setattr(tracking, "RETRY_MAX_S", 1.0)
    try:
        step = loop.Progress.step

        def step_with_outage(self, at, metrics, log_now):
            step(self, at, metrics, log_now)
            if at == 1:
                server.stop()
            elif at == 3:
                server.start()

        monkeypatch.setattr(loop.Progress, "step", step_with_outage)
        statuses = Statuses(monkeypatch)
        caplog.set_level(logging.INFO)
        out = tmp_path / "out"
        spec = {"mlflow": {"trackingUri": server.url, "experiment": "outage"}, "logWeights": True}
        result = run_job(job(model_dir, out, spec))
        assert result.step == 4 and not result.stopped_early
        assert (out / "hf" / "adapter_config.json").exists()
        assert (out / "summary.json").exists()
        said = [r for r in caplog.records if "tracking: mlflow is unreachable" in r.message]
        assert len(said) == 1, caplog.text
        # ... and in the status, with the count of failed reports.
        failed = [p["tracking"]["mlflow"] for p in statuses.patches if "tracking" in p]
        assert any(t.get("failures", 0) > 0 and "error" in t for t in failed), failed

        client = MlflowClient(server.url)
        (run,) = client.search_runs([client.get_experiment_by_name("outage").experiment_id])
        losses = client.get_metric_history(run.info.run_id, "train/loss")
        assert sorted(m.step for m in losses) == [1, 2, 3, 4]
        assert run.info.status == "FINISHED"
        # logWeights: the whole export, weights too.
        hf = {a.path for a in client.list_artifacts(run.info.run_id, "hf")}
        assert {"hf/adapter_model.safetensors", "hf/adapter_config.json", "hf/README.md"} <= hf
    finally:
        if server.proc is None:  # the module's server, for the tests after this one
            server.start()


def test_a_tracker_down_all_along_keeps_a_bounded_buffer(model_dir, tmp_path, monkeypatch):
    """Nothing listens at the tracking URI: reporting returns at once, the buffer keeps
    at most MAX_QUEUED reports (the oldest metrics go, counted), and the end waits no
    longer than POSTTRAIN_TRACKING_FLUSH_SECONDS."""
    import socket
    import time

    from tiny_job import validated

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setattr(tracking, "MAX_QUEUED", 8)
    monkeypatch.setenv(tracking.FLUSH_ENV, "1")
    out = tmp_path / "out"
    spec = {"mlflow": {"trackingUri": f"http://127.0.0.1:{port}"}}
    tracker = tracking.start(validated(job(model_dir, out, spec)), True, tmp_path)
    started = time.monotonic()
    for step in range(1, 101):
        tracker.scalars(step, {"train/loss": 1.0 / step, "train/learning_rate": 0.01})
    assert time.monotonic() - started < 1.0  # the caller never waits for the tracker
    tracking.finish(tracker, "Succeeded", 100)
    assert time.monotonic() - started < 10
    (status,) = tracker.status().values()
    assert status["failures"] > 0 and status["dropped"] >= 100 - 8, status
    assert "Connection refused" in status["error"] or "Max retries" in status["error"], status
    assert "runId" not in status and "url" not in status
    assert not (out / tracking.STATE_FILE).exists()  # no run was made


def test_a_tracker_without_its_client_library_is_refused_naming_the_extra(
    model_dir, tmp_path, monkeypatch
):
    from posttrain.trainer.main import is_user_error

    monkeypatch.setattr(tracking, "_importable", lambda module: module != "wandb")
    doc = job(model_dir, tmp_path / "out", {"wandb": {"project": "p", "mode": "offline"}})
    with pytest.raises(ValueError) as refused:
        run_job(doc)
    assert str(refused.value) == (
        "spec.tracking.wandb needs the Weights & Biases client in the trainer image: "
        "pip install 'posttrain[wandb]'"
    )
    assert is_user_error(refused.value)  # exit code 65, one line
    assert not (tmp_path / "out" / "checkpoints").exists()


def test_wandb_offline_run_files_hold_the_job(model_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_API_KEY", TOKEN)
    out = tmp_path / "out"
    doc = job(
        model_dir,
        out,
        {"wandb": {"project": "tiny", "mode": "offline", "apiKeySecret": {"name": "wandb"}}},
        steps=4,
        every=2,
    )
    crash_after(monkeypatch, {3})
    with pytest.raises(RuntimeError, match="after step 3"):
        run_job(doc)  # checkpoint at 2: step 3 is redone, and not reported again
    result = run_job(doc)
    assert result.step == 4 and result.resumed_from == 2
    first, path = sorted((out / "wandb").glob("offline-run-*/run-*.wandb"))
    assert first.name == path.name  # the same run id: `wandb sync` appends to one run
    steps = [
        json.loads(i.value_json)
        for r in wandb_records(first) + wandb_records(path)
        if r.WhichOneof("record_type") == "history"
        for i in r.history.item
        if i.key == "_step" or list(i.nested_key) == ["_step"]
    ]
    assert sorted(steps) == [1, 2, 3, 4]
    records = wandb_records(path)
    kinds = [r.WhichOneof("record_type") for r in records]
    (run,) = [r.run for r in records if r.WhichOneof("record_type") == "run"]
    config = {u.key: json.loads(u.value_json) for u in run.config.update}
    assert config["training.steps"] == "4" and config["model.source"] == str(model_dir)
    assert config["tracking.wandb.apiKeySecret.name"] == "wandb"
    assert "namespace:team-a" in run.tags and f"uid:{UID}" in run.tags
    assert run.display_name == "tiny" and run.project == "tiny"
    history: dict[str, dict[int, float]] = {}
    for r in records:
        if r.WhichOneof("record_type") == "history":
            items = {
                "/".join(i.nested_key) or i.key: json.loads(i.value_json) for i in r.history.item
            }
            for key, value in items.items():
                if not key.startswith("_"):
                    history.setdefault(key, {})[items["_step"]] = value
    tb = scalars(out / "tensorboard")
    assert sorted(history["train/loss"]) == [4]  # this attempt's; 1 to 3 in the first
    assert history["train/loss"][4] == pytest.approx(tb["train/loss"][4], rel=1e-6)
    assert "goodput/goodput" in history
    summary = {}
    for r in records:
        if r.WhichOneof("record_type") == "summary":
            summary.update(
                {"/".join(u.nested_key) or u.key: u.value_json for u in r.summary.update}
            )
    assert json.loads(summary["posttrain.phase"]) == "Succeeded"
    assert float(summary["goodput"]) == pytest.approx(result.goodput["goodput"])
    assert "artifact" in kinds and "exit" in kinds
    assert TOKEN.encode() not in path.read_bytes()
