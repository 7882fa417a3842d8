"""kwok's fake nodes (TPU, GPU, CPU) and the stages that end trainer pods by image tag."""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

from local_plane.build import module_dir
from local_plane.processes import apply_objects
from local_plane.settings import (
    BUILD_MODULES,
    KWOK_NODE_ANNOTATION,
    KWOK_NODE_ANNOTATION_VALUE,
    KWOK_VERSION,
)

# --------------------------------------------------------------------------------------
# Fake nodes (kwok)
# --------------------------------------------------------------------------------------


def _node(
    name: str,
    *,
    labels: dict[str, str],
    capacity: dict[str, str],
    taints: Sequence[dict[str, str]] = (),
) -> dict[str, Any]:
    base_labels = {
        "kubernetes.io/hostname": name,
        "kubernetes.io/os": "linux",
        "kubernetes.io/arch": "amd64",
        "node.kubernetes.io/instance-type": labels.get("node.kubernetes.io/instance-type", "kwok"),
        "type": "kwok",
    }
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {
            "name": name,
            "labels": {**base_labels, **labels},
            "annotations": {KWOK_NODE_ANNOTATION: KWOK_NODE_ANNOTATION_VALUE},
        },
        "spec": {"taints": list(taints)},
        "status": {"capacity": dict(capacity), "allocatable": dict(capacity)},
    }


def tpu_node(
    name: str,
    pool: str,
    *,
    accelerator: str = "tpu-v6e-slice",
    topology: str = "2x4",
    chips: int = 4,
    machine_type: str = "ct6e-standard-4t",
) -> dict[str, Any]:
    """A fake TPU host as GKE labels it (one VM of a multi-host slice node pool)."""
    return _node(
        name,
        labels={
            "cloud.google.com/gke-tpu-accelerator": accelerator,
            "cloud.google.com/gke-tpu-topology": topology,
            "cloud.google.com/gke-nodepool": pool,
            "cloud.google.com/gke-accelerator-count": str(chips),
            "node.kubernetes.io/instance-type": machine_type,
        },
        capacity={"cpu": "180", "memory": "720Gi", "pods": "110", "google.com/tpu": str(chips)},
        taints=[{"key": "google.com/tpu", "value": "present", "effect": "NoSchedule"}],
    )


def gpu_node(
    name: str,
    pool: str,
    *,
    accelerator: str = "nvidia-h100-80gb",
    gpus: int = 8,
    machine_type: str = "a3-highgpu-8g",
) -> dict[str, Any]:
    """A fake GPU node (GKE taints GPU nodes with nvidia.com/gpu=present:NoSchedule)."""
    return _node(
        name,
        labels={
            "cloud.google.com/gke-accelerator": accelerator,
            "cloud.google.com/gke-accelerator-count": str(gpus),
            "cloud.google.com/gke-nodepool": pool,
            "node.kubernetes.io/instance-type": machine_type,
        },
        capacity={"cpu": "208", "memory": "1872Gi", "pods": "110", "nvidia.com/gpu": str(gpus)},
        taints=[{"key": "nvidia.com/gpu", "value": "present", "effect": "NoSchedule"}],
    )


def cpu_node(
    name: str, pool: str = "cpu-pool", *, cpu: str = "32", memory: str = "128Gi"
) -> dict[str, Any]:
    return _node(
        name,
        labels={
            "cloud.google.com/gke-nodepool": pool,
            "node.kubernetes.io/instance-type": "n2-standard-32",
        },
        capacity={"cpu": cpu, "memory": memory, "pods": "110"},
    )


def tpu_slice_nodes(pool: str, *, hosts: int = 2, **kwargs: Any) -> list[dict[str, Any]]:
    """All hosts of one TPU slice node pool: `{pool}-{i}`."""
    return [tpu_node(f"{pool}-{i}", pool, **kwargs) for i in range(hosts)]


def default_nodes() -> list[dict[str, Any]]:
    """What `up --full` creates: two v6e 2x4 slices (2 hosts each), 2 H100 nodes, 2 CPU nodes."""
    return [
        *tpu_slice_nodes("tpu-v6e-2x4-a"),
        *tpu_slice_nodes("tpu-v6e-2x4-b"),
        gpu_node("gpu-h100-0", "gpu-h100"),
        gpu_node("gpu-h100-1", "gpu-h100"),
        cpu_node("cpu-0"),
        cpu_node("cpu-1"),
    ]


def create_nodes(nodes: Sequence[dict[str, Any]]) -> None:
    """Create (or update) fake nodes; kwok marks them Ready and runs their pods."""
    apply_objects(nodes)


def _kwok_stages() -> list[dict[str, Any]]:
    """Stages from the pinned kwok module: node init + lease heartbeat, pod general lifecycle.

    The pod stages (`kustomize/stage/pod/general`) walk a pod Pending -> Running ->
    Succeeded for Job-owned pods. Each waits a random time between `delay` and `jitter`
    (shipped: 1 s and 6 s), shortened here to POSTTRAIN_KWOK_DELAY_MS (default 200) and
    POSTTRAIN_KWOK_JITTER_MS (default 300). Per-pod annotations still override them
    (set both `<stage>.stage.kwok.x-k8s.io/delay` and `.../jitter-delay`: kwok uses the
    jitter whenever it is below the delay). scripts/control-plane/kwok-stages.yaml, if
    present, adds the project's own stages.
    """
    import yaml

    base = module_dir("sigs.k8s.io/kwok", KWOK_VERSION) / "kustomize/stage"
    delay = int(os.environ.get("POSTTRAIN_KWOK_DELAY_MS", "200"))
    jitter = int(os.environ.get("POSTTRAIN_KWOK_JITTER_MS", "300"))
    stages: list[dict[str, Any]] = []
    for sub in ("node/fast", "node/heartbeat-with-lease", "pod/general"):
        kustomization = yaml.safe_load((base / sub / "kustomization.yaml").read_text())
        for res in kustomization["resources"]:
            for doc in yaml.safe_load_all((base / sub / res).read_text()):
                if not doc:
                    continue
                d = doc["spec"].get("delay")
                if sub.startswith("pod/") and d:
                    d["durationMilliseconds"] = delay
                    d["jitterDurationMilliseconds"] = jitter
                stages.append(doc)
    # posttrain's own stages: fail or slow down trainer pods by image tag (e2e tier).
    own = BUILD_MODULES / "kwok-stages.yaml"
    if own.is_file():
        stages += [d for d in yaml.safe_load_all(own.read_text()) if d]
    return stages
