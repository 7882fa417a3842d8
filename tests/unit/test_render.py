"""The renderer: golden files for a matrix of jobs, plus the properties that matter.

Regenerate the golden files after an intended change with
`UPDATE_GOLDEN=1 pytest tests/unit/test_render.py` and review the diff.
"""

import json
import os
from pathlib import Path

import pytest
import yaml

from posttrain.checks import load_job
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
    assert "v6e-8-single-host" in names


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
    hpod = _pod(head)
    sidecars = {c["name"]: c for c in hpod["initContainers"]}
    assert set(sidecars) == {"pathways-rm", "pathways-proxy"}
    assert all(c["restartPolicy"] == "Always" for c in sidecars.values())
    images = "us-docker.pkg.dev/cloud-tpu-v2-images/pathways/"
    assert sidecars["pathways-rm"]["image"] == images + "server:latest"
    assert sidecars["pathways-proxy"]["image"] == images + "proxy_server:latest"
    assert _pod(worker)["containers"][0]["image"] == images + "server:latest"
    head_host = "qwen3-pw-2x256-pathways-head-0-0.qwen3-pw-2x256"
    rm = sidecars["pathways-rm"]
    assert "--instance_type=tpuv6e:16x16" in rm["args"]
    assert "--instance_count=2" in rm["args"]
    assert f"--resource_manager_address={head_host}:29001" in sidecars["pathways-proxy"]["args"]
    assert _env(rm)["TPU_SKIP_MDS_QUERY"]["value"] == "true"
    assert {"HOST_ADDRESS", "JOBSET_NAME", "REPLICATED_JOB_NAME"} <= set(_env(rm))
    assert [p["containerPort"] for p in rm["ports"]] == [29001, 29002]
    # xpk's limits; the head asks for no TPU.
    assert rm["resources"]["limits"] == {"cpu": "8", "memory": "32G"}
    assert sidecars["pathways-proxy"]["resources"]["limits"] == {"cpu": "16", "memory": "100G"}
    trainer = hpod["containers"][0]
    assert trainer["resources"]["limits"] == {"cpu": "24", "memory": "100G"}
    env = _env(trainer)
    assert env["JAX_PLATFORMS"]["value"] == "proxy"
    assert env["JAX_BACKEND_TARGET"]["value"] == f"grpc://{head_host}:29000"
    # The head: a CPU node pool (operator setting), exclusive per node, not per pool.
    assert hpod["nodeSelector"] == {"cloud.google.com/gke-nodepool": "cpu-np"}
    assert hpod["hostNetwork"] is True and hpod["dnsPolicy"] == "ClusterFirstWithHostNet"
    assert hpod["priorityClassName"] == "high"
    exclusive = "alpha.jobset.sigs.k8s.io/exclusive-topology"
    assert head["template"]["metadata"]["annotations"] == {exclusive: "kubernetes.io/hostname"}
    assert worker["template"]["metadata"]["annotations"] == {
        exclusive: "cloud.google.com/gke-nodepool"
    }
    assert "annotations" not in js["metadata"]  # no JobSet-wide lock of the CPU pool
    wpod = _pod(worker)
    wc = wpod["containers"][0]
    assert wc["resources"]["limits"] == {"google.com/tpu": 4}
    assert _env(wc)["MEGASCALE_NUM_SLICES"]["value"] == "2"
    assert [p["containerPort"] for p in wc["ports"]] == [29005, 29006, 8471, 8080]
    assert wpod["nodeSelector"]["cloud.google.com/gke-tpu-topology"] == "16x16"
    assert wpod["priorityClassName"] == "high"
    # Workers restart in place as xpk's do; OnFailure forbids a podFailurePolicy.
    assert wpod["restartPolicy"] == "OnFailure"
    assert "podFailurePolicy" not in worker["template"]["spec"]
    assert worker["template"]["spec"]["backoffLimit"] == 64 * 4
    assert head["template"]["spec"]["podFailurePolicy"]["rules"]
    assert js["spec"]["startupPolicy"] == {"startupPolicyOrder": "InOrder"}
    assert js["spec"]["successPolicy"] == {
        "operator": "All",
        "targetReplicatedJobs": ["pathways-head"],
    }
    assert js["spec"]["coordinator"]["replicatedJob"] == "pathways-head"
    assert js["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == "tpu-v6e"
    assert "kueue.x-k8s.io/priority-class" not in js["metadata"]["labels"]


def test_pathways_head_node_pool_operator_setting_and_job_override():
    job = load_job(GOLDEN / "jobs" / "v6e-256-pathways-2-slices.yaml")

    def head_selector(config):
        return _pod(_rjobs(render(job, config)[-1])["pathways-head"])["nodeSelector"]

    config = RenderConfig(pathways_head_node_pool="pathways-cpu")
    assert head_selector(config) == {"cloud.google.com/gke-nodepool": "pathways-cpu"}
    job.spec.resources.pathways.head_node_pool = "big-cpu"
    assert head_selector(config) == {"cloud.google.com/gke-nodepool": "big-cpu"}


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
    # As GKE runs TPU hosts: the node's network, a memory /dev/shm, the machine type.
    assert pod["hostNetwork"] is True and pod["dnsPolicy"] == "ClusterFirstWithHostNet"
    assert {"name": "dshm", "emptyDir": {"medium": "Memory"}} in pod["volumes"]
    assert {"name": "dshm", "mountPath": "/dev/shm"} in pod["containers"][0]["volumeMounts"]
    assert "securityContext" not in pod["containers"][0]  # no privileged mode
    assert pod["nodeSelector"]["node.kubernetes.io/instance-type"] == "ct5p-hightpu-4t"
    assert js["metadata"]["annotations"] == {
        "alpha.jobset.sigs.k8s.io/exclusive-topology": "cloud.google.com/gke-nodepool"
    }
    assert js["spec"]["ttlSecondsAfterFinished"] == 3600


def test_single_host_8_chip_slice_without_host_network():
    """machineType picks the one-VM 2x4 slice; hostNetwork: false keeps pod networking;
    workloadPriorityClass is Kueue's label, priorityClass the pods' field."""
    objs = rendered("v6e-8-single-host")
    js = objs["JobSet"]
    (rjob,) = js["spec"]["replicatedJobs"]
    assert rjob["template"]["spec"]["parallelism"] == 1
    pod = _pod(rjob)
    assert pod["nodeSelector"] == {
        "cloud.google.com/gke-tpu-accelerator": "tpu-v6e-slice",
        "cloud.google.com/gke-tpu-topology": "2x4",
        "node.kubernetes.io/instance-type": "ct6e-standard-8t",
    }
    assert pod["containers"][0]["resources"]["limits"] == {"google.com/tpu": 8}
    assert "hostNetwork" not in pod and "dnsPolicy" not in pod
    assert {"name": "dshm", "mountPath": "/dev/shm"} in pod["containers"][0]["volumeMounts"]
    assert js["metadata"]["labels"]["kueue.x-k8s.io/priority-class"] == "research"
    assert "priorityClassName" not in pod


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


def _config(pod_template: dict) -> dict:
    """The trainer's config as its pod would read it: the annotation the config volume
    mounts (a downwardAPI file at CONFIG_FILE)."""
    from posttrain.render.jobset import CONFIG_FILE, CONFIG_MOUNT

    spec = pod_template["spec"]
    (trainer,) = [c for c in spec["containers"] if c["name"] == "trainer"]
    (mount,) = [m for m in trainer["volumeMounts"] if m["mountPath"] == CONFIG_MOUNT]
    (volume,) = [v for v in spec["volumes"] if v["name"] == mount["name"]]
    (item,) = volume["downwardAPI"]["items"]
    assert f"{CONFIG_MOUNT}/{item['path']}" == CONFIG_FILE
    assert trainer["command"] == ["posttrain", "train", "--config", CONFIG_FILE]
    field = item["fieldRef"]["fieldPath"]
    key = field.removeprefix("metadata.annotations['").removesuffix("']")
    return json.loads(pod_template["metadata"]["annotations"][key])


def test_secret_only_by_reference():
    objs = rendered("v6e-256-pathways-2-slices")
    head = _rjobs(objs["JobSet"])["pathways-head"]
    env = _env(_pod(head)["containers"][0])
    assert env["HF_TOKEN"] == {
        "name": "HF_TOKEN",
        "valueFrom": {"secretKeyRef": {"name": "hf-token", "key": "token"}},
    }
    config = _config(head["template"]["spec"]["template"])
    assert config["spec"]["hfTokenSecret"] == {"name": "hf-token", "key": "token"}


def test_only_the_jobset_is_per_job_and_owned():
    objs = render(load_job(GOLDEN / "jobs" / "cpu.yaml"))
    assert [o["kind"] for o in objs] == ["JobSet"]
    (ref,) = objs[0]["metadata"]["ownerReferences"]
    assert ref["kind"] == "PostTrainJob" and ref["controller"] is True
    assert ref["uid"] == "00000000-0000-0000-0000-000000000006"


@pytest.mark.parametrize("name", [p.stem for p in JOBS])
def test_trainer_pods_run_as_the_namespace_trainer_and_read_the_job(name):
    """Every trainer pod: the namespace's trainer ServiceAccount, its replicated job one the
    status policy knows, the job's config mounted from its own annotation. Pathways
    workers run no trainer: neither."""
    from posttrain.render.names import TRAINER_REPLICATED_JOBS, TRAINER_SERVICE_ACCOUNT

    job = load_job(GOLDEN / "jobs" / f"{name}.yaml")
    for rjob in render(job)[-1]["spec"]["replicatedJobs"]:
        template = rjob["template"]["spec"]["template"]
        names = [c["name"] for c in template["spec"]["containers"]]
        if "trainer" not in names:
            assert "serviceAccountName" not in template["spec"], rjob["name"]
            assert "annotations" not in template["metadata"], rjob["name"]
            continue
        assert rjob["name"] in TRAINER_REPLICATED_JOBS
        assert template["spec"]["serviceAccountName"] == TRAINER_SERVICE_ACCOUNT
        config = _config(template)
        assert config["spec"] == job.spec.to_wire()
        assert config["metadata"] == {
            "name": job.metadata.name,
            "namespace": job.metadata.namespace,
            "uid": job.metadata.uid,
        }


def test_trainer_access_binds_the_cluster_role_to_the_namespace_trainer():
    from posttrain.render.objects import trainer_access

    sa, binding = trainer_access("team-a", "posttrain-trainer")
    assert (sa["kind"], sa["metadata"]["name"], sa["metadata"]["namespace"]) == (
        "ServiceAccount",
        "posttrain-trainer",
        "team-a",
    )
    assert "ownerReferences" not in sa["metadata"]  # shared by the namespace's jobs
    assert binding["roleRef"] == {
        "apiGroup": "rbac.authorization.k8s.io",
        "kind": "ClusterRole",
        "name": "posttrain-trainer",
    }
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": "posttrain-trainer", "namespace": "team-a"}
    ]


