"""The Pathways parts of a TPU job's JobSet, as xpk and google/pathways-job render them.

`pathways-head` (one pod on a CPU node pool, exclusive per node, not per pool):
`pathways-rm` and `pathways-proxy` as native sidecars (init containers with
`restartPolicy: Always`) with xpk's CPU and memory limits, and the trainer as the single
JAX client (`JAX_PLATFORMS=proxy`). `worker` (one Job per slice, one pod per TPU host,
exclusive per node pool): `pathways-worker` with `restartPolicy: OnFailure` and a
backoff of 4 per host, so a crashed worker restarts in place; a podFailurePolicy is not
allowed with OnFailure, so workers have none. The JobSet starts the head first
(`startupPolicy: InOrder`). Differences from xpk are listed in docs/gke-fidelity.md.
"""

from __future__ import annotations

from typing import Any

from posttrain.catalog import NODEPOOL_LABEL, Placement

# Google's published images (xpk and pathways-job default to these).
SERVER_IMAGE = "us-docker.pkg.dev/cloud-tpu-v2-images/pathways/server:latest"
PROXY_IMAGE = "us-docker.pkg.dev/cloud-tpu-v2-images/pathways/proxy_server:latest"
# xpk's default CPU node pool for the head pod.
HEAD_NODE_POOL = "cpu-np"

HEAD = "pathways-head"
WORKER = "worker"
PROXY_PORT = 29000
RM_PORT = 29001
WORKER_PORT = 29005
RM_PORTS = (RM_PORT, 29002)
WORKER_PORTS = (WORKER_PORT, 29006, 8471, 8080)
WORKER_BACKOFF_PER_HOST = 4

# Limits (= requests) as xpk sets them; the trainer's apply when spec.resources leaves
# cpu and memory out.
RM_RESOURCES = {"cpu": "8", "memory": "32G"}
PROXY_RESOURCES = {"cpu": "16", "memory": "100G"}
TRAINER_RESOURCES = {"cpu": "24", "memory": "100G"}

EXCLUSIVE_TOPOLOGY = "alpha.jobset.sigs.k8s.io/exclusive-topology"
HEAD_EXCLUSIVE = {EXCLUSIVE_TOPOLOGY: "kubernetes.io/hostname"}
WORKER_EXCLUSIVE = {EXCLUSIVE_TOPOLOGY: NODEPOOL_LABEL}
STARTUP_POLICY = {"startupPolicyOrder": "InOrder"}

COORDINATOR_LABEL = "metadata.labels['jobset.sigs.k8s.io/coordinator']"
JOBSET_NAME_ANNOTATION = "metadata.annotations['jobset.sigs.k8s.io/jobset-name']"
REPLICATED_JOB_ANNOTATION = "metadata.annotations['jobset.sigs.k8s.io/replicatedjob-name']"


def _field(name: str, path: str) -> dict[str, Any]:
    return {"name": name, "valueFrom": {"fieldRef": {"fieldPath": path}}}


def _ports(ports: tuple[int, ...]) -> list[dict[str, Any]]:
    return [{"containerPort": p, "protocol": "TCP"} for p in ports]


def _limits(resources: dict[str, str]) -> dict[str, Any]:
    return {"requests": dict(resources), "limits": dict(resources)}


def _jobset_env() -> list[dict[str, Any]]:
    return [
        _field("JOBSET_NAME", JOBSET_NAME_ANNOTATION),
        _field("REPLICATED_JOB_NAME", REPLICATED_JOB_ANNOTATION),
    ]


def head_sidecars(
    *,
    server_image: str,
    proxy_image: str,
    head: str,
    slices: int,
    instance_type: str,
    scratch: str,
) -> list[dict[str, Any]]:
    """pathways-rm and pathways-proxy, native sidecars of the head pod."""
    return [
        {
            "name": "pathways-rm",
            "image": server_image,
            "restartPolicy": "Always",
            "args": [
                f"--server_port={RM_PORT}",
                "--node_type=resource_manager",
                f"--instance_count={slices}",
                f"--instance_type={instance_type}",
                f"--gcs_scratch_location={scratch}",
            ],
            "env": [
                *_jobset_env(),
                _field("HOST_ADDRESS", COORDINATOR_LABEL),
                {"name": "TPU_SKIP_MDS_QUERY", "value": "true"},
            ],
            "ports": _ports(RM_PORTS),
            "resources": _limits(RM_RESOURCES),
        },
        {
            "name": "pathways-proxy",
            "image": proxy_image,
            "restartPolicy": "Always",
            "args": [
                f"--server_port={PROXY_PORT}",
                f"--resource_manager_address={head}:{RM_PORT}",
                f"--gcs_scratch_location={scratch}",
            ],
            "ports": _ports((PROXY_PORT,)),
            "resources": _limits(PROXY_RESOURCES),
        },
    ]


def trainer_resources(cpu: str | None, memory: str | None) -> dict[str, Any]:
    """The head's trainer container: the job's cpu/memory, else xpk's."""
    return _limits(
        {"cpu": cpu or TRAINER_RESOURCES["cpu"], "memory": memory or TRAINER_RESOURCES["memory"]}
    )


def head_node_selector(node_pool: str) -> dict[str, str]:
    return {NODEPOOL_LABEL: node_pool}


def worker_container(
    *, server_image: str, head: str, scratch: str, placement: Placement, megascale_env: list
) -> dict[str, Any]:
    """pathways-worker, one per TPU host."""
    return {
        "name": "pathways-worker",
        "image": server_image,
        "args": [
            f"--server_port={WORKER_PORT}",
            f"--resource_manager_address={head}:{RM_PORT}",
            f"--gcs_scratch_location={scratch}",
        ],
        "env": [
            {"name": "XCLOUD_ENVIRONMENT", "value": "GCP"},
            # Set by xpk and pathways-job until a Pathways fix lands.
            {"name": "MEGASCALE_GRPC_ENABLE_XOR_TRACER", "value": "false"},
            *megascale_env,
            *_jobset_env(),
        ],
        "ports": _ports(WORKER_PORTS),
        "resources": {"limits": {placement.resource_name: placement.devices_per_host}},
    }


def exclusive(rjob: dict[str, Any], annotations: dict[str, str]) -> None:
    """Exclusive placement of one replicated job (JobSet reads the Job template's
    annotation), in place."""
    rjob["template"]["metadata"]["annotations"] = dict(annotations)


def restart_workers_in_place(rjob: dict[str, Any], hosts: int) -> None:
    """Make a worker replicated job restart crashed pods in place, as xpk does:
    restartPolicy OnFailure, backoff 4 per host and no podFailurePolicy (the API server
    refuses one with OnFailure)."""
    job_spec = rjob["template"]["spec"]
    job_spec.pop("podFailurePolicy", None)
    job_spec["backoffLimit"] = hosts * WORKER_BACKOFF_PER_HOST
    job_spec["template"]["spec"]["restartPolicy"] = "OnFailure"
