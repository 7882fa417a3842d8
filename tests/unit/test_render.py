"""The renderer: golden files for a matrix of jobs, plus the properties that matter.

Regenerate the golden files after an intended change with
`UPDATE_GOLDEN=1 pytest tests/unit/test_render.py` and review the diff.
"""

import json
import os
from pathlib import Path

import pytest
import yaml

from posttrain.api.validate import load_job
from posttrain.render import RenderConfig, render
from posttrain.yaml_out import dump_yaml

GOLDEN = Path(__file__).parent.parent / "golden"
JOBS = sorted((GOLDEN / "jobs").glob("*.yaml"))


def rendered(name: str) -> dict[str, dict]:
    objs = render(load_job(GOLDEN / "jobs" / f"{name}.yaml"))
    return {o["kind"]: o for o in objs}


@pytest.mark.parametrize("path", JOBS, ids=lambda p: p.stem)
def test_golden(path):
    out = dump_yaml(render(load_job(path)))
    golden = GOLDEN / "rendered" / path.name
    if os.environ.get("UPDATE_GOLDEN"):
        golden.write_text(out)
    assert golden.exists(), f"missing {golden}; run with UPDATE_GOLDEN=1"
    assert out == golden.read_text(), f"{golden} differs; rerun with UPDATE_GOLDEN=1 and review"


def test_matrix_covers_required_modes():
    names = {p.stem for p in JOBS}
    assert {"v6e-256-pathways-2-slices", "v5p-128", "v5e-8", "h100-2-nodes", "cpu"} <= names


def _rjobs(jobset):
    return {r["name"]: r for r in jobset["spec"]["replicatedJobs"]}


def _pod(rjob):
    return rjob["template"]["spec"]["template"]["spec"]


def _env(container):
    return {e["name"]: e for e in container.get("env", [])}


