"""The project's Pathways example on the full local cluster with Kueue.

examples/sft-qwen3-v6e-256-pathways.yaml, unchanged apart from its namespace, with
manifests/kueue/tpu-v6e.yaml (its LocalQueue moved to that namespace; it defines the
PriorityClass `high` the example names): Kueue admits the JobSet, the head pod lands on
the CPU pool `cpu-np`, each slice's 64 workers on one v6e 16x16 node pool of
ct6e-standard-4t hosts, and the job succeeds (kwok ends the pods; the head's trainer
after a few seconds).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from operator_process import OperatorProcess, chart_env, trainer_images

from tests.cluster import Cluster, cpu_node, tpu_slice_nodes, wait_for
from tests.e2e.test_operator_e2e import operator_identity  # noqa: F401 (a fixture)

pytestmark = pytest.mark.e2e
ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "sft-qwen3-v6e-256-pathways.yaml"
KUEUE = ROOT / "manifests" / "kueue" / "tpu-v6e.yaml"
POOLS = ("pw-v6e-16x16-a", "pw-v6e-16x16-b")


@pytest.fixture
def pathways_nodes(cluster: Cluster):
    """Two v6e-256 slice node pools (64 hosts each) and one n2-standard-64-sized CPU
    node in xpk's pool `cpu-np` for the head (48 CPUs, 232 GB)."""
    nodes = [n for pool in POOLS for n in tpu_slice_nodes(pool, hosts=64, topology="16x16")]
    nodes.append(cpu_node("cpu-np-0", "cpu-np", cpu="64", memory="256Gi"))
    names = cluster.create_nodes(nodes)
    yield
    cluster.delete_nodes(names)


@pytest.fixture
def slow_operator(cluster: Cluster, namespace: str, operator_identity, tmp_path):  # noqa: F811
    """The operator as the chart runs it; the trainer image makes kwok keep the head's
    pod running for a few seconds (scripts/control-plane/kwok-stages.yaml)."""
    kubeconfig, release_ns = operator_identity
    op = OperatorProcess(kubeconfig, tmp_path, release_ns, "-n", namespace)
    op.env.update(chart_env(release_ns), **trainer_images("posttrain-trainer:slow"))
    yield op.start()
    op.stop()
    assert "Forbidden" not in op.logs() and " 403" not in op.logs(), op.logs()


def test_pathways_example_is_admitted_by_kueue_and_runs(
    cluster: Cluster, namespace: str, pathways_nodes, slow_operator
):
    kueue = list(yaml.safe_load_all(KUEUE.read_text()))
    for doc in kueue:
        if doc["kind"] == "LocalQueue":
            doc["metadata"]["namespace"] = namespace
    job = yaml.safe_load(EXAMPLE.read_text())
    job["metadata"]["namespace"] = namespace
    name = job["metadata"]["name"]
    cluster.apply(kueue)
    try:
        cluster.apply([job])
        cluster.kubectl(
            "wait", "--for=condition=Succeeded", f"ptj/{name}", "-n", namespace,
            "--timeout=420s",
        )  # fmt: skip
        out = cluster.kubectl("get", "workloads", "-n", namespace, "-o", "json").stdout
        (workload,) = json.loads(out)["items"]
        admitted = {c["type"]: c["status"] for c in workload["status"]["conditions"]}
        assert admitted.get("Admitted") == "True", workload["status"]
        assert workload["spec"].get("priority") == 750  # from the PriorityClass `high`
        pods = cluster.core.list_namespaced_pod(namespace).items
        head = [p for p in pods if "pathways-head" in p.metadata.name]
        workers = [p for p in pods if "-worker-" in p.metadata.name]
        assert {p.spec.node_name for p in head} == {"cpu-np-0"}
        # The head's success ends the JobSet, so not every worker pod need exist by now;
        # those that do sit on one pool per slice, each slice on its own pool.
        assert workers
        pools: dict[str, set[str]] = {}
        for p in workers:
            index = p.metadata.labels["jobset.sigs.k8s.io/job-index"]
            pools.setdefault(index, set()).add(p.spec.node_name.rsplit("-", 1)[0])
        assert all(len(placed) == 1 and placed <= set(POOLS) for placed in pools.values())
        assert len(set().union(*pools.values())) == len(pools), pools
    finally:
        cluster.kubectl("delete", "ptj", name, "-n", namespace, "--ignore-not-found")
        cluster.delete_all(kueue)
        wait_for(
            lambda: not cluster.core.list_namespaced_pod(namespace).items,
            timeout=120,
            what="the job's pods to go",
        )
