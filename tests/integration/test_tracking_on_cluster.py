"""spec.tracking on the real API server with the operator running: the JobSet it makes
hands the trainer pods the tracker's settings (in the job's config) and its Secrets by
reference only, and the installation's default MLflow URI (the chart's
defaults.tracking.mlflow.trackingUri, the operator's POSTTRAIN_MLFLOW_TRACKING_URI) to a
job that names none, while a job's own URI wins. No Secret value reaches the JobSet, the
job's status or the operator's log."""

from __future__ import annotations

import json

import pytest
from invalid_jobs import valid_job
from operator_process import OperatorProcess

from posttrain.render.trainer_config import CONFIG_ANNOTATION
from tests.cluster import Cluster, wait_for

pytestmark = pytest.mark.integration
GROUP, VERSION, PLURAL = "posttrain.dev", "v1alpha1", "posttrainjobs"
DEFAULT_URI = "http://mlflow.tracking.svc.cluster.local:5000"
TOKEN = "mlflow-SECRET-token-value"


def _trainer_pod(apiserver: Cluster, namespace: str, name: str) -> dict:
    def made():
        return apiserver.custom.list_namespaced_custom_object(
            "jobset.x-k8s.io", "v1alpha2", namespace, "jobsets"
        )["items"]

    wait_for(lambda: any(j["metadata"]["name"] == name for j in made()), timeout=30)
    (js,) = [j for j in made() if j["metadata"]["name"] == name]
    return js["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]


def _env(pod: dict) -> dict[str, dict]:
    (container,) = [c for c in pod["spec"]["containers"] if c["name"] == "trainer"]
    return {e["name"]: e for e in container.get("env", [])}


def test_tracking_reaches_the_trainer_pods_by_reference(
    apiserver: Cluster, namespace: str, tmp_path
):
    apiserver.core.create_namespaced_secret(
        namespace, {"metadata": {"name": "mlflow"}, "stringData": {"token": TOKEN}}
    )
    op = OperatorProcess(apiserver.kubeconfig, tmp_path, namespace, "-n", namespace)
    op.env["POSTTRAIN_MLFLOW_TRACKING_URI"] = DEFAULT_URI
    op.start()
    try:
        default = valid_job("tracked")
        default["spec"]["tracking"] = {
            "mlflow": {"experiment": "team-a", "tokenSecret": {"name": "mlflow", "key": "token"}}
        }
        own = valid_job("own-uri")
        own["spec"]["tracking"] = {"mlflow": {"trackingUri": "https://mlflow.example.com"}}
        for doc in (default, own):
            apiserver.custom.create_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, doc)

        pod = _trainer_pod(apiserver, namespace, "tracked")
        env = _env(pod)
        assert env["POSTTRAIN_MLFLOW_TRACKING_URI"]["value"] == DEFAULT_URI
        assert env["MLFLOW_TRACKING_TOKEN"]["valueFrom"] == {
            "secretKeyRef": {"name": "mlflow", "key": "token"}
        }
        config = json.loads(pod["metadata"]["annotations"][CONFIG_ANNOTATION])
        assert config["spec"]["tracking"]["mlflow"]["experiment"] == "team-a"

        own_env = _env(_trainer_pod(apiserver, namespace, "own-uri"))
        assert "POSTTRAIN_MLFLOW_TRACKING_URI" not in own_env  # the job's own URI wins
        assert "MLFLOW_TRACKING_TOKEN" not in own_env

        jobsets = apiserver.kubectl("get", "jobsets", "-n", namespace, "-o", "yaml").stdout
        jobs = apiserver.kubectl("get", "posttrainjobs", "-n", namespace, "-o", "yaml").stdout
        assert TOKEN not in jobsets and TOKEN not in jobs
    finally:
        op.stop()
    assert TOKEN not in op.logs()
