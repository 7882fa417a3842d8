"""Smoke test of the local control plane: a 2-host TPU slice JobSet runs to Completed.

JobSet controller -> Jobs, kube-controller-manager -> Pods, kube-scheduler -> kwok TPU
nodes of one node pool, kwok -> Running -> Succeeded, JobSet -> Completed. The JobSet
mutating webhook (served on 127.0.0.1 outside the cluster) must have defaulted the spec.
"""

from __future__ import annotations

import copy
import json

import pytest

from tests.cluster import Cluster, has_condition

EXCLUSIVE = "alpha.jobset.sigs.k8s.io/exclusive-topology"
NODEPOOL = "cloud.google.com/gke-nodepool"


def tpu_slice_jobset(name: str) -> dict:
    """One v6e 2x4 slice: 2 hosts x 4 chips, exclusive per node pool."""
    return {
        "apiVersion": "jobset.x-k8s.io/v1alpha2",
        "kind": "JobSet",
        "metadata": {"name": name, "annotations": {EXCLUSIVE: NODEPOOL}},
        "spec": {
            "replicatedJobs": [
                {
                    "name": "slice",
                    "replicas": 1,
                    "template": {
                        "spec": {
                            "parallelism": 2,
                            "completions": 2,
                            "backoffLimit": 0,
                            "template": {
                                # Both hosts run at once (as real JAX hosts do), so the
                                # second pod cannot reuse the first one's node after it ends.
                                "metadata": {
                                    "annotations": {
                                        "pod-complete.stage.kwok.x-k8s.io/delay": "3s",
                                        "pod-complete.stage.kwok.x-k8s.io/jitter-delay": "3s",
                                    }
                                },
                                "spec": {
                                    "restartPolicy": "Never",
                                    "nodeSelector": {
                                        "cloud.google.com/gke-tpu-accelerator": "tpu-v6e-slice",
                                        "cloud.google.com/gke-tpu-topology": "2x4",
                                    },
                                    "tolerations": [
                                        {
                                            "key": "google.com/tpu",
                                            "operator": "Exists",
                                            "effect": "NoSchedule",
                                        }
                                    ],
                                    "containers": [
                                        {
                                            "name": "main",
                                            "image": "python:3.11-slim",
                                            "command": ["python", "-c", "print('hello')"],
                                            "resources": {
                                                "requests": {"google.com/tpu": "4"},
                                                "limits": {"google.com/tpu": "4"},
                                            },
                                        }
                                    ],
                                },
                            },
                        }
                    },
                }
            ]
        },
    }


@pytest.mark.e2e
def test_tpu_slice_jobset_completes(cluster: Cluster, namespace: str) -> None:
    cluster.apply(tpu_slice_jobset("smoke"), namespace)

    # Defaults that only JobSet's mutating webhook sets (the CRD schema does not).
    js = cluster.get_jobset("smoke", namespace)
    job_spec = js["spec"]["replicatedJobs"][0]["template"]["spec"]
    assert job_spec.get("completionMode") == "Indexed", json.dumps(js["spec"], indent=1)
    assert js["spec"].get("network", {}).get("enableDNSHostnames") is True
    assert js["spec"].get("successPolicy", {}).get("operator") == "All"

    done = cluster.wait_for(
        lambda: (
            (j := cluster.get_jobset("smoke", namespace)) and has_condition(j, "Completed") and j
        ),
        timeout=120,
        what="JobSet smoke to reach Completed",
        describe=lambda: cluster.describe(namespace),
    )
    assert not has_condition(done, "Failed")

    pods = json.loads(cluster.kubectl("get", "pods", "-n", namespace, "-o", "json").stdout)["items"]
    assert len(pods) == 2, [p["metadata"]["name"] for p in pods]
    assert {p["status"]["phase"] for p in pods} == {"Succeeded"}
    assert sorted(
        p["metadata"]["annotations"]["batch.kubernetes.io/job-completion-index"] for p in pods
    ) == ["0", "1"]
    nodes = {p["spec"]["nodeName"] for p in pods}
    assert len(nodes) == 2, f"two hosts expected, got {nodes}"
    pools = {cluster.get("node", n)["metadata"]["labels"][NODEPOOL] for n in nodes}
    assert len(pools) == 1, f"exclusive placement must keep the slice in one node pool: {pools}"
    for p in pods:
        assert p["metadata"]["labels"]["jobset.sigs.k8s.io/jobset-name"] == "smoke"
    # JobSet's pod webhook implements exclusive placement: the leader (index 0) gets
    # pod (anti-)affinity on the node-pool key, followers a nodeSelector for its pool.
    by_index = {
        p["metadata"]["annotations"]["batch.kubernetes.io/job-completion-index"]: p for p in pods
    }
    leader_affinity = by_index["0"]["spec"].get("affinity", {})
    assert (
        leader_affinity["podAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"][0][
            "topologyKey"
        ]
        == NODEPOOL
    )
    assert by_index["1"]["spec"]["nodeSelector"][NODEPOOL] == pools.pop()


@pytest.mark.e2e
def test_jobset_validation_webhook_rejects_bad_spec(cluster: Cluster, namespace: str) -> None:
    """JobSet's validating webhook refuses a JobSet whose success policy names no job."""
    bad = copy.deepcopy(tpu_slice_jobset("bad"))
    bad["spec"]["successPolicy"] = {"operator": "All", "targetReplicatedJobs": ["does-not-exist"]}
    proc = cluster.kubectl("apply", "-n", namespace, "-f", "-", input=json.dumps(bad), check=False)
    assert proc.returncode != 0
    # The CRD schema has no such rule: this message is the webhook's (validateCreate).
    assert "'does-not-exist' does not appear in .spec.ReplicatedJobs" in proc.stderr, proc.stderr


@pytest.mark.e2e
def test_kueue_admits_queued_jobset(cluster: Cluster, namespace: str) -> None:
    """Kueue suspends a queued JobSet on create (its webhook), admits it against a TPU
    ClusterQueue, unsuspends it, and the slice runs to Completed."""
    queue = cluster.tpu_queue(namespace, "tpu")
    cq = queue[1]["metadata"]["name"]
    try:
        js = tpu_slice_jobset("queued")
        js["metadata"]["labels"] = {"kueue.x-k8s.io/queue-name": "tpu"}
        # Kueue's mutating webhook suspends it at creation (the create's answer shows it;
        # a later read may already see it admitted and running).
        out = cluster.kubectl(
            "create", "-n", namespace, "-o", "json", "-f", "-", input=json.dumps(js)
        )
        assert json.loads(out.stdout)["spec"].get("suspend") is True, out.stdout

        cluster.wait_for(
            lambda: has_condition(cluster.get_jobset("queued", namespace), "Completed"),
            timeout=120,
            what="queued JobSet to be admitted by Kueue and complete",
            describe=lambda: cluster.describe(namespace, "jobsets,workloads,jobs,pods,events"),
        )
        workloads = cluster.custom.list_namespaced_custom_object(
            "kueue.x-k8s.io", "v1beta2", namespace, "workloads"
        )["items"]
        assert len(workloads) == 1, workloads
        assert has_condition(workloads[0], "Admitted") or has_condition(workloads[0], "Finished")
        assert workloads[0]["status"]["admission"]["clusterQueue"] == cq
    finally:
        cluster.delete_all(queue)
