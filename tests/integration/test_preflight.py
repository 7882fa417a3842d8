"""The operator asks the TPU compiler before a TPU job takes TPUs (spec.preflight), on a
real API server with the operator as a real process.

This tier has no Job controller and no kubelet, so the test stands in for both with
`run_preflight_pod`: it makes the preflight Job's pod as the Job controller names and
owns it, runs its container's command for real here (`posttrain estimate --compile`,
the TPU compiler from libtpu on this CPU machine; the job's config from the pod's own
annotation, as its downwardAPI volume mounts it), and writes what the container wrote
to its termination message into the pod's status, as a kubelet does. Tiny models on a
v5e-1 keep each compile to seconds.
"""

from __future__ import annotations

import importlib.util
import json
import os
import random
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from invalid_jobs import valid_job
from operator_process import OperatorProcess

from posttrain.render.jobset import CONFIG_MOUNT
from posttrain.render.preflight import PREFLIGHT_LABEL, TERMINATION_MESSAGE_PATH
from posttrain.render.trainer_config import CONFIG_ANNOTATION, CONFIG_FILE_NAME
from tests.cluster import Cluster, condition, wait_for

pytestmark = [
    pytest.mark.integration,
    pytest.mark.skipif(
        importlib.util.find_spec("libtpu") is None,
        reason="libtpu is not installed (pip install 'posttrain[tpu-compile]'): no TPU compiler",
    ),
]
GROUP, VERSION, PLURAL = "posttrain.dev", "v1alpha1", "posttrainjobs"
# A Qwen 3 of two small layers with a large vocabulary: at 8192 tokens x 16 rows its
# logits alone are over a v5e chip's HBM; at 128 x 1 it needs a few MiB.
QWEN3 = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "hidden_act": "silu",
         "hidden_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
         "num_key_value_heads": 2, "head_dim": 32, "intermediate_size": 256,
         "vocab_size": 32768, "rms_norm_eps": 1e-6, "rope_theta": 1e6,
         "tie_word_embeddings": True, "max_position_embeddings": 40960}  # fmt: skip


@pytest.fixture
def model(tmp_path: Path) -> Path:
    root = tmp_path / "qwen3-tiny"
    root.mkdir()
    (root / "config.json").write_text(json.dumps(QWEN3))
    return root


@pytest.fixture
def operator(apiserver: Cluster, namespace: str, tmp_path: Path):
    """The operator with the chart's default: TPU jobs are compiled first."""
    op = OperatorProcess(apiserver.kubeconfig, tmp_path, namespace, "-n", namespace)
    op.env["POSTTRAIN_PREFLIGHT_COMPILE"] = "true"
    op.start()
    yield op
    op.stop()


def tpu_job(name: str, model: Path, *, seq: int, batch: int, remat: str, **spec: Any) -> dict:
    doc = valid_job(name)
    doc["spec"].update(
        {
            "model": {"source": str(model), "dtype": "bfloat16"},
            "data": {"source": "/data/train.jsonl", "maxLength": seq},
            "training": {"batchSize": batch, "remat": remat, "steps": 10},
            "resources": {"accelerator": "v5e-1"},
            **spec,
        }
    )
    return doc


def create(apiserver: Cluster, namespace: str, doc: dict) -> dict:
    return apiserver.custom.create_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, doc)


def get_job(apiserver: Cluster, namespace: str, name: str) -> dict:
    return apiserver.custom.get_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, name)


def preflight_jobs(apiserver: Cluster, namespace: str, job: str) -> list[dict]:
    found = apiserver.kubectl(
        "get", "jobs.batch", "-n", namespace, "-o", "json",
        "-l", f"{PREFLIGHT_LABEL},posttrain.dev/job-name={job}",
    )  # fmt: skip
    return json.loads(found.stdout)["items"]


