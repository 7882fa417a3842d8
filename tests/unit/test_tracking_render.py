"""spec.tracking on a cluster: the JobSet passes its Secrets by reference (the variables
the MLflow and W&B clients read) and the chart's cluster-wide MLflow tracking URI to jobs
that name none; the operator takes that default from the chart."""

from __future__ import annotations

import json

import pytest
from invalid_jobs import valid_job
from test_chart import container, env_of, helm, template

from posttrain.checks import validate
from posttrain.controller.main import _render_config
from posttrain.render import RenderConfig, render

CLUSTER_URI = "http://mlflow.mlops.svc:5000"


def _trainer_env(tracking: dict, config: RenderConfig | None = None) -> list[dict]:
    doc = valid_job()
    doc["spec"]["tracking"] = tracking
    job, errors = validate(doc)
    assert not errors, errors
    (jobset,) = [o for o in render(job, config or RenderConfig()) if o["kind"] == "JobSet"]
    out = []
    for replicated in jobset["spec"]["replicatedJobs"]:
        for c in replicated["template"]["spec"]["template"]["spec"]["containers"]:
            if c["name"] == "trainer":
                out = c["env"]
    assert out, "no trainer container"
    return out


def _by_name(env: list[dict]) -> dict[str, dict]:
    return {e["name"]: e for e in env}


def test_secrets_are_passed_by_reference():
    env = _by_name(
        _trainer_env(
            {
                "mlflow": {
                    "trackingUri": "https://mlflow.example.com",
                    "usernameSecret": {"name": "mlflow-basic", "key": "username"},
                    "passwordSecret": {"name": "mlflow-basic", "key": "password"},
                },
                "wandb": {"project": "p", "apiKeySecret": {"name": "wandb"}},
            },
            RenderConfig(mlflow_tracking_uri=CLUSTER_URI),
        )
    )
    ref = lambda name, key: {"secretKeyRef": {"name": name, "key": key}}  # noqa: E731
    assert env["MLFLOW_TRACKING_USERNAME"]["valueFrom"] == ref("mlflow-basic", "username")
    assert env["MLFLOW_TRACKING_PASSWORD"]["valueFrom"] == ref("mlflow-basic", "password")
    assert env["WANDB_API_KEY"]["valueFrom"] == ref("wandb", "token")
    assert "MLFLOW_TRACKING_TOKEN" not in env
    # The job's own URI wins over the cluster's (it is in the trainer config).
    assert "POSTTRAIN_MLFLOW_TRACKING_URI" not in env


def test_cluster_default_uri_for_a_job_that_names_none():
    env = _by_name(
        _trainer_env(
            {"mlflow": {"tokenSecret": {"name": "mlflow-token"}}},
            RenderConfig(mlflow_tracking_uri=CLUSTER_URI),
        )
    )
    assert env["POSTTRAIN_MLFLOW_TRACKING_URI"]["value"] == CLUSTER_URI
    assert env["MLFLOW_TRACKING_TOKEN"]["valueFrom"]["secretKeyRef"]["name"] == "mlflow-token"
    assert "POSTTRAIN_MLFLOW_TRACKING_URI" not in _by_name(
        _trainer_env({"mlflow": {}}, RenderConfig())
    )


def test_no_tracking_no_tracking_env():
    doc = valid_job()
    job, _ = validate(doc)
    text = json.dumps(render(job, RenderConfig(mlflow_tracking_uri=CLUSTER_URI)))
    assert "MLFLOW" not in text and "WANDB" not in text


def test_chart_default_reaches_the_operator(monkeypatch):
    env = env_of(container(template({"defaults.tracking.mlflow.trackingUri": CLUSTER_URI})))
    assert env["POSTTRAIN_MLFLOW_TRACKING_URI"] == CLUSTER_URI
    assert env_of(container(template()))["POSTTRAIN_MLFLOW_TRACKING_URI"] == ""
    monkeypatch.setenv("POSTTRAIN_MLFLOW_TRACKING_URI", CLUSTER_URI)
    assert _render_config().mlflow_tracking_uri == CLUSTER_URI


@pytest.mark.parametrize("uri", ["http://user:pw@mlflow:5000", "https://mlflow/?token=x", "s3://b"])
def test_chart_refuses_a_tracking_uri_with_credentials_or_another_scheme(uri):
    proc = helm(
        "template", "posttrain", "charts/posttrain",
        "--set", f"defaults.tracking.mlflow.trackingUri={uri}",
        check=False,
    )  # fmt: skip
    assert proc.returncode != 0 and "trackingUri" in proc.stderr, proc.stderr
