"""The trainer reports progress into its PostTrainJob's status on a real API server,
with the identity the operator gives its pods: the namespace's trainer ServiceAccount,
bound to the trainer ClusterRole, with a token bound to one of the job's pods (the
chart's status policy lets it patch that job's status only)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml
from operator_process import token_kubeconfig
from trainer_access import install_trainer_policy, remove_trainer_policy, trainer_pod

from posttrain.checks import validate
from posttrain.render import RenderConfig
from posttrain.render.names import TRAINER_SERVICE_ACCOUNT
from posttrain.render.objects import trainer_access
from tests.cluster import Cluster

pytestmark = pytest.mark.integration
ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests" / "trainer"))


class PhaseWatch:
    """Every status.progress.phase the job's status passes through, in order, from a
    watch of the job (resumed at its resourceVersion: no write is missed)."""

    def __init__(self, plane: Cluster, namespace: str, name: str):
        from kubernetes import client, config

        self.api = config.new_client_from_config(config_file=str(plane.kubeconfig))
        self.custom = client.CustomObjectsApi(self.api)
        self.namespace, self.name = namespace, name
        self.phases: list[str] = []
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        from kubernetes import watch

        version = None
        while not self.done.is_set():
            stream = watch.Watch().stream(
                self.custom.list_namespaced_custom_object, "posttrain.dev", "v1alpha1",
                self.namespace, "posttrainjobs", field_selector=f"metadata.name={self.name}",
                timeout_seconds=2, **({"resource_version": version} if version else {}),
            )  # fmt: skip
            for event in stream:
                body = event["object"]
                version = body["metadata"]["resourceVersion"]
                phase = ((body.get("status") or {}).get("progress") or {}).get("phase")
                if phase and (not self.phases or self.phases[-1] != phase):
                    self.phases.append(phase)

    def stop(self) -> list[str]:
        time.sleep(3)  # the last writes reach the watch
        self.done.set()
        self.thread.join(10)
        self.api.close()
        return self.phases


@pytest.fixture
def trainer_policy(apiserver: Cluster) -> Iterator[None]:
    install_trainer_policy(apiserver)
    yield
    remove_trainer_policy(apiserver)


def test_trainer_writes_progress(
    apiserver: Cluster, namespace: str, tmp_path: Path, trainer_policy
):
    from tiny_model import make_tiny_llama

    model = make_tiny_llama(tmp_path / "model")
    doc = {
        "apiVersion": "posttrain.dev/v1alpha1",
        "kind": "PostTrainJob",
        "metadata": {"name": "progress", "namespace": namespace},
        "spec": {
            "model": {"source": str(model), "dtype": "float32"},
            "lora": {"rank": 4, "alpha": 8},
            "data": {"source": str(ROOT / "examples/data/chat-sft.jsonl"), "maxLength": 64},
            "training": {"steps": 6, "batchSize": 8, "logEverySteps": 2},
            "checkpoint": {"everySteps": 3},
            "eval": {"fraction": 0.1, "samples": 0},
            "output": {"uri": str(tmp_path / "out")},
        },
    }
    created = apiserver.custom.create_namespaced_custom_object(
        "posttrain.dev", "v1alpha1", namespace, "posttrainjobs", doc
    )
    job, errors = validate(created)
    assert not errors
    for obj in trainer_access(namespace, RenderConfig().trainer_cluster_role):
        apiserver.apply(obj, namespace)
    kubeconfig = token_kubeconfig(
        apiserver,
        namespace,
        TRAINER_SERVICE_ACCOUNT,
        tmp_path / "sa.kubeconfig",
        pod=trainer_pod(apiserver, namespace, "progress"),
    )
    job_file = tmp_path / "job.yaml"
    job_file.write_text(yaml.safe_dump(doc))
    env = {
        **os.environ,
        "KUBECONFIG": str(kubeconfig),
        "POSTTRAIN_JOB_NAME": "progress",
        "POSTTRAIN_JOB_NAMESPACE": namespace,
        "JAX_PLATFORMS": "cpu",
    }
    phases = PhaseWatch(apiserver, namespace, "progress")
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "posttrain.cli", "run", str(job_file)],
            env=env,
            capture_output=True,
            text=True,
            timeout=600,
        )
    finally:
        seen = phases.stop()
    assert proc.returncode == 0, proc.stderr
    assert "failed" not in proc.stderr.lower(), proc.stderr
    status = apiserver.get("ptj", "progress", namespace)["status"]
    progress = status["progress"]
    assert progress["step"] == 6 and progress["totalSteps"] == 6
    assert progress["lastCheckpointStep"] == 6
    assert progress["loss"] > 0 and progress["tokensPerSecond"] > 0 and "updatedAt" in progress
    # The heartbeat (spec.scheduling.progressDeadlineSeconds): each phase as it began,
    # kept by the trainer status policy and the CRD's schema.
    assert progress["phase"] == "exporting"
    assert seen == [
        "loading", "compiling", "training", "checkpointing",  # step 3
        "training", "evaluating", "checkpointing", "exporting",  # step 6
    ], seen  # fmt: skip
    # The held-out evaluation at the end (spec.eval), kept by the API server as written.
    assert progress["evalStep"] == 6 and progress["evalLoss"] > 0
    assert set(progress["evalMetrics"]) == {"loss", "perplexity"}
    assert progress["evalMetrics"]["loss"] == progress["evalLoss"]
    # Goodput: the fraction and its parts over the run's one attempt (adding up to 1).
    assert 0 < progress["goodput"] < 1 and progress["lostSteps"] == 0
    parts = progress["goodputBreakdown"]
    assert parts["productive"] == progress["goodput"]
    assert sum(parts.values()) == pytest.approx(1.0, abs=1e-3) and parts["compile"] > 0
    columns = "-o=custom-columns=STEP:.status.progress.step,TOTAL:.status.progress.totalSteps"
    out = apiserver.kubectl("get", "ptj", "progress", "-n", namespace, columns).stdout.split()
    assert out == ["STEP", "TOTAL", "6", "6"]
    wide = apiserver.kubectl("get", "ptj", "progress", "-n", namespace, "-o", "wide").stdout
    header, row = wide.splitlines()[:2]
    start = header.index("EVAL")  # empty cells are blank: read the column where it is
    end = header.index("GOODPUT")
    assert float(row[start:end]) == pytest.approx(progress["evalLoss"], rel=1e-3)
    goodput = row[end : header.index("JOBSET")]
    assert float(goodput) == pytest.approx(progress["goodput"], abs=1e-3)
    token = yaml.safe_load(kubeconfig.read_text())["users"][0]["user"]["token"]
    assert token not in json.dumps(status)  # no credential leaked into status