def jobset_names(apiserver: Cluster, namespace: str) -> list[str]:
    items = apiserver.custom.list_namespaced_custom_object(
        "jobset.x-k8s.io", "v1alpha2", namespace, "jobsets"
    )["items"]
    return [js["metadata"]["name"] for js in items]


def events(apiserver: Cluster, namespace: str, name: str) -> list[tuple[str, str, str]]:
    items = apiserver.core.list_namespaced_event(
        namespace, field_selector=f"involvedObject.name={name}"
    ).items
    return [(e.type, e.reason, e.message) for e in items]


def make_pod(apiserver: Cluster, job: dict) -> dict:
    """The preflight Job's pod, named, labelled and owned as the Job controller makes it."""
    meta, template = job["metadata"], job["spec"]["template"]
    suffix = "".join(random.choices("bcdfghjklmnpqrstvwxz2456789", k=5))
    labels = {**template["metadata"]["labels"], "batch.kubernetes.io/job-name": meta["name"],
              "batch.kubernetes.io/controller-uid": meta["uid"]}  # fmt: skip
    pod = {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": f"{meta['name']}-{suffix}",
            "namespace": meta["namespace"],
            "labels": labels,
            "annotations": template["metadata"].get("annotations") or {},
            "ownerReferences": [
                {
                    "apiVersion": "batch/v1",
                    "kind": "Job",
                    "name": meta["name"],
                    "uid": meta["uid"],
                    "controller": True,
                    "blockOwnerDeletion": True,
                }
            ],  # fmt: skip
        },
        "spec": template["spec"],
    }
    out = apiserver.kubectl("create", "-f", "-", "-o", "json", input=json.dumps(pod)).stdout
    return json.loads(out)


def write_pod_status(apiserver: Cluster, pod: dict, status: dict) -> None:
    apiserver.kubectl(
        "patch", "pod", pod["metadata"]["name"], "-n", pod["metadata"]["namespace"],
        "--subresource=status", "--type=merge", "-p", json.dumps({"status": status}),
    )  # fmt: skip


def run_preflight_pod(apiserver: Cluster, job: dict, workdir: Path) -> tuple[int, str]:
    """Run the preflight Job's one pod for real (see the module's docstring); its exit
    code and termination message."""
    pod = make_pod(apiserver, job)
    spec = pod["spec"]
    (container,) = spec["containers"]
    # The downwardAPI volume: the job's config from the pod's annotation.
    mount = workdir / "etc-posttrain"
    mount.mkdir(exist_ok=True)
    annotations = pod["metadata"]["annotations"]
    (mount / CONFIG_FILE_NAME).write_text(annotations[CONFIG_ANNOTATION])
    message_file = workdir / "termination-log"
    message_file.write_text("")
    assert container["terminationMessagePath"] == TERMINATION_MESSAGE_PATH

    def here(arg: str) -> str:
        if arg == TERMINATION_MESSAGE_PATH:
            return str(message_file)
        return arg.replace(CONFIG_MOUNT, str(mount), 1) if arg.startswith(CONFIG_MOUNT) else arg

    command = [*container["command"], *container.get("args", [])]
    assert command[0] == "posttrain"
    argv = [sys.executable, "-m", "posttrain.cli", *map(here, command[1:])]
    env = {**os.environ, **{e["name"]: e["value"] for e in container.get("env", [])}}
    write_pod_status(apiserver, pod, {"phase": "Running", "containerStatuses": [
        {"name": container["name"], "image": container["image"], "ready": True,
         "restartCount": 0, "imageID": "", "started": True,
         "state": {"running": {"startedAt": "2026-01-01T00:00:00Z"}}}]})  # fmt: skip
    proc = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=300)
    message = message_file.read_text()
    if not message and container.get("terminationMessagePolicy") == "FallbackToLogsOnError":
        message = (proc.stdout + proc.stderr)[-2048:] if proc.returncode else ""
    terminated = {"exitCode": proc.returncode, "message": message,
                  "reason": "Completed" if proc.returncode == 0 else "Error",
                  "startedAt": "2026-01-01T00:00:00Z", "finishedAt": "2026-01-01T00:01:00Z"}  # fmt: skip
    write_pod_status(apiserver, pod, {
        "phase": "Succeeded" if proc.returncode == 0 else "Failed",
        "containerStatuses": [{"name": container["name"], "image": container["image"],
                               "ready": False, "restartCount": 0, "imageID": "",
                               "started": False, "state": {"terminated": terminated}}],
    })  # fmt: skip
    return proc.returncode, message


