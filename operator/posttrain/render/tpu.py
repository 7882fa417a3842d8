"""What a TPU pod needs on GKE (see docs/gke-fidelity.md for the choices and xpk's).

- The node's network (`hostNetwork: true`, `dnsPolicy: ClusterFirstWithHostNet`), as
  GKE's multi-host TPU examples, xpk and pathways-job run TPU hosts: the slice's hosts
  reach each other and the DCN without the pod network's overlay. A job opts out with
  `spec.resources.hostNetwork: false`. The Pathways head pod follows the same setting.
- `/dev/shm` as a memory-backed emptyDir (the container runtime's default is 64 MiB;
  libtpu, the data loader's worker processes and Orbax use shared memory).
- No privileged mode: on GKE 1.28 and later the TPU device plugin gives a container
  that requests `google.com/tpu` its TPU devices (/dev/vfio or /dev/accel*) and the
  memlock limit libtpu needs, so the container keeps the default securityContext.
- Node selection (in the catalog's Placement): accelerator, topology and machine type
  (`node.kubernetes.io/instance-type`), so a 2-host 2x4 job never lands on a 1-host
  8-chip pool, or the reverse.
"""

from __future__ import annotations

from typing import Any

SHM_VOLUME = "dshm"
SHM_MOUNT = "/dev/shm"


def host_network(enabled: bool) -> dict[str, Any]:
    """Pod fields that put a pod on its node's network, or nothing."""
    if not enabled:
        return {}
    return {"hostNetwork": True, "dnsPolicy": "ClusterFirstWithHostNet"}


def decorate(pod_template: dict[str, Any], *, use_host_network: bool) -> None:
    """Add what a TPU host pod needs to a pod template, in place: the node's network
    (unless opted out) and a memory-backed /dev/shm in every container."""
    pod = pod_template["spec"]
    pod.update(host_network(use_host_network))
    pod.setdefault("volumes", []).append({"name": SHM_VOLUME, "emptyDir": {"medium": "Memory"}})
    for container in pod["containers"]:
        container.setdefault("volumeMounts", []).append(
            {"name": SHM_VOLUME, "mountPath": SHM_MOUNT}
        )