def test_pathways_two_slices():
    js = rendered("v6e-256-pathways-2-slices")["JobSet"]
    rjobs = _rjobs(js)
    assert list(rjobs) == ["pathways-head", "worker"]
    head, worker = rjobs["pathways-head"], rjobs["worker"]
    assert head["replicas"] == 1 and head["template"]["spec"]["parallelism"] == 1
    assert worker["replicas"] == 2 and worker["template"]["spec"]["parallelism"] == 64
    sidecars = {c["name"]: c for c in _pod(head)["initContainers"]}
    assert set(sidecars) == {"pathways-rm", "pathways-proxy"}
    assert all(c["restartPolicy"] == "Always" for c in sidecars.values())
    head_host = "qwen3-pw-2x256-pathways-head-0-0.qwen3-pw-2x256"
    assert "--instance_type=tpuv6e:16x16" in sidecars["pathways-rm"]["args"]
    assert "--instance_count=2" in sidecars["pathways-rm"]["args"]
    assert f"--resource_manager_address={head_host}:29001" in sidecars["pathways-proxy"]["args"]
    env = _env(_pod(head)["containers"][0])
    assert env["JAX_PLATFORMS"]["value"] == "proxy"
    assert env["JAX_BACKEND_TARGET"]["value"] == f"grpc://{head_host}:29000"
    assert "resources" not in _pod(head)["containers"][0]  # the head holds no TPU
    wpod = _pod(worker)
    wc = wpod["containers"][0]
    assert wc["resources"]["limits"] == {"google.com/tpu": 4}
    assert _env(wc)["MEGASCALE_NUM_SLICES"]["value"] == "2"
    assert wpod["nodeSelector"]["cloud.google.com/gke-tpu-topology"] == "16x16"
    assert js["spec"]["successPolicy"] == {
        "operator": "All",
        "targetReplicatedJobs": ["pathways-head"],
    }
    assert js["spec"]["coordinator"]["replicatedJob"] == "pathways-head"
    assert js["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == "tpu-v6e"
    assert js["metadata"]["labels"]["kueue.x-k8s.io/priority-class"] == "high"


def test_tpu_multihost_one_process_per_host():
    js = rendered("v5p-128")["JobSet"]
    (rjob,) = js["spec"]["replicatedJobs"]
    assert rjob["name"] == "slice" and rjob["replicas"] == 1
    assert rjob["template"]["spec"]["parallelism"] == rjob["template"]["spec"]["completions"] == 16
    pod = _pod(rjob)
    env = _env(pod["containers"][0])
    assert env["JAX_NUM_PROCESSES"]["value"] == "16"
    assert env["JAX_COORDINATOR_ADDRESS"]["value"] == "llama-v5p-128-slice-0-0.llama-v5p-128:8476"
    assert "MEGASCALE_NUM_SLICES" not in env
    assert pod["tolerations"] == [
        {"key": "google.com/tpu", "operator": "Exists", "effect": "NoSchedule"}
    ]
    assert js["metadata"]["annotations"] == {
        "alpha.jobset.sigs.k8s.io/exclusive-topology": "cloud.google.com/gke-nodepool"
    }
    assert js["spec"]["ttlSecondsAfterFinished"] == 3600


def test_multislice_megascale_env():
    js = rendered("v6e-16-multislice")["JobSet"]
    (rjob,) = js["spec"]["replicatedJobs"]
    assert rjob["replicas"] == 2
    env = _env(_pod(rjob)["containers"][0])
    assert env["JAX_NUM_PROCESSES"]["value"] == "8"
    assert env["MEGASCALE_NUM_SLICES"]["value"] == "2"
    assert (
        "jobset.sigs.k8s.io/job-index"
        in env["MEGASCALE_SLICE_ID"]["valueFrom"]["fieldRef"]["fieldPath"]
    )


def test_gpu_nodes():
    objs = rendered("h100-2-nodes")
    js = objs["JobSet"]
    (rjob,) = js["spec"]["replicatedJobs"]
    assert rjob["template"]["spec"]["parallelism"] == 2
    pod = _pod(rjob)
    c = pod["containers"][0]
    assert c["resources"] == {
        "requests": {"cpu": "32", "memory": "400Gi"},
        "limits": {"nvidia.com/gpu": 8},
    }
    assert pod["nodeSelector"] == {"cloud.google.com/gke-accelerator": "nvidia-h100-80gb"}
    assert pod["priorityClassName"] == "batch-high"
    assert {"name": "output", "persistentVolumeClaim": {"claimName": "training-outputs"}} in pod[
        "volumes"
    ]
    assert js["spec"]["suspend"] is True
    assert "annotations" not in js["metadata"]


def test_failure_policy_separates_user_errors_and_preemption():
    js = rendered("cpu")["JobSet"]
    policy = js["spec"]["failurePolicy"]
    assert policy["maxRestarts"] == 3
    actions = {r["name"]: r["action"] for r in policy["rules"]}
    assert actions == {"UserError": "FailJobSet", "Preemption": "RestartJobSetAndIgnoreMaxRestarts"}
    pfp = js["spec"]["replicatedJobs"][0]["template"]["spec"]["podFailurePolicy"]["rules"]
    assert pfp[0]["onExitCodes"]["values"] == [65]
    assert pfp[1]["onPodConditions"] == [{"type": "DisruptionTarget"}]
    assert _pod(js["spec"]["replicatedJobs"][0])["restartPolicy"] == "Never"


def test_secret_only_by_reference():
    objs = rendered("v6e-256-pathways-2-slices")
    env = _env(_pod(_rjobs(objs["JobSet"])["pathways-head"])["containers"][0])
    assert env["HF_TOKEN"] == {
        "name": "HF_TOKEN",
        "valueFrom": {"secretKeyRef": {"name": "hf-token", "key": "token"}},
    }
    config = json.loads(objs["ConfigMap"]["data"]["job.json"])
    assert config["spec"]["hfTokenSecret"] == {"name": "hf-token", "key": "token"}


def test_owner_references_and_trainer_role():
    objs = rendered("cpu")
    for obj in objs.values():
        (ref,) = obj["metadata"]["ownerReferences"]
        assert ref["kind"] == "PostTrainJob" and ref["controller"] is True
        assert ref["uid"] == "00000000-0000-0000-0000-000000000006"
    (rule,) = objs["Role"]["rules"]
    assert rule == {
        "apiGroups": ["posttrain.dev"],
        "resources": ["posttrainjobs/status"],
        "resourceNames": ["smollm2-cpu"],
        "verbs": ["get", "patch"],
    }
    pod = _pod(objs["JobSet"]["spec"]["replicatedJobs"][0])
    assert pod["serviceAccountName"] == objs["ServiceAccount"]["metadata"]["name"]


def test_config_map_round_trips_the_spec():
    job = load_job(GOLDEN / "jobs" / "v5p-128.yaml")
    cm = {o["kind"]: o for o in render(job)}["ConfigMap"]
    config = json.loads(cm["data"]["job.json"])
    assert config["spec"] == job.spec.to_wire()
    assert config["metadata"]["name"] == "llama-v5p-128"


def test_user_strings_cannot_inject_yaml():
    job = load_job(GOLDEN / "jobs" / "cpu.yaml")
    job.spec.model.source = "/m\nkind: Secret\n---\napiVersion: v1"
    out = dump_yaml(render(job))
    docs = list(yaml.safe_load_all(out))
    assert [d["kind"] for d in docs] == [
        "ServiceAccount",
        "Role",
        "RoleBinding",
        "ConfigMap",
        "JobSet",
    ]


def test_image_defaults_and_override():
    job = load_job(GOLDEN / "jobs" / "cpu.yaml")
    js = render(job, RenderConfig(trainer_image="example.com/t:1"))[-1]
    assert _pod(js["spec"]["replicatedJobs"][0])["containers"][0]["image"] == "example.com/t:1"
    job.spec.image = "example.com/mine:2"
    js = render(job, RenderConfig(trainer_image="example.com/t:1"))[-1]
    assert _pod(js["spec"]["replicatedJobs"][0])["containers"][0]["image"] == "example.com/mine:2"


def test_scheduling_patch():
    from posttrain.render.jobset import scheduling_patch

    assert scheduling_patch({"suspend": False}, {"suspend": False, "queue": "q"}) == {}
    assert scheduling_patch({"suspend": False}, {"suspend": True}) == {"spec": {"suspend": True}}
    assert scheduling_patch({}, {"ttlSecondsAfterFinished": 60, "priorityClass": "high"}) == {
        "spec": {"ttlSecondsAfterFinished": 60},
        "metadata": {"labels": {"kueue.x-k8s.io/priority-class": "high"}},
    }
    # Removing a label or ttl sends null, which a merge patch deletes.
    assert scheduling_patch({"priorityClass": "high"}, {}) == {
        "metadata": {"labels": {"kueue.x-k8s.io/priority-class": None}}
    }