def one_preflight_job(apiserver: Cluster, namespace: str, name: str) -> dict:
    return wait_for(
        lambda: (jobs := preflight_jobs(apiserver, namespace, name)) and jobs[0],
        timeout=60,
        what=f"the preflight Job of {name}",
        describe=lambda: apiserver.describe(namespace, "jobs,pods,events,posttrainjobs"),
    )


def test_a_job_that_does_not_fit_fails_with_the_compilers_figures(
    apiserver: Cluster, namespace: str, operator: OperatorProcess, model: Path, tmp_path: Path
):
    """The fast estimate refuses it too (43 GiB); with a preflight the compiler decides,
    and the job fails with its figure before any JobSet exists."""
    create(apiserver, namespace, tpu_job("big", model, seq=8192, batch=16, remat="none"))
    pf_job = one_preflight_job(apiserver, namespace, "big")
    # While it compiles: Pending, reason Preflight, no JobSet, condition Preflight Unknown.
    status = get_job(apiserver, namespace, "big")["status"]
    assert status["phase"] == "Pending" and status["preflight"]["result"] == "Compiling"
    assert condition(get_job(apiserver, namespace, "big"), "Running")["reason"] == "Preflight"
    assert condition(get_job(apiserver, namespace, "big"), "Preflight")["status"] == "Unknown"
    container = pf_job["spec"]["template"]["spec"]["containers"][0]
    assert "google.com/tpu" not in json.dumps(container["resources"])  # a CPU pod
    assert pf_job["metadata"]["ownerReferences"][0]["name"] == "big"

    code, message = run_preflight_pod(apiserver, pf_job, tmp_path)
    assert code == 1, message
    assert json.loads(message)["fits"] is False
    job = wait_for(
        lambda: (j := get_job(apiserver, namespace, "big"))["status"]["phase"] == "Failed" and j,
        timeout=60, what="the job to fail", describe=operator.logs,
    )  # fmt: skip
    status = job["status"]
    need = json.loads(message)["peakGiB"]
    assert need > 15.75
    assert status["message"].startswith("the job does not fit: the TPU compiler (libtpu ")
    assert f"{need:.2f} GiB per device" in status["message"]
    assert "15.75 GiB of HBM of each chip of v5e-1" in status["message"]
    assert condition(job, "Failed")["reason"] == "DoesNotFit"
    assert condition(job, "Preflight")["status"] == "False"
    assert status["preflight"]["result"] == "DoesNotFit"
    assert status["preflight"]["peakGiB"] == need
    assert jobset_names(apiserver, namespace) == []  # nothing took TPUs, nor Kueue quota
    assert any(t == "Warning" and r == "DoesNotFit" and f"{need:.2f} GiB" in m
               for t, r, m in events(apiserver, namespace, "big"))  # fmt: skip
    cache = apiserver.core.read_namespaced_config_map("posttrain-preflight", namespace).data
    assert json.loads(cache[status["preflight"]["key"]])["result"] == "DoesNotFit"
    assert operator.metric("posttrain_preflight_total", 'cached="false",result="DoesNotFit"') == 1


