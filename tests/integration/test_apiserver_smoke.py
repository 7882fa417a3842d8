"""The integration tier's API server is real and has the JobSet and Kueue CRDs."""

from __future__ import annotations

import json

import pytest

from tests.cluster import Cluster


@pytest.mark.integration
def test_crds_installed(apiserver: Cluster) -> None:
    out = apiserver.kubectl("get", "crd", "-o", "name").stdout.split()
    assert "customresourcedefinition.apiextensions.k8s.io/jobsets.jobset.x-k8s.io" in out
    for kueue in (
        "workloads",
        "clusterqueues",
        "localqueues",
        "resourceflavors",
        "workloadpriorityclasses",
    ):
        assert f"customresourcedefinition.apiextensions.k8s.io/{kueue}.kueue.x-k8s.io" in out


@pytest.mark.integration
def test_jobset_server_side_dry_run(apiserver: Cluster, namespace: str) -> None:
    jobset = {
        "apiVersion": "jobset.x-k8s.io/v1alpha2",
        "kind": "JobSet",
        "metadata": {"name": "dry", "labels": {"kueue.x-k8s.io/queue-name": "default"}},
        "spec": {
            "replicatedJobs": [
                {
                    "name": "workers",
                    "replicas": 2,
                    "template": {
                        "spec": {
                            "parallelism": 2,
                            "completions": 2,
                            "template": {
                                "spec": {
                                    "restartPolicy": "Never",
                                    "containers": [{"name": "main", "image": "busybox"}],
                                }
                            },
                        }
                    },
                }
            ]
        },
    }
    proc = apiserver.apply(jobset, namespace, dry_run=True)
    assert "serverside-applied (server dry run)" in proc.stdout, proc.stdout
    # Dry run: nothing was stored.
    got = apiserver.kubectl("get", "jobsets", "-n", namespace, "-o", "json").stdout
    assert json.loads(got)["items"] == []
    # And the python client reaches the same server.
    from kubernetes import client

    version = client.VersionApi(apiserver.api_client).get_code()
    assert version.git_version.startswith("v1.")