def _binding(role="posttrain-trainer", kind="ClusterRole", subjects=None):
    return {
        "kind": "RoleBinding",
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": kind, "name": role},
        "subjects": subjects
        if subjects is not None
        else [{"kind": "ServiceAccount", "name": "posttrain-trainer", "namespace": "team-a"}],
    }


@pytest.mark.parametrize(
    "kind, existing, usable",
    [
        (
            "ServiceAccount",
            {"kind": "ServiceAccount", "metadata": {"annotations": {"a": "b"}}},
            True,
        ),
        ("RoleBinding", _binding(), True),
        (
            "RoleBinding",
            _binding(
                subjects=[
                    {"kind": "User", "name": "alice"},
                    {"kind": "ServiceAccount", "name": "posttrain-trainer", "namespace": "team-a"},
                ]
            ),
            True,
        ),
        ("RoleBinding", _binding(role="admin"), False),
        ("RoleBinding", _binding(kind="Role"), False),
        ("RoleBinding", _binding(subjects=[]), False),
        (
            "RoleBinding",
            _binding(
                subjects=[{"kind": "ServiceAccount", "name": "posttrain-trainer", "namespace": "b"}]
            ),
            False,
        ),
    ],
)
def test_existing_trainer_access_is_used_only_when_it_serves(kind, existing, usable):
    from posttrain.render.objects import access_problem, trainer_access

    (wanted,) = [o for o in trainer_access("team-a", "posttrain-trainer") if o["kind"] == kind]
    problem = access_problem(existing, wanted)
    assert (problem is None) == usable, problem
    if problem:
        assert "RoleBinding posttrain-trainer" in problem and "delete it" in problem