def test_a_fitting_job_proceeds_and_its_program_is_not_compiled_again(
    apiserver: Cluster, namespace: str, operator: OperatorProcess, model: Path, tmp_path: Path
):
    create(apiserver, namespace, tpu_job("small", model, seq=128, batch=1, remat="layer"))
    pf_job = one_preflight_job(apiserver, namespace, "small")
    assert jobset_names(apiserver, namespace) == []
    code, message = run_preflight_pod(apiserver, pf_job, tmp_path)
    assert code == 0, message
    wait_for(lambda: jobset_names(apiserver, namespace) == ["small"], timeout=60,
             what="the JobSet of a job that fits", describe=operator.logs)  # fmt: skip
    job = get_job(apiserver, namespace, "small")
    preflight = job["status"]["preflight"]
    assert preflight["result"] == "Fits" and 0 < preflight["peakGiB"] < 1
    assert preflight["hbmGiB"] == 16.0 and preflight["compiler"].startswith("libtpu ")
    assert {"argumentsGiB", "temporariesGiB", "outputsGiB", "flops"} <= set(preflight)
    fits = condition(job, "Preflight")
    assert fits["status"] == "True" and fits["reason"] == "Fits"
    assert "fits the train step in" in fits["message"]
    assert ("Normal", "Fits") in [(t, r) for t, r, _ in events(apiserver, namespace, "small")]
    wide = apiserver.kubectl("get", "ptj", "small", "-n", namespace, "-o", "wide").stdout
    header, row = wide.splitlines()[:2]
    assert "PREFLIGHT" in header.split() and "Fits" in row.split()

    # The same program with other steps, data and output: answered from the cache.
    again = tpu_job("small-again", model, seq=128, batch=1, remat="layer")
    again["spec"]["training"]["steps"] = 500
    again["spec"]["data"]["source"] = "/data/other.jsonl"
    again["spec"]["output"] = {"uri": "/outputs/again"}
    create(apiserver, namespace, again)
    wait_for(lambda: "small-again" in jobset_names(apiserver, namespace), timeout=60,
             what="the JobSet of the cached job", describe=operator.logs)  # fmt: skip
    assert preflight_jobs(apiserver, namespace, "small-again") == []  # not compiled again
    cached = get_job(apiserver, namespace, "small-again")["status"]["preflight"]
    assert cached["result"] == "Fits" and cached["cached"] is True
    assert cached["key"] == preflight["key"] and cached["peakGiB"] == preflight["peakGiB"]
    assert operator.metric("posttrain_preflight_total", 'cached="false",result="Fits"') == 1
    assert operator.metric("posttrain_preflight_total", 'cached="true",result="Fits"') == 1


def test_a_preflight_without_an_answer_does_not_hold_the_job(
    apiserver: Cluster, namespace: str, operator: OperatorProcess, model: Path
):
    """An image that cannot be pulled gives no answer: the job goes on as it would
    without a preflight (the fast estimate admits it), with a Warning saying why. A job
    with spec.preflight.compile false is not compiled at all."""
    doc = tpu_job("nopull", model, seq=128, batch=1, remat="layer",
                  image="registry.example/posttrain-trainer:no-such-tag")  # fmt: skip
    create(apiserver, namespace, doc)
    pod = make_pod(apiserver, one_preflight_job(apiserver, namespace, "nopull"))
    pull = 'Back-off pulling image "registry.example/posttrain-trainer:no-such-tag"'
    write_pod_status(apiserver, pod, {"phase": "Pending", "containerStatuses": [
        {"name": "preflight", "image": doc["spec"]["image"], "ready": False,
         "restartCount": 0, "imageID": "",
         "state": {"waiting": {"reason": "ImagePullBackOff", "message": pull}}}]})  # fmt: skip
    wait_for(lambda: "nopull" in jobset_names(apiserver, namespace), timeout=60,
             what="the JobSet of a job whose preflight gave no answer",
             describe=operator.logs)  # fmt: skip
    job = get_job(apiserver, namespace, "nopull")
    unknown = condition(job, "Preflight")
    assert unknown["status"] == "Unknown" and unknown["reason"] == "PreflightNoAnswer"
    assert "ImagePullBackOff" in unknown["message"] and pull in unknown["message"]
    assert job["status"]["preflight"]["result"] == "Unknown"
    assert any(t == "Warning" and r == "PreflightNoAnswer"
               for t, r, _ in events(apiserver, namespace, "nopull"))  # fmt: skip

    create(apiserver, namespace, tpu_job("skip", model, seq=128, batch=1, remat="layer",
                                         preflight={"compile": False}))  # fmt: skip
    wait_for(lambda: "skip" in jobset_names(apiserver, namespace), timeout=60,
             what="the JobSet of a job without a preflight", describe=operator.logs)  # fmt: skip
    assert preflight_jobs(apiserver, namespace, "skip") == []
    skipped = get_job(apiserver, namespace, "skip")
    assert "preflight" not in skipped["status"] and condition(skipped, "Preflight") is None


