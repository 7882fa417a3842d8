"""`posttrain logs` against the real API server: it finds the job, its JobSet and process
0's pod of the newest restart attempt, and says in one line why there is no log yet (no
node matches these pods, so none starts)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from invalid_jobs import valid_job
from jobset_objects import jobset, trainer_pod

from tests.cluster import Cluster

pytestmark = pytest.mark.integration


def posttrain_logs(cluster: Cluster, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "posttrain.cli", "logs", *args],
        env={**os.environ, **cluster.env},
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_logs_picks_process_zero_of_the_newest_attempt(apiserver: Cluster, namespace: str):
    job = valid_job("logs-job")
    apiserver.apply(job, namespace)
    missing = posttrain_logs(apiserver, "nope", "-n", namespace)
    assert missing.returncode == 1
    assert missing.stderr.strip() == f"posttrain: no PostTrainJob {namespace}/nope"
    no_pod = posttrain_logs(apiserver, "logs-job", "-n", namespace)
    assert no_pod.returncode == 1
    assert no_pod.stderr.strip().startswith(
        f"posttrain: {namespace}/logs-job has no trainer pod (phase Pending"
    ), no_pod.stderr

    apiserver.apply(jobset("logs-job"), namespace)
    # No controller manager in this tier: the pods' ServiceAccount is made by hand.
    apiserver.apply(
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": {"name": "default"}}, namespace
    )
    for name, attempt, index in (("old-0", 0, 0), ("new-1", 1, 1), ("new-0", 1, 0)):
        # No node matches: the pod stays Pending even where a scheduler runs, and the API
        # server never asks a kubelet for its log.
        nowhere = {"posttrain.dev/test": "no-such-node"}
        apiserver.apply(
            trainer_pod(name, "logs-job", attempt, index, nodeSelector=nowhere), namespace
        )
    out = posttrain_logs(apiserver, "logs-job", "-n", namespace)
    assert out.returncode == 1, out
    # Process 0 of restart attempt 1, which no node runs yet: one line saying so.
    assert out.stderr.strip() == "posttrain: new-0 has not started yet (not scheduled yet)", out
