"""`posttrain logs` reading a trainer log the way it does on GKE: through the API server's
pod-log endpoint, from the node's kubelet. Here the kubelet of every kwok node is kwok's
own server, which serves a pod's log from a `Logs` object (`control_plane.pod_log`).

The JobSet is created suspended (the JobSet controller makes no pods of its own), and the
test's pods, carrying the labels the JobSet controller gives its pods, are placed on a kwok
node and run until deleted."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from invalid_jobs import valid_job
from jobset_objects import jobset, trainer_pod

from tests.cluster import Cluster, control_plane, wait_for

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(180)]


def logs_command(cluster: Cluster, *args: str, **kwargs) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "posttrain.cli", "logs", *args],
        env={**os.environ, **cluster.env},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        **kwargs,
    )


def cri_line(text: str) -> str:
    return f"{time.strftime('%Y-%m-%dT%H:%M:%S.000000000Z', time.gmtime())} stdout F {text}\n"


def test_logs_stream_from_the_kubelet(cluster: Cluster, namespace: str, tmp_path: Path):
    cluster.apply(valid_job("logs-job"), namespace)
    cluster.apply(jobset("logs-job", suspend=True), namespace)
    for name, attempt in (("old-0", 0), ("new-0", 1)):
        cluster.apply(
            trainer_pod(
                name,
                "logs-job",
                attempt,
                nodeSelector={"type": "kwok"},
                tolerations=[{"operator": "Exists"}],
            ),
            namespace,
        )
    wait_for(
        lambda: cluster.core.read_namespaced_pod("new-0", namespace).status.phase == "Running",
        timeout=60,
        describe=lambda: cluster.describe(namespace),
    )
    control_plane.pod_log(namespace, "old-0", ["attempt 0"], tmp_path / "old-0.log")
    log_file = tmp_path / "new-0.log"
    control_plane.pod_log(namespace, "new-0", ["step 1 loss 2.31", "step 2 loss 2.05"], log_file)

    # The newest attempt's process-0 log, read to its end.
    wait_for(
        lambda: "step 2" in (cluster.core.read_namespaced_pod_log("new-0", namespace) or ""),
        timeout=30,
    )
    out, err = logs_command(cluster, "logs-job", "-n", namespace).communicate(timeout=60)
    assert out == "step 1 loss 2.31\nstep 2 loss 2.05\n", (out, err)
    assert err.strip() == "--- new-0 (restart attempt 1) ---", err

    # -f follows: a line the trainer writes later arrives while the command runs.
    follow = logs_command(cluster, "logs-job", "-n", namespace, "-f")
    try:
        assert follow.stdout.readline() == "step 1 loss 2.31\n"
        assert follow.stdout.readline() == "step 2 loss 2.05\n"
        with log_file.open("a") as f:
            f.write(cri_line("step 3 loss 1.88"))
        assert follow.stdout.readline() == "step 3 loss 1.88\n"
    finally:
        follow.kill()
        follow.communicate(timeout=30)
