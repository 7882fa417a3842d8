"""A JobSet and trainer pods as the JobSet controller labels them, made by a test itself
(for `posttrain logs`, which finds process 0's pod of the newest restart attempt)."""

from __future__ import annotations

from typing import Any


def jobset(name: str, *, suspend: bool = False) -> dict:
    """A one-slice JobSet; suspended, the JobSet controller makes no pods of its own."""
    pod_template = {
        "spec": {"restartPolicy": "Never", "containers": [{"name": "trainer", "image": "t"}]}
    }
    spec: dict[str, Any] = {
        "replicatedJobs": [
            {"name": "slice", "replicas": 1, "template": {"spec": {"template": pod_template}}}
        ]
    }
    if suspend:
        spec = {"suspend": True, **spec}
    return {
        "apiVersion": "jobset.x-k8s.io/v1alpha2",
        "kind": "JobSet",
        "metadata": {"name": name},
        "spec": spec,
    }


def trainer_pod(
    name: str, jobset_name: str, attempt: int, index: int = 0, **placement: Any
) -> dict:
    """Pod `index` of slice 0 of restart `attempt`; `placement`: nodeSelector, tolerations."""
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": name,
            "labels": {
                "jobset.sigs.k8s.io/jobset-name": jobset_name,
                "jobset.sigs.k8s.io/replicatedjob-name": "slice",
                "jobset.sigs.k8s.io/job-index": "0",
                "jobset.sigs.k8s.io/restart-attempt": str(attempt),
                "batch.kubernetes.io/job-completion-index": str(index),
            },
        },
        "spec": {"containers": [{"name": "trainer", "image": "t"}], **placement},
    }
