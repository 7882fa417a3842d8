"""What a GPU pod needs on GKE, per machine type (see docs/gpu.md).

Every GPU pod gets the node's NVIDIA driver libraries (/usr/local/nvidia, on
LD_LIBRARY_PATH) and a memory-backed /dev/shm for NCCL. A multi-node job on whole
8-GPU (4 on GB200) machines also gets the GPUDirect stack of its machine type, so that
NCCL's cross-node collectives use the GPU NICs instead of the host's one:

- a3-highgpu-8g (H100): GPUDirect-TCPX, a `tcpx-daemon` sidecar and 4 GPU NICs;
- a3-megagpu-8g (H100 Mega): GPUDirect-TCPXO, a `tcpxo-daemon` sidecar and 8 GPU NICs;
- a3-ultragpu-8g (H200), a4-highgpu-8g (B200), a4x-highgpu-4g (GB200): GPUDirect RDMA
  with Google's gIB NCCL plugin, 8 RDMA NICs and no sidecar.

The NICs come from the cluster's multi-network objects, named as GKE's guides name them;
the NCCL plugin comes from the installer DaemonSet of the cluster (it fills
/home/kubernetes/bin/nvidia and /home/kubernetes/bin/gib on each node). The trainer's
entrypoint sources the plugin's NCCL settings script named by POSTTRAIN_NCCL_ENV_SCRIPT.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from posttrain.catalog import GPU_TYPES, Placement

NVIDIA_HOST_DIR = "/home/kubernetes/bin/nvidia"  # the driver installer's output
NVIDIA_MOUNT = "/usr/local/nvidia"
LD_LIBRARY_PATH = f"{NVIDIA_MOUNT}/lib64"
NCCL_ENV_SCRIPT_VAR = "POSTTRAIN_NCCL_ENV_SCRIPT"
GPU_DEVICE_FILES = (*(f"/dev/nvidia{i}" for i in range(8)), "/dev/nvidiactl", "/dev/nvidia-uvm")
# GKE taints Arm node pools (A4X: GB200 on Grace hosts) kubernetes.io/arch=arm64.
ARM_GPUS = {"nvidia-gb200"}
ARM_TOLERATION = {
    "key": "kubernetes.io/arch",
    "operator": "Equal",
    "value": "arm64",
    "effect": "NoSchedule",
}
# Taint of GPU node pools made by Cluster Toolkit blueprints (as xpk creates them).
USER_WORKLOAD_TOLERATION = {
    "key": "user-workload",
    "operator": "Equal",
    "value": "true",
    "effect": "NoSchedule",
}


@dataclass(frozen=True)
class GpuDirect:
    """The GPUDirect stack of one machine type."""

    name: str  # tcpx, tcpxo or rdma
    machine_type: str
    networks: tuple[str, ...]  # GKE Network of eth0, eth1, ... ("default": the pod network)
    nccl_env: tuple[tuple[str, str], ...] = ()  # NCCL settings set in the pod itself
    nccl_env_script: str | None = None  # the plugin's settings script, sourced at start


_TCPX_NICS = "eth1,eth2,eth3,eth4"
TCPX = GpuDirect(
    "tcpx",
    "a3-highgpu-8g",
    ("default", "vpc1", "vpc2", "vpc3", "vpc4"),
    # The settings of GKE's TCPX guide (the TCPX plugin ships no settings script).
    nccl_env=(
        ("NCCL_SOCKET_IFNAME", "eth0"),
        ("NCCL_ALGO", "Ring"),
        ("NCCL_PROTO", "Simple"),
        ("NCCL_CROSS_NIC", "0"),
        ("NCCL_NET_GDR_LEVEL", "PIX"),
        ("NCCL_P2P_PXN_LEVEL", "0"),
        ("NCCL_GPUDIRECTTCPX_SOCKET_IFNAME", _TCPX_NICS),
        ("NCCL_GPUDIRECTTCPX_CTRL_DEV", "eth0"),
        ("NCCL_DYNAMIC_CHUNK_SIZE", "524288"),
        ("NCCL_P2P_NET_CHUNKSIZE", "524288"),
        ("NCCL_P2P_PCI_CHUNKSIZE", "524288"),
        ("NCCL_P2P_NVL_CHUNKSIZE", "1048576"),
        ("NCCL_BUFFSIZE", "4194304"),
        ("NCCL_NSOCKS_PERTHREAD", "4"),
        ("NCCL_SOCKET_NTHREADS", "1"),
        (
            "NCCL_GPUDIRECTTCPX_TX_BINDINGS",
            "eth1:8-21,112-125;eth2:8-21,112-125;eth3:60-73,164-177;eth4:60-73,164-177",
        ),
        (
            "NCCL_GPUDIRECTTCPX_RX_BINDINGS",
            "eth1:22-35,126-139;eth2:22-35,126-139;eth3:74-87,178-191;eth4:74-87,178-191",
        ),
        ("NCCL_GPUDIRECTTCPX_PROGRAM_FLOW_STEERING_WAIT_MICROS", "500000"),
    ),
)
TCPXO = GpuDirect(
    "tcpxo",
    "a3-megagpu-8g",
    ("default", *(f"vpc{i}" for i in range(1, 9))),
    nccl_env=(("NCCL_FASTRAK_LLCM_DEVICE_DIRECTORY", "/dev/aperture_devices"),),
    nccl_env_script=f"{LD_LIBRARY_PATH}/nccl-env-profile.sh",
)
_RDMA_NETWORKS = ("default", "gvnic-1", *(f"rdma-{i}" for i in range(8)))
_GIB_SCRIPT = "/usr/local/gib/scripts/set_nccl_env.sh"
RDMA_A3_ULTRA = GpuDirect("rdma", "a3-ultragpu-8g", _RDMA_NETWORKS, nccl_env_script=_GIB_SCRIPT)
RDMA_A4 = GpuDirect("rdma", "a4-highgpu-8g", _RDMA_NETWORKS, nccl_env_script=_GIB_SCRIPT)
RDMA_A4X = GpuDirect(
    "rdma",
    "a4x-highgpu-4g",
    ("default", "gvnic-1", *(f"rdma-{i}" for i in range(4))),
    nccl_env_script=_GIB_SCRIPT,
)

# GPU type (catalog.GPU_TYPES) -> its GPUDirect stack on GKE; None: the machine types of
# that GPU have no GPU NICs (a2-highgpu, a2-ultragpu, g2), NCCL uses the host network.
GPUDIRECT: dict[str, GpuDirect | None] = {
    "nvidia-tesla-a100": None,
    "nvidia-a100-80gb": None,
    "nvidia-l4": None,
    "nvidia-h100-80gb": TCPX,
    "nvidia-h100-mega-80gb": TCPXO,
    "nvidia-h200-141gb": RDMA_A3_ULTRA,
    "nvidia-b200": RDMA_A4,
    "nvidia-gb200": RDMA_A4X,
}

# Sidecar images: the versions GKE's own GPUDirect test manifests run
# (GoogleCloudPlatform/container-engine-accelerators, gpudirect-tcpx(o)/nccl-test*.yaml).
TCPX_DAEMON_IMAGE = "us-docker.pkg.dev/gce-ai-infra/gpudirect-tcpx/tcpgpudmarxd-dev:v2.0.12"
TCPXO_DAEMON_IMAGE = "us-docker.pkg.dev/gce-ai-infra/gpudirect-tcpxo/tcpgpudmarxd-dev:v1.0.21"


def gpudirect(placement: Placement, nodes: int) -> GpuDirect | None:
    """The GPUDirect stack a GPU job gets: only across nodes, on whole machines."""
    stack = GPUDIRECT.get(placement.accelerator)
    whole = placement.devices_per_host == GPU_TYPES[placement.accelerator].max_per_node
    return stack if stack and nodes > 1 and whole else None


def _env(pairs: tuple[tuple[str, str], ...]) -> list[dict[str, str]]:
    return [{"name": k, "value": v} for k, v in pairs]


def _host_path(name: str, path: str) -> dict[str, Any]:
    return {"name": name, "hostPath": {"path": path}}


def _interfaces(networks: tuple[str, ...]) -> str:
    entries = [{"interfaceName": f"eth{i}", "network": n} for i, n in enumerate(networks)]
    return json.dumps(entries)


def _daemon_devices(extra: tuple[str, ...] = ()) -> str:
    return "".join(f"- path: {p}\n" for p in (*GPU_DEVICE_FILES, *extra))


def _daemon(name: str, image: str, mounts: list[dict[str, str]], **fields: Any) -> dict:
    """A GPUDirect receive-data-path daemon, as a native sidecar of the trainer."""
    return {
        "name": name,
        "image": image,
        "imagePullPolicy": "Always",
        "restartPolicy": "Always",
        **fields,
        "env": [{"name": "LD_LIBRARY_PATH", "value": LD_LIBRARY_PATH}],
        "volumeMounts": [
            {"name": "nvidia", "mountPath": NVIDIA_MOUNT},
            {"name": "sys", "mountPath": "/hostsysfs"},
            {"name": "proc-sys", "mountPath": "/hostprocsysfs"},
            *mounts,
        ],
    }


def _daemon_volumes(spec: dict[str, Any], socket: dict[str, Any]) -> None:
    spec["volumes"] += [_host_path("sys", "/sys"), _host_path("proc-sys", "/proc/sys"), socket]


def _tcpx(spec: dict[str, Any], annotations: dict[str, str], trainer: dict[str, Any]) -> None:
    annotations["devices.gke.io/container.tcpx-daemon"] = _daemon_devices()
    _daemon_volumes(spec, _host_path("tcpx-socket", "/run/tcpx"))
    daemon = _daemon(
        "tcpx-daemon",
        TCPX_DAEMON_IMAGE,
        [{"name": "tcpx-socket", "mountPath": "/run/tcpx"}],
        command=[
            "/tcpgpudmarxd/build/app/tcpgpudmarxd",
            "--gpu_nic_preset",
            "a3vm",
            "--gpu_shmem_type",
            "fd",
            "--uds_path",
            "/run/tcpx",
            "--setup_param",
            '"--verbose 128 2 0 "',
        ],
        securityContext={"capabilities": {"add": ["NET_ADMIN"]}},
    )
    spec.setdefault("initContainers", []).append(daemon)
    # The TCPX NCCL plugin finds the daemon's sockets under /tmp.
    trainer["volumeMounts"].append({"name": "tcpx-socket", "mountPath": "/tmp"})


def _tcpxo(spec: dict[str, Any], annotations: dict[str, str], trainer: dict[str, Any]) -> None:
    annotations["devices.gke.io/container.tcpxo-daemon"] = _daemon_devices(
        ("/dev/dmabuf_import_helper",)
    )
    _daemon_volumes(spec, _host_path("aperture-devices", "/dev/aperture_devices"))
    daemon = _daemon(
        "tcpxo-daemon",
        TCPXO_DAEMON_IMAGE,
        [],
        command=["/bin/sh", "-c"],
        args=[
            "set -ex\nchmod 755 /fts/entrypoint_rxdm_container.sh\n"
            "/fts/entrypoint_rxdm_container.sh --num_hops=2 --num_nics=8 --uid= "
            "--alsologtostderr"
        ],
        securityContext={"capabilities": {"add": ["NET_ADMIN", "NET_BIND_SERVICE"]}},
    )
    spec.setdefault("initContainers", []).append(daemon)
    trainer["volumeMounts"].append(
        {"name": "aperture-devices", "mountPath": "/dev/aperture_devices"}
    )


def _rdma(spec: dict[str, Any], annotations: dict[str, str], trainer: dict[str, Any]) -> None:
    spec["volumes"].append(_host_path("gib", "/home/kubernetes/bin/gib"))
    trainer["volumeMounts"].append({"name": "gib", "mountPath": "/usr/local/gib"})


_STACKS = {"tcpx": _tcpx, "tcpxo": _tcpxo, "rdma": _rdma}


def decorate(template: dict[str, Any], placement: Placement, nodes: int) -> None:
    """Add what GKE needs to a GPU job's pod template ({metadata, spec}, as the JobSet
    renderer builds it, with a container named `trainer`), in place."""
    spec = template["spec"]
    (trainer,) = [c for c in spec["containers"] if c["name"] == "trainer"]
    spec.setdefault("volumes", []).extend(
        [
            _host_path("nvidia", NVIDIA_HOST_DIR),
            {"name": "dshm", "emptyDir": {"medium": "Memory"}},
        ]
    )
    trainer.setdefault("volumeMounts", []).extend(
        [
            {"name": "nvidia", "mountPath": NVIDIA_MOUNT, "readOnly": True},
            {"name": "dshm", "mountPath": "/dev/shm"},
        ]
    )
    trainer["env"].append({"name": "LD_LIBRARY_PATH", "value": LD_LIBRARY_PATH})
    if placement.accelerator in ARM_GPUS:
        spec.setdefault("tolerations", []).append(dict(ARM_TOLERATION))
    stack = gpudirect(placement, nodes)
    if stack is None:
        return
    annotations = template.setdefault("metadata", {}).setdefault("annotations", {})
    annotations["networking.gke.io/default-interface"] = "eth0"
    annotations["networking.gke.io/interfaces"] = _interfaces(stack.networks)
    _STACKS[stack.name](spec, annotations, trainer)
    trainer["env"] += _env(stack.nccl_env)
    if stack.nccl_env_script:
        trainer["env"].append({"name": NCCL_ENV_SCRIPT_VAR, "value": stack.nccl_env_script})
    spec.setdefault("tolerations", []).append(dict(USER_WORKLOAD_TOLERATION))