def test_config_too_large_for_an_annotation_is_refused_naming_the_limit(monkeypatch):
    """The check guards the boundary (tried here with a lower limit) as the job will be in
    a cluster, with the namespace and UID it carries there (at most 63 and 36 characters),
    refusing with the sizes and naming the largest field."""
    from posttrain.checks import validate
    from posttrain.render import trainer_config

    doc = yaml.safe_load((GOLDEN / "jobs" / "cpu.yaml").read_text())
    job, errors = validate(doc)
    assert job is not None and not errors
    size = len(trainer_config.CONFIG_ANNOTATION) + len(trainer_config.config_text(job))
    # Read from a file without them, the job is counted with the longest a cluster gives.
    namespace, uid = doc["metadata"].pop("namespace"), doc["metadata"].pop("uid")
    size += 63 - len(namespace) + 36 - len(uid)
    monkeypatch.setattr(trainer_config, "CONFIG_MAX_BYTES", size)
    assert validate(doc)[1] == []
    monkeypatch.setattr(trainer_config, "CONFIG_MAX_BYTES", size - 1)
    (error,) = validate(doc)[1]
    largest = max(job.spec.to_wire().items(), key=lambda kv: len(json.dumps(kv[1])))
    assert error.field.startswith(f"spec.{largest[0]}")
    assert (
        f"config is {size} bytes as JSON" in error.message
        and f"over the {size - 1}" in error.message
    )
    assert "'posttrain.dev/config'" in error.message