def test_no_answer_within_the_timeout_lets_the_job_go_on(
    apiserver: Cluster, namespace: str, model: Path, tmp_path: Path
):
    """No pod ever runs (say, no CPU node has room): after the installation's timeout the
    job goes on without an answer; the estimate admits it."""
    op = OperatorProcess(apiserver.kubeconfig, tmp_path, namespace, "-n", namespace)
    op.env.update(POSTTRAIN_PREFLIGHT_COMPILE="true", POSTTRAIN_PREFLIGHT_TIMEOUT_SECONDS="6")
    op.start()
    try:
        create(apiserver, namespace, tpu_job("slow", model, seq=128, batch=1, remat="layer"))
        pf_job = one_preflight_job(apiserver, namespace, "slow")
        assert pf_job["spec"]["activeDeadlineSeconds"] == 6
        assert jobset_names(apiserver, namespace) == []
        wait_for(lambda: "slow" in jobset_names(apiserver, namespace), timeout=40,
                 what="the JobSet after the preflight's timeout", describe=op.logs)  # fmt: skip
        job = get_job(apiserver, namespace, "slow")
        unknown = condition(job, "Preflight")
        assert unknown["status"] == "Unknown" and unknown["reason"] == "PreflightNoAnswer"
        assert (
            f"no answer from the preflight Job {pf_job['metadata']['name']} within 6 s"
            in (unknown["message"])
        )
    finally:
        op.stop()


def test_jobs_of_one_program_created_together_compile_it_once(
    apiserver: Cluster, namespace: str, operator: OperatorProcess, model: Path, tmp_path: Path
):
    """A sweep over learning rates: three jobs of one program created at once make one
    preflight Job; the others wait for its answer and go on with it."""
    names = ["sweep-a", "sweep-b", "sweep-c"]
    for i, name in enumerate(names):
        doc = tpu_job(name, model, seq=128, batch=1, remat="layer")
        doc["spec"]["training"]["learningRate"] = 1e-4 * (i + 1)
        create(apiserver, namespace, doc)
    wait_for(
        lambda: all(
            (get_job(apiserver, namespace, n).get("status") or {}).get("preflight") for n in names
        ),
        timeout=60, what="every job's preflight status", describe=operator.logs,
    )  # fmt: skip
    made = [j for n in names for j in preflight_jobs(apiserver, namespace, n)]
    assert len(made) == 1, [j["metadata"]["name"] for j in made]
    code, message = run_preflight_pod(apiserver, made[0], tmp_path)
    assert code == 0, message
    wait_for(lambda: sorted(jobset_names(apiserver, namespace)) == names, timeout=60,
             what="every job's JobSet", describe=operator.logs)  # fmt: skip
    answers = [get_job(apiserver, namespace, n)["status"]["preflight"] for n in names]
    assert {a["result"] for a in answers} == {"Fits"} and len({a["key"] for a in answers}) == 1
    assert sorted(bool(a.get("cached")) for a in answers) == [False, True, True]
    assert {a["job"] for a in answers} == {made[0]["metadata"]["name"]}  # who answered
