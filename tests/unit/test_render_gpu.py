"""GPU pods as GKE runs them (posttrain.render.gpu): driver libraries, /dev/shm, JAX on
CUDA, and per machine type the GPUDirect stack, compared with what xpk's own decorators
add to the same JobSets.

tests/unit/data/xpk-1.16.0-gpu-decorators.json was made by installing xpk 1.16.0 from
PyPI, rendering the three GPU golden jobs with `gpu.decorate` switched off, passing each
JobSet through xpk's `tcpx_decorator` / `tcpxo_decorator` / `rdma_decorator`
`.decorate_jobset` and recording what they added. docs/gpu.md lists every difference.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from posttrain.catalog import GPU_TYPES, resolve
from posttrain.checks import load_job
from posttrain.render import gpu, render
from posttrain.render.trainer_config import CONFIG_ANNOTATION

GOLDEN = Path(__file__).parent.parent / "golden" / "jobs"
XPK = json.loads((Path(__file__).parent / "data" / "xpk-1.16.0-gpu-decorators.json").read_text())
STACK_JOBS = {"tcpx": "h100-2-nodes", "tcpxo": "h100-mega-4-nodes", "rdma": "h200-2-nodes"}


def pod_template(name: str, **resources) -> dict:
    job = load_job(GOLDEN / f"{name}.yaml")
    for k, v in resources.items():
        setattr(job.spec.resources, k, v)
    jobset = render(job)[-1]
    return jobset["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]


def trainer_of(spec: dict) -> dict:
    (c,) = [c for c in spec["containers"] if c["name"] == "trainer"]
    return c


def mounts(container: dict, spec: dict) -> dict[str, str]:
    """container path -> host path (or the emptyDir) of each mount from the node."""
    source = {}
    for v in spec["volumes"]:
        if "hostPath" in v:
            source[v["name"]] = v["hostPath"]["path"]
        elif "emptyDir" in v:
            source[v["name"]] = "emptyDir:" + json.dumps(v["emptyDir"])
    return {
        m["mountPath"]: source[m["name"]] for m in container["volumeMounts"] if m["name"] in source
    }


def provides(ours: dict[str, str], path: str, host: str) -> bool:
    """A mount of ours gives `host` at `path` (itself, or a parent directory of both)."""
    for p, h in ours.items():
        if path == p and host == h:
            return True
        if path.startswith(p + "/") and host == h + path[len(p) :]:
            return True
    return False


def test_every_catalog_gpu_has_a_networking_entry():
    assert set(GPU_TYPES) <= set(gpu.GPUDIRECT)
    machine_types = {s.machine_type for s in gpu.GPUDIRECT.values() if s}
    assert machine_types == {
        "a3-highgpu-8g",
        "a3-megagpu-8g",
        "a3-ultragpu-8g",
        "a4-highgpu-8g",
        "a4x-highgpu-4g",
    }


@pytest.mark.parametrize(
    "accelerator, nodes, gpus, stack",
    [
        ("nvidia-h100-80gb", 2, 8, "tcpx"),
        ("nvidia-h100-mega-80gb", 4, None, "tcpxo"),
        ("nvidia-h200-141gb", 2, None, "rdma"),
        ("nvidia-b200", 16, None, "rdma"),
        ("nvidia-gb200", 2, None, "rdma"),  # A4X: 4 GPUs are the whole machine
        ("nvidia-h100-80gb", 1, None, None),  # one node: no cross-node collectives
        ("nvidia-h100-80gb", 2, 4, None),  # not the whole 8-GPU machine
        ("nvidia-l4", 2, None, None),  # g2: no GPU NICs
        ("nvidia-a100-80gb", 4, None, None),
    ],
)
def test_which_jobs_get_gpudirect(accelerator, nodes, gpus, stack):
    got = gpu.gpudirect(resolve(accelerator, gpus_per_node=gpus), nodes)
    assert (got.name if got else None) == stack


@pytest.mark.parametrize("name", ["h100-2-nodes", "h100-mega-4-nodes", "h200-2-nodes"])
def test_every_gpu_pod_gets_driver_libraries_shm_and_cuda(name):
    for nodes in (1, 2):
        spec = pod_template(name, nodes=nodes)["spec"]
        c = trainer_of(spec)
        env = {e["name"]: e.get("value") for e in c["env"]}
        assert env["JAX_PLATFORMS"] == "cuda"  # no silent CPU fallback on a broken node
        assert env["LD_LIBRARY_PATH"] == "/usr/local/nvidia/lib64"
        got = mounts(c, spec)
        assert got["/usr/local/nvidia"] == "/home/kubernetes/bin/nvidia"
        assert got["/dev/shm"] == 'emptyDir:{"medium": "Memory"}'
        names = [v["name"] for v in spec["volumes"]]
        assert len(names) == len(set(names))
        for container in spec["containers"] + spec.get("initContainers", []):
            assert {m["name"] for m in container.get("volumeMounts", [])} <= set(names)


def test_single_node_gpu_pod_has_no_gpudirect():
    template = pod_template("h100-2-nodes", nodes=1)
    assert list(template["metadata"]["annotations"]) == [CONFIG_ANNOTATION]
    assert "initContainers" not in template["spec"]
    assert not any(e["name"].startswith("NCCL_") for e in trainer_of(template["spec"])["env"])


@pytest.mark.parametrize("stack", sorted(STACK_JOBS))
def test_gpudirect_matches_xpk(stack):
    """Everything xpk's decorator adds is there; where posttrain differs, it is one of
    the differences docs/gpu.md gives a reason for."""
    xpk = XPK[stack]
    template = pod_template(STACK_JOBS[stack])
    spec = template["spec"]
    annotations = dict(template["metadata"]["annotations"])
    del annotations[CONFIG_ANNOTATION]  # the trainer's config (test_render.py)
    annotations["networking.gke.io/interfaces"] = json.loads(
        annotations["networking.gke.io/interfaces"]
    )
    assert annotations == xpk["annotations"]
    for toleration in xpk["tolerations"]:
        assert toleration in spec["tolerations"]
    trainer = trainer_of(spec)
    env = {e["name"]: e.get("value") for e in trainer["env"]}
    assert xpk["trainer_env"].items() <= env.items()
    ours = mounts(trainer, spec)
    for path, host in xpk["trainer_mounts"].items():
        if path == "/dev/shm":  # no fixed sizeLimit: the pod's memory bounds it
            assert ours[path] == 'emptyDir:{"medium": "Memory"}'
        else:
            assert provides(ours, path, host), (path, host, ours)
    sidecars = {c["name"]: c for c in spec.get("initContainers", [])}
    assert set(sidecars) == {s["name"] for s in xpk["sidecars"]}
    for want in xpk["sidecars"]:
        got = sidecars[want["name"]]
        # The daemon version GKE's own manifests run (xpk pins an older one).
        assert got["image"].rsplit(":", 1)[0] == want["image"].rsplit(":", 1)[0]
        for key in ("command", "args", "securityContext", "restartPolicy"):
            assert got.get(key) == want[key], key
        got_mounts = mounts(got, spec)
        for path, host in want["mounts"].items():
            assert provides(got_mounts, path, host), (path, host, got_mounts)
        assert f"devices.gke.io/container.{got['name']}" in annotations


@pytest.mark.parametrize(
    "stack, script",
    [
        ("tcpx", None),
        ("tcpxo", "/usr/local/nvidia/lib64/nccl-env-profile.sh"),
        ("rdma", "/usr/local/gib/scripts/set_nccl_env.sh"),
    ],
)
def test_nccl_settings(stack, script):
    """NCCL's settings for the machine's plugin: TCPX's from GKE's guide in the pod, the
    others from the script the plugin installer puts on the node (the trainer's
    entrypoint sources it; docker/entrypoint.sh)."""
    env = {
        e["name"]: e.get("value")
        for e in trainer_of(pod_template(STACK_JOBS[stack])["spec"])["env"]
    }
    assert env.get("POSTTRAIN_NCCL_ENV_SCRIPT") == script
    if stack == "tcpx":
        assert env["NCCL_GPUDIRECTTCPX_SOCKET_IFNAME"] == "eth1,eth2,eth3,eth4"
        assert env["NCCL_GPUDIRECTTCPX_CTRL_DEV"] == env["NCCL_SOCKET_IFNAME"] == "eth0"


def test_gb200_rdma_nics_and_arm_hosts():
    template = pod_template("h200-2-nodes", accelerator="nvidia-gb200")
    interfaces = json.loads(template["metadata"]["annotations"]["networking.gke.io/interfaces"])
    assert [i["network"] for i in interfaces] == ["default", "gvnic-1"] + [
        f"rdma-{i}" for i in range(4)
    ]
    assert gpu.ARM_TOLERATION in template["spec"]["tolerations"]
    single = pod_template("h200-2-nodes", accelerator="nvidia-gb200", nodes=1)
    assert gpu.ARM_TOLERATION in single["spec"]["tolerations"]
    assert gpu.ARM_TOLERATION not in pod_template("h200-2-nodes")["spec"]["tolerations"]