def test_user_strings_cannot_inject_yaml():
    job = load_job(GOLDEN / "jobs" / "cpu.yaml")
    job.spec.model.source = "/m\nkind: Secret\n---\napiVersion: v1"
    out = dump_yaml(render(job))
    docs = list(yaml.safe_load_all(out))
    assert [d["kind"] for d in docs] == ["JobSet"]


@pytest.mark.parametrize("name, kind", [("cpu", "cpu"), ("v5e-8", "tpu"), ("h100-2-nodes", "gpu")])
def test_image_by_accelerator_kind_and_override(name, kind):
    """The operator's image for the job's accelerator kind, unless spec.image names one;
    the trainer sees it (its device check names it) and JAX_PLATFORMS of that kind."""
    config = RenderConfig(
        trainer_image_cpu="example.com/t:1",
        trainer_image_tpu="example.com/t:1-tpu",
        trainer_image_gpu="example.com/t:1-cuda12",
    )
    job = load_job(GOLDEN / "jobs" / f"{name}.yaml")

    def trainer(job):
        pod = _pod(render(job, config)[-1]["spec"]["replicatedJobs"][0])
        (c,) = [c for c in pod["containers"] if c["name"] == "trainer"]
        return c

    c = trainer(job)
    assert c["image"] == config.trainer_image(kind)
    assert _env(c)["POSTTRAIN_IMAGE"]["value"] == c["image"]
    platforms = {"cpu": "cpu", "tpu": "tpu", "gpu": "cuda"}
    assert _env(c)["JAX_PLATFORMS"]["value"] == platforms[kind]
    job.spec.image = "example.com/mine:2"
    c = trainer(job)
    assert c["image"] == _env(c)["POSTTRAIN_IMAGE"]["value"] == "example.com/mine:2"


def test_scheduling_patch():
    from posttrain.render.jobset import scheduling_patch

    assert scheduling_patch({"suspend": False}, {"suspend": False, "queue": "q"}) == {}
    assert scheduling_patch({"suspend": False}, {"suspend": True}) == {"spec": {"suspend": True}}
    new = {"ttlSecondsAfterFinished": 60, "workloadPriorityClass": "high"}
    assert scheduling_patch({}, new) == {
        "spec": {"ttlSecondsAfterFinished": 60},
        "metadata": {"labels": {"kueue.x-k8s.io/priority-class": "high"}},
    }
    # Removing a label or ttl sends null, which a merge patch deletes.
    assert scheduling_patch({"workloadPriorityClass": "high"}, {}) == {
        "metadata": {"labels": {"kueue.x-k8s.io/priority-class": None}}
    }
    # The pods' PriorityClass is immutable (the admission policy refuses a change); nothing to patch.
    assert scheduling_patch({"priorityClass": "a"}, {"priorityClass": "b"}) == {}
