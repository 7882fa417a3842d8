"""The operator as a real process against a real kube-apiserver.

There is no JobSet controller in this tier, so where a test needs a JobSet to progress it
writes the JobSet's status subresource as the JobSet controller would; the e2e tier runs
the real controller.
"""

from __future__ import annotations

import base64
import json
import subprocess
import time
from collections.abc import Iterator

import kubernetes
import pytest
from hostile_jobs import MODELS
from invalid_jobs import valid_job
from operator_process import (
    OperatorProcess,
    chart_env,
    chart_identity,
    drop_chart_identity,
    free_port,
)
from trainer_access import (
    impersonating,
    install_trainer_policy,
    patch_status,
    remove_trainer_policy,
    trainer_client,
    trainer_pod,
)

from posttrain.render.jobset import JOB_NAME_LABEL
from posttrain.render.names import TRAINER_SERVICE_ACCOUNT
from posttrain.render.trainer_config import CONFIG_ANNOTATION
from tests.cluster import Cluster, self_signed, wait_for

pytestmark = pytest.mark.integration
GROUP, VERSION, PLURAL = "posttrain.dev", "v1alpha1", "posttrainjobs"
TRAINER = TRAINER_SERVICE_ACCOUNT


@pytest.fixture
def operator(apiserver: Cluster, namespace: str, tmp_path):
    op = OperatorProcess(apiserver.kubeconfig, tmp_path, namespace, "-n", namespace).start()
    yield op
    op.stop()


def chart_operator(apiserver: Cluster, namespace: str, tmp_path) -> OperatorProcess:
    """An operator (not started) with the Helm chart's identity and environment in
    `namespace` (remove the chart's cluster-scoped RBAC with drop_chart_identity)."""
    kubeconfig = chart_identity(apiserver, namespace, tmp_path / "operator.kubeconfig")
    op = OperatorProcess(kubeconfig, tmp_path, namespace, "-n", namespace, identity="t")
    op.env.update(chart_env(namespace))
    return op


def create_job(apiserver: Cluster, namespace: str, name: str, **spec_changes) -> dict:
    doc = valid_job(name)
    doc["spec"].update(spec_changes)
    return apiserver.custom.create_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, doc)


def get_job(apiserver: Cluster, namespace: str, name: str) -> dict:
    return apiserver.custom.get_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, name)


def jobsets(apiserver: Cluster, namespace: str) -> list[dict]:
    return apiserver.custom.list_namespaced_custom_object(
        "jobset.x-k8s.io", "v1alpha2", namespace, "jobsets"
    )["items"]


# A JobSet status with its one replicated job running.
RUNNING = {
    "replicatedJobsStatus": [
        {"name": "node", "ready": 1, "active": 1, "succeeded": 0, "failed": 0, "suspended": 0}
    ]
}


def set_jobset_status(apiserver: Cluster, namespace: str, name: str, status: dict) -> None:
    apiserver.custom.patch_namespaced_custom_object_status(
        "jobset.x-k8s.io", "v1alpha2", namespace, "jobsets", name, {"status": status}
    )


def phase(apiserver: Cluster, namespace: str, name: str) -> str | None:
    return (get_job(apiserver, namespace, name).get("status") or {}).get("phase")


def events(apiserver: Cluster, namespace: str, name: str) -> list[str]:
    items = apiserver.core.list_namespaced_event(
        namespace, field_selector=f"involvedObject.name={name}"
    ).items
    return [e.reason for e in items]


def running_pod(
    apiserver: Cluster, namespace: str, name: str, job: str, job_uid: str | None = None
) -> None:
    """A pod of the job's leader Job (labels as JobSet sets them) whose container runs; owned
    by the batch Job `job_uid`, or by nothing."""
    labels = {JOB_NAME_LABEL: job, "jobset.sigs.k8s.io/replicatedjob-name": "node",
              "jobset.sigs.k8s.io/job-index": "0", "jobset.sigs.k8s.io/restart-attempt": "0"}  # fmt: skip
    meta: dict = {"name": name, "labels": labels}
    if job_uid:
        meta["ownerReferences"] = [{"apiVersion": "batch/v1", "kind": "Job", "name": f"{job}-node-0",
                                    "uid": job_uid, "controller": True}]  # fmt: skip
    apiserver.core.create_namespaced_pod(
        namespace,
        {"metadata": meta, "spec": {"serviceAccountName": TRAINER,
                                    "containers": [{"name": "trainer", "image": "t"}]}},
    )  # fmt: skip
    started = {"running": {"startedAt": "2026-01-01T00:00:00Z"}}
    status = {"phase": "Running", "containerStatuses": [
        {"name": "trainer", "ready": True, "restartCount": 0, "image": "t", "imageID": "",
         "state": started}]}  # fmt: skip
    apiserver.core.patch_namespaced_pod_status(name, namespace, {"status": status})


def test_creates_owned_objects_and_status(
    apiserver: Cluster, namespace: str, operator: OperatorProcess
):
    job = create_job(apiserver, namespace, "first")
    uid = job["metadata"]["uid"]
    wait_for(lambda: phase(apiserver, namespace, "first") == "Pending", timeout=30)
    (js,) = jobsets(apiserver, namespace)
    assert js["metadata"]["name"] == "first"
    assert js["metadata"]["ownerReferences"][0]["uid"] == uid
    # The JobSet is all the job makes: its trainer pods carry the config and run as the
    # namespace's trainer ServiceAccount, made once with its RoleBinding, owned by no job.
    pod = js["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]
    config = json.loads(pod["metadata"]["annotations"][CONFIG_ANNOTATION])
    assert config["metadata"]["uid"] == uid
    assert pod["spec"]["serviceAccountName"] == TRAINER
    sa = apiserver.core.read_namespaced_service_account(TRAINER, namespace)
    binding = apiserver.get("rolebinding", TRAINER, namespace)
    assert binding["roleRef"]["kind"] == "ClusterRole"
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": TRAINER, "namespace": namespace}
    ]
    assert not sa.metadata.owner_references and not binding["metadata"].get("ownerReferences")
    for gone in ("configmaps", "roles"):
        kind = gone if gone == "configmaps" else "roles.rbac.authorization.k8s.io"
        assert not apiserver.kubectl("get", kind, "-n", namespace, "-o", "name").stdout.strip()
    status = get_job(apiserver, namespace, "first")["status"]
    assert status["jobSetName"] == "first" and status["observedGeneration"] == 1
    assert status["outputs"]["checkpoints"] == "/outputs/run/checkpoints"
    assert {c["type"] for c in status["conditions"]} == {
        "Queued",
        "Running",
        "Suspended",
        "Succeeded",
        "Failed",
    }
    wait_for(lambda: "Pending" in events(apiserver, namespace, "first"), timeout=20)
    assert "JobSetCreated" not in events(apiserver, namespace, "first")  # the phase's Event says it

    # A running pod that only carries the job's labels is not the job's: it stays Pending.
    running_pod(apiserver, namespace, "first-foreign", "first")
    time.sleep(2)
    assert phase(apiserver, namespace, "first") == "Pending"
    # The JobSet's own pod (owned by a Job the JobSet controls) runs: the job runs.
    owner = {"apiVersion": "jobset.x-k8s.io/v1alpha2", "kind": "JobSet", "name": "first",
             "uid": js["metadata"]["uid"], "controller": True}  # fmt: skip
    batch = kubernetes.client.BatchV1Api(apiserver.api_client)
    batch_job = batch.create_namespaced_job(
        namespace,
        {"metadata": {"name": "first-node-0", "labels": {JOB_NAME_LABEL: "first"},
                      "ownerReferences": [owner]},
         "spec": {"suspend": True, "template": {"spec": {"restartPolicy": "Never",
                  "containers": [{"name": "trainer", "image": "t"}]}}}},
    )  # fmt: skip
    running_pod(apiserver, namespace, "first-node-0-0", "first", batch_job.metadata.uid)
    wait_for(lambda: phase(apiserver, namespace, "first") == "Running", timeout=30)
    batch.delete_namespaced_job("first-node-0", namespace, propagation_policy="Orphan")
    for name in ("first-foreign", "first-node-0-0"):
        apiserver.core.delete_namespaced_pod(name, namespace, grace_period_seconds=0)

    # The JobSet runs, then completes: the phase follows, with conditions and events.
    set_jobset_status(apiserver, namespace, "first", RUNNING)
    wait_for(lambda: phase(apiserver, namespace, "first") == "Running", timeout=30)
    set_jobset_status(
        apiserver,
        namespace,
        "first",
        {
            "conditions": [
                {
                    "type": "Completed",
                    "status": "True",
                    "reason": "AllJobsCompleted",
                    "message": "jobset completed successfully",
                    "lastTransitionTime": "2026-01-01T00:00:00Z",
                }
            ]
        },
    )
    apiserver.kubectl(
        "wait", "--for=condition=Succeeded", "ptj/first", "-n", namespace, "--timeout=30s"
    )
    status = get_job(apiserver, namespace, "first")["status"]
    assert status["phase"] == "Succeeded" and status["startTime"] and status["completionTime"]
    assert {"Running", "Succeeded"} <= set(events(apiserver, namespace, "first"))
    assert operator.metric("posttrain_reconciles_total", 'handler="create"') >= 1
    assert operator.metric("posttrain_jobs", 'phase="Succeeded"') == 1


def test_restricted_egress_makes_the_jobs_network_policy_before_its_jobset(
    apiserver: Cluster, namespace: str, operator: OperatorProcess
):
    job = create_job(apiserver, namespace, "fenced", network={"restrictEgress": True})
    wait_for(lambda: phase(apiserver, namespace, "fenced") == "Pending", timeout=30)
    (js,) = jobsets(apiserver, namespace)
    policy = apiserver.get("networkpolicy", "fenced-egress", namespace)
    assert policy["metadata"]["ownerReferences"][0]["uid"] == job["metadata"]["uid"]
    assert policy["spec"]["podSelector"] == {"matchLabels": {JOB_NAME_LABEL: "fenced"}}
    assert policy["spec"]["policyTypes"] == ["Egress"]
    # Made first (the API server's revisions only grow): no trainer pod runs unfenced.
    assert int(policy["metadata"]["resourceVersion"]) < int(js["metadata"]["resourceVersion"])


def test_suspend_resume_and_mutable_fields(
    apiserver: Cluster, namespace: str, operator: OperatorProcess
):
    create_job(apiserver, namespace, "pausable")
    wait_for(lambda: jobsets(apiserver, namespace), timeout=30)
    patch = {
        "spec": {
            "scheduling": {
                "suspend": True,
                "workloadPriorityClass": "low",
                "ttlSecondsAfterFinished": 120,
            }
        }
    }
    apiserver.custom.patch_namespaced_custom_object(
        GROUP, VERSION, namespace, PLURAL, "pausable", patch
    )
    wait_for(lambda: jobsets(apiserver, namespace)[0]["spec"]["suspend"] is True, timeout=30)
    js = jobsets(apiserver, namespace)[0]
    wait_for(
        lambda: (
            jobsets(apiserver, namespace)[0]["metadata"]["labels"].get(
                "kueue.x-k8s.io/priority-class"
            )
            == "low"
        ),
        timeout=30,
    )
    wait_for(
        lambda: jobsets(apiserver, namespace)[0]["spec"].get("ttlSecondsAfterFinished") == 120,
        timeout=30,
    )
    wait_for(lambda: phase(apiserver, namespace, "pausable") == "Suspended", timeout=40)
    apiserver.custom.patch_namespaced_custom_object(
        GROUP, VERSION, namespace, PLURAL, "pausable", {"spec": {"scheduling": {"suspend": False}}}
    )
    wait_for(lambda: jobsets(apiserver, namespace)[0]["spec"]["suspend"] is False, timeout=30)
    wait_for(lambda: phase(apiserver, namespace, "pausable") == "Pending", timeout=40)
    assert js["metadata"]["uid"] == jobsets(apiserver, namespace)[0]["metadata"]["uid"]
    # JobSet's failurePolicy cannot change: neither can the job's maxRestarts.
    with pytest.raises(kubernetes.client.ApiException) as refused:
        apiserver.custom.patch_namespaced_custom_object(
            GROUP, VERSION, namespace, PLURAL, "pausable",
            {"spec": {"scheduling": {"maxRestarts": 7}}},
        )  # fmt: skip
    assert "spec.scheduling.maxRestarts" in refused.value.body, refused.value.body


def test_jobset_deleted_out_of_band_is_recreated(
    apiserver: Cluster, namespace: str, operator: OperatorProcess
):
    create_job(apiserver, namespace, "again")
    wait_for(lambda: jobsets(apiserver, namespace), timeout=30)
    old_uid = jobsets(apiserver, namespace)[0]["metadata"]["uid"]
    apiserver.kubectl("delete", "jobset", "again", "-n", namespace)
    wait_for(
        lambda: [j for j in jobsets(apiserver, namespace) if j["metadata"]["uid"] != old_uid],
        timeout=30,
    )
    wait_for(lambda: "JobSetDeleted" in events(apiserver, namespace, "again"), timeout=20)


def test_finished_job_jobset_not_recreated(
    apiserver: Cluster, namespace: str, operator: OperatorProcess
):
    create_job(apiserver, namespace, "done")
    wait_for(lambda: jobsets(apiserver, namespace), timeout=30)
    set_jobset_status(
        apiserver,
        namespace,
        "done",
        {
            "conditions": [
                {
                    "type": "Failed",
                    "status": "True",
                    "reason": "FailedJobs",
                    "message": "jobset failed: reached max restarts",
                    "lastTransitionTime": "2026-01-01T00:00:00Z",
                }
            ]
        },
    )
    apiserver.kubectl(
        "wait", "--for=condition=Failed", "ptj/done", "-n", namespace, "--timeout=30s"
    )
    cond = {c["type"]: c for c in get_job(apiserver, namespace, "done")["status"]["conditions"]}[
        "Failed"
    ]
    assert cond["reason"] == "FailedJobs" and "max restarts" in cond["message"]
    # The JobSet controller finished it (and removes its Jobs): the operator leaves it.
    assert not jobsets(apiserver, namespace)[0]["spec"].get("suspend")
    apiserver.kubectl(
        "delete", "jobset", "done", "-n", namespace
    )  # as ttlSecondsAfterFinished would
    time.sleep(3)
    assert jobsets(apiserver, namespace) == []
    assert phase(apiserver, namespace, "done") == "Failed"


def test_invalid_job_without_webhook_fails_cleanly(
    apiserver: Cluster, namespace: str, operator: OperatorProcess
):
    # v6e-300 passes the CRD (only the catalog knows it is impossible).
    create_job(apiserver, namespace, "impossible", resources={"accelerator": "v6e-300"})
    wait_for(lambda: phase(apiserver, namespace, "impossible") == "Failed", timeout=30)
    status = get_job(apiserver, namespace, "impossible")["status"]
    assert "spec.resources.accelerator" in status["message"] and "v6e-256" in status["message"]
    assert jobsets(apiserver, namespace) == []
    wait_for(lambda: "InvalidSpec" in events(apiserver, namespace, "impossible"), timeout=20)
    # A credential in a refused output URI reaches neither the status, the Events nor the
    # logs; a config.json that is no model's fails the job with its file and key.
    create_job(apiserver, namespace, "leaky", output={"uri": "gs://TOKEN@bucket/run"})
    source = str(MODELS / "zero-heads")
    create_job(apiserver, namespace, "bad-config", model={"source": source})
    for name, field, words in [
        ("leaky", "spec.output.uri", "credentials"),
        ("bad-config", "spec.model.source", "config.json: num_attention_heads"),
    ]:
        wait_for(lambda n=name: phase(apiserver, namespace, n) == "Failed", timeout=30)
        status = get_job(apiserver, namespace, name)["status"]
        assert (
            field in status["message"]
            and words in failed_condition(apiserver, namespace, name)["message"]
        ), status
        wait_for(lambda n=name: event_messages(apiserver, namespace, n, "InvalidSpec"), timeout=20)
    leaky = get_job(apiserver, namespace, "leaky")
    assert "outputs" not in leaky["status"] and "TOKEN" not in json.dumps(leaky["status"])
    assert not any(
        "TOKEN" in m for m in event_messages(apiserver, namespace, "leaky", "InvalidSpec")
    )
    assert "TOKEN" not in operator.logs()
    assert jobsets(apiserver, namespace) == []
    # Without the webhook, a missing PriorityClass is the job's reason to wait: the Job
    # controller creates no pod until it exists.
    create_job(apiserver, namespace, "no-class", scheduling={"priorityClass": f"{namespace}-x"})

    def waits_for_class() -> bool:
        status = get_job(apiserver, namespace, "no-class").get("status") or {}
        running = {c["type"]: c for c in status.get("conditions") or []}.get("Running", {})
        return status.get("phase") == "Pending" and running.get("reason") == "PriorityClassNotFound"

    wait_for(waits_for_class, timeout=30, describe=operator.logs)
    assert (
        f'"{namespace}-x" not found'
        in get_job(apiserver, namespace, "no-class")["status"]["message"]
    )
    create_job(apiserver, namespace, "fine")  # the operator is still working
    wait_for(lambda: phase(apiserver, namespace, "fine") == "Pending", timeout=30)


@pytest.fixture(scope="module")
def trainer_policy(apiserver: Cluster) -> Iterator[None]:
    install_trainer_policy(apiserver)
    yield
    remove_trainer_policy(apiserver)


def test_trainer_patches_only_its_own_jobs_status(
    apiserver: Cluster, namespace: str, operator: OperatorProcess, trainer_policy, tmp_path
):
    """A trainer pod's own token (the namespace's trainer ServiceAccount, bound to a pod of
    job `reporter`) patches reporter's status, and nothing else: not another job's status
    (the status policy), not the job itself, nor anything in another namespace."""
    create_job(apiserver, namespace, "reporter")
    create_job(apiserver, namespace, "other")
    wait_for(lambda: len(jobsets(apiserver, namespace)) == 2, timeout=30)
    pod = trainer_pod(apiserver, namespace, "reporter")
    as_trainer = trainer_client(apiserver, namespace, pod, tmp_path)
    progress = {
        "step": 7,
        "totalSteps": 60,
        "loss": 2.5,
        "tokensPerSecond": 1000.0,
        "etaSeconds": 30,
        "lastCheckpointStep": 5,
    }
    body = {"status": {"progress": progress}}
    assert patch_status(as_trainer, namespace, "reporter", body) == (200, "")
    # Of its own job's status only the progress: not the operator's fields.
    wait_for(lambda: phase(apiserver, namespace, "reporter") == "Pending", timeout=30)
    for forged in (
        {"phase": "Succeeded"},
        {"progress": progress, "message": "x"},
        {"message": None},
    ):
        code, message = patch_status(as_trainer, namespace, "reporter", {"status": forged})
        assert code == 403 and "may only change status.progress of its job" in message, message
    assert phase(apiserver, namespace, "reporter") == "Pending"
    code, message = patch_status(as_trainer, namespace, "other", body)
    assert code == 403 and "ValidatingAdmissionPolicy" in message, message
    assert "may only patch the status of the job whose pod it runs in, not other" in message
    assert "progress" not in (get_job(apiserver, namespace, "other").get("status") or {})
    code, message = patch_status(
        as_trainer, namespace, "reporter", {"spec": {"image": "x"}}, sub=""
    )
    assert code == 403 and "cannot patch resource" in message, message
    # Another namespace: RBAC grants nothing there; were it granted by mistake, the policy
    # still refuses (the job of the same name there is not the pod's).
    elsewhere = apiserver.create_namespace("elsewhere")
    try:
        apiserver.custom.create_namespaced_custom_object(
            GROUP, VERSION, elsewhere, PLURAL, valid_job("reporter")
        )
        code, message = patch_status(as_trainer, elsewhere, "reporter", body)
        assert code == 403 and "cannot patch resource" in message, message
        apiserver.kubectl(
            "create", "rolebinding", "mistake", "-n", elsewhere, "--clusterrole=posttrain-trainer",
            f"--serviceaccount={namespace}:{TRAINER}",
        )  # fmt: skip

        def past_rbac() -> tuple[int, str] | None:  # once RBAC has the binding
            code, message = patch_status(as_trainer, elsewhere, "reporter", body)
            return (code, message) if "cannot patch resource" not in message else None

        code, message = wait_for(past_rbac, timeout=20, what="RBAC to grant the mistake")
        assert code == 403 and "may only patch a job in its own namespace" in message, message
    finally:
        apiserver.delete_namespace(elsewhere)
    # The operator's own status writes keep the trainer's progress.
    set_jobset_status(apiserver, namespace, "reporter", RUNNING)
    wait_for(lambda: phase(apiserver, namespace, "reporter") == "Running", timeout=30)
    assert get_job(apiserver, namespace, "reporter")["status"]["progress"] == progress
    row = apiserver.kubectl(
        "get", "ptj", "reporter", "-n", namespace, "--no-headers"
    ).stdout.split()
    assert row[4:8] == ["Running", "7", "60", "2.5"]


# Pod names a trainer's token may carry, and whether it may patch job `amb`'s status: only
# a trainer pod of `amb` itself (replicated jobs node, slice, pathways-head), never a pod of
# job `amb-node-0-0` whose name begins alike, a Pathways worker, or a token bound to no pod.
POD_NAMES = [
    ("amb-node-0-0-x7k2p", True),
    ("amb-slice-3-1-x7k2p", True),
    ("amb-pathways-head-0-0-x7k2p", True),
    ("amb-node-0-0-node-0-0-x7k2p", False),
    ("amb-worker-0-0-x7k2p", False),
    ("amb-node-0-0", False),
    ("amb-x-node-0-0-x7k2p", False),
    ("other-node-0-0-x7k2p", False),
    (None, False),
]


def test_status_policy_matches_one_job_by_pod_name(
    apiserver: Cluster, namespace: str, operator: OperatorProcess, trainer_policy
):
    """The trainer ServiceAccount impersonated with the pod-name user extra of a bound
    token (`kubectl --as=... --as-user-extra=...`): the policy lets exactly the pods of
    job `amb` patch amb's status. And what a trainer may do at all (SelfSubjectAccessReview
    as it): patch jobs' status in its namespace, nothing else."""
    create_job(apiserver, namespace, "amb")
    create_job(apiserver, namespace, "amb-node-0-0")
    wait_for(lambda: len(jobsets(apiserver, namespace)) == 2, timeout=30)
    user = f"system:serviceaccount:{namespace}:{TRAINER}"
    body = {"status": {"progress": {"step": 1}}}
    wrong = []
    for pod_name, allowed in POD_NAMES:
        code, message = patch_status(
            apiserver.api_client, namespace, "amb", body, impersonating(user, pod_name)
        )
        if (code == 200) != allowed or (not allowed and "ValidatingAdmissionPolicy" not in message):
            wrong.append(f"{pod_name}: {code} {message}")
    assert not wrong, "\n".join(wrong)
    # Its own job's name begins another's: amb-node-0-0's pod patches only amb-node-0-0.
    own = impersonating(user, "amb-node-0-0-node-0-0-x7k2p")
    assert patch_status(apiserver.api_client, namespace, "amb-node-0-0", body, own)[0] == 200

    def can(verb: str, resource: str, sub: str = "", group: str = GROUP, ns=namespace) -> bool:
        attributes = {"verb": verb, "resource": resource, "group": group, "subresource": sub}
        if ns:
            attributes["namespace"] = ns
        review = {
            "apiVersion": "authorization.k8s.io/v1",
            "kind": "SelfSubjectAccessReview",
            "spec": {"resourceAttributes": attributes},
        }
        out = apiserver.kubectl(
            "create",
            "--validate=false",
            "-f",
            "-",
            "-o",
            "json",
            f"--as={user}",
            input=json.dumps(review),
        )
        return json.loads(out.stdout)["status"]["allowed"]

    assert can("patch", PLURAL, "status")
    denied = [
        ("get", PLURAL, "status", GROUP, namespace),
        ("update", PLURAL, "status", GROUP, namespace),
        ("get", PLURAL, "", GROUP, namespace),
        ("list", PLURAL, "", GROUP, namespace),
        ("patch", PLURAL, "", GROUP, namespace),
        ("delete", PLURAL, "", GROUP, namespace),
        ("patch", PLURAL, "status", GROUP, "default"),
        ("patch", "jobsets", "", "jobset.x-k8s.io", namespace),
        ("get", "secrets", "", "", namespace),
        ("create", "pods", "", "", namespace),
        ("list", "pods", "", "", namespace),
        ("create", "serviceaccounts", "token", "", namespace),
        ("create", "events", "", "", namespace),
        ("get", "configmaps", "", "", namespace),
    ]
    assert [d for d in denied if can(*d)] == []


def test_standby_takes_over(apiserver: Cluster, namespace: str, tmp_path):
    first = OperatorProcess(
        apiserver.kubeconfig, tmp_path, namespace, "-n", namespace, identity="a"
    ).start()
    second = OperatorProcess(
        apiserver.kubeconfig, tmp_path, namespace, "-n", namespace, identity="b"
    ).start(wait_leader=False)
    try:
        time.sleep(4)
        assert second.metric("posttrain_leader") == 0.0  # a standby does nothing
        create_job(apiserver, namespace, "ha")
        wait_for(lambda: phase(apiserver, namespace, "ha") == "Pending", timeout=30)
        assert "created JobSet" in first.logs() and "created JobSet" not in second.logs()
        first.kill()
        wait_for(lambda: second.metric("posttrain_leader") == 1.0, timeout=40)
        create_job(apiserver, namespace, "ha-two")
        wait_for(lambda: phase(apiserver, namespace, "ha-two") == "Pending", timeout=30)
        assert len(jobsets(apiserver, namespace)) == 2
    finally:
        first.stop()
        second.stop()


def test_kill_during_reconciliation_makes_no_duplicates(
    apiserver: Cluster, namespace: str, tmp_path
):
    op = OperatorProcess(
        apiserver.kubeconfig, tmp_path, namespace, "-n", namespace, identity="k1"
    ).start()
    try:
        for i in range(50):
            create_job(apiserver, namespace, f"bulk-{i:02d}")
        wait_for(lambda: len(jobsets(apiserver, namespace)) >= 10, timeout=60)
        op.kill()  # SIGKILL mid-way
        partial = len(jobsets(apiserver, namespace))
        op = OperatorProcess(
            apiserver.kubeconfig, tmp_path, namespace, "-n", namespace, identity="k2"
        )
        # The killed replica's Lease must expire before the new one leads.
        op.start()
        wait_for(
            lambda: all(
                phase(apiserver, namespace, f"bulk-{i:02d}") == "Pending" for i in range(50)
            ),
            timeout=180,
            interval=2,
        )
        names = sorted(j["metadata"]["name"] for j in jobsets(apiserver, namespace))
        assert names == [f"bulk-{i:02d}" for i in range(50)], f"killed after {partial}"
        (sa,) = apiserver.core.list_namespaced_service_account(
            namespace, label_selector="app.kubernetes.io/component=trainer"
        ).items
        assert sa.metadata.name == TRAINER
    finally:
        op.stop()


def test_admission_webhook(apiserver: Cluster, namespace: str, tmp_path):
    cert, key = self_signed(tmp_path / "certs")
    port = free_port()
    op = OperatorProcess(
        apiserver.kubeconfig,
        tmp_path,
        namespace,
        "-n",
        namespace,
        "--webhook-port",
        str(port),
        "--webhook-address",
        "127.0.0.1",
        "--webhook-host",
        "127.0.0.1",
        "--webhook-cert",
        str(cert),
        "--webhook-key",
        str(key),
        "--webhook-ca",
        str(cert),
        "--webhook-register",
        identity="hook",
    ).start()
    try:

        def registered() -> bool:
            out = apiserver.kubectl("get", "validatingwebhookconfigurations", "-o", "json").stdout
            hooks = [w for c in json.loads(out)["items"] for w in c.get("webhooks", [])]
            return any(base64.b64decode(w["clientConfig"].get("caBundle", "")) for w in hooks)

        wait_for(registered, timeout=30)
        doc = valid_job("no-such-tpu")
        doc["spec"]["resources"] = {"accelerator": "v6e-300"}

        def refused() -> str:
            proc = apiserver.kubectl(
                "create", "-n", namespace, "-f", "-", input=json.dumps(doc), check=False
            )
            assert proc.returncode != 0, "admitted"
            return proc.stderr

        err = wait_for(
            lambda: (e := refused()) and "spec.resources.accelerator" in e and e, timeout=30
        )
        assert "admission webhook" in err and "no v6e slice has 300 chips" in err
        big = valid_job("too-big")
        big["spec"]["model"] = {"source": "gs://m/Llama-3.1-70B"}
        big["spec"]["resources"] = {"accelerator": "v6e-8"}
        proc = apiserver.kubectl(
            "create", "-n", namespace, "-f", "-", input=json.dumps(big), check=False
        )
        assert proc.returncode != 0 and "does not fit" in proc.stderr and "GiB" in proc.stderr
        ok = apiserver.kubectl(
            "create", "-n", namespace, "-f", "-", input=json.dumps(valid_job("fits"))
        )
        assert "created" in ok.stdout
        _priority_and_queue_references(apiserver, namespace)
    finally:
        op.stop()
        apiserver.kubectl("delete", "validatingwebhookconfiguration", "posttrain.dev", check=False)


def _priority_and_queue_references(apiserver: Cluster, namespace: str) -> None:
    """The webhook reads the classes and queue a job names from the API server: a
    missing PriorityClass or WorkloadPriorityClass is refused, a missing LocalQueue is
    an admission warning that kubectl prints."""
    pc, wpc = f"{namespace}-high", f"{namespace}-urgent"

    def create(name: str, **scheduling) -> subprocess.CompletedProcess:
        doc = valid_job(name)
        doc["spec"]["scheduling"] = scheduling
        return apiserver.kubectl(
            "create", "-n", namespace, "-f", "-", input=json.dumps(doc), check=False
        )

    proc = create("no-pc", priorityClass=pc)
    assert proc.returncode != 0 and f"PriorityClass '{pc}' does not exist" in proc.stderr
    proc = create("no-wpc", workloadPriorityClass=wpc)
    assert proc.returncode != 0 and f"WorkloadPriorityClass '{wpc}' does not exist" in proc.stderr
    classes = [
        {"apiVersion": "scheduling.k8s.io/v1", "kind": "PriorityClass",
         "metadata": {"name": pc}, "value": 750},
        {"apiVersion": "kueue.x-k8s.io/v1beta2", "kind": "WorkloadPriorityClass",
         "metadata": {"name": wpc}, "value": 750},
    ]  # fmt: skip
    apiserver.apply(classes)
    try:
        proc = create("with-classes", priorityClass=pc, workloadPriorityClass=wpc)
        assert proc.returncode == 0, proc.stderr
        proc = create("no-queue", queue="no-such-queue")
        assert proc.returncode == 0, proc.stderr
        assert "LocalQueue 'no-such-queue' does not exist" in proc.stderr  # kubectl: Warning
    finally:
        apiserver.delete_all(classes)


def test_operator_survives_api_server_restart(apiserver: Cluster, namespace: str, tmp_path):
    from tests.cluster import control_plane

    op = OperatorProcess(
        apiserver.kubeconfig, tmp_path, namespace, "-n", namespace, identity="r"
    ).start()
    try:
        create_job(apiserver, namespace, "before")
        wait_for(lambda: phase(apiserver, namespace, "before") == "Pending", timeout=30)
        control_plane._stop("kube-apiserver")
        time.sleep(5)  # the operator's watches and Lease renewals fail meanwhile
        control_plane._start_apiserver(control_plane.State.load())
        wait_for(
            lambda: create_job(apiserver, namespace, "after"), timeout=60, what="API server back"
        )
        wait_for(
            lambda: phase(apiserver, namespace, "after") == "Pending", timeout=120, describe=op.logs
        )
        assert op.proc.poll() is None, "the operator restarted itself"
        assert len(jobsets(apiserver, namespace)) == 2
    finally:
        op.stop()


def failed_condition(apiserver: Cluster, namespace: str, name: str) -> dict | None:
    status = get_job(apiserver, namespace, name).get("status") or {}
    if status.get("phase") != "Failed":
        return None
    return {c["type"]: c for c in status["conditions"]}["Failed"]


def wait_failed(apiserver: Cluster, namespace: str, name: str, operator) -> dict:
    """The job's Failed condition, once the operator has failed it (within 30 s)."""
    return wait_for(
        lambda: failed_condition(apiserver, namespace, name),
        timeout=30,
        what=f"{name} failed",
        describe=operator.logs,
    )


def event_messages(apiserver: Cluster, namespace: str, name: str, reason: str) -> list[str]:
    items = apiserver.core.list_namespaced_event(
        namespace, field_selector=f"involvedObject.name={name}"
    ).items
    return [e.message for e in items if e.reason == reason]


def test_jobset_the_api_server_refuses_fails_the_job_once(
    apiserver: Cluster, namespace: str, tmp_path
):
    # The operator's default queue becomes the JobSet's Kueue label; one that is not a
    # valid label value passes the job's validation (the job names no queue) and the
    # server refuses the JobSet (422).
    op = OperatorProcess(apiserver.kubeconfig, tmp_path, namespace, "-n", namespace)
    op.env["POSTTRAIN_DEFAULT_QUEUE"] = "team queue\n"
    op.start()
    try:
        create_job(apiserver, namespace, "refused")
        failed = wait_failed(apiserver, namespace, "refused", op)
        assert failed["reason"] == "InvalidSpec", failed
        message = get_job(apiserver, namespace, "refused")["status"]["message"]
        assert message.startswith("the API server refused JobSet refused: ")
        assert "metadata.labels" in message and "team queue\\n" in message  # escaped
        assert "\n" not in message and "\n" not in failed["message"]
        assert jobsets(apiserver, namespace) == []
        warned = wait_for(
            lambda: event_messages(apiserver, namespace, "refused", "InvalidSpec"), timeout=20
        )
        assert "metadata.labels" in warned[0]
        # No retry loop: nothing more is written, and the handler did not raise.
        version = get_job(apiserver, namespace, "refused")["metadata"]["resourceVersion"]
        time.sleep(5)
        assert get_job(apiserver, namespace, "refused")["metadata"]["resourceVersion"] == version
        assert len(event_messages(apiserver, namespace, "refused", "InvalidSpec")) == 1
        assert not operator_errors(op), op.logs()
        assert "failed permanently" not in op.logs()
    finally:
        op.stop()


def test_a_refusal_that_stays_suspends_the_jobset_for_good(
    apiserver: Cluster, namespace: str, operator: OperatorProcess
):
    """The JobSet controller's JobCreationFailed Event for a rule that stays (posted here
    as that controller does) fails the job and suspends its JobSet; started again (as
    Kueue may once more), it is suspended again, and then nothing more is written."""
    create_job(apiserver, namespace, "ruled")
    (js,) = wait_for(lambda: jobsets(apiserver, namespace), timeout=30)
    meta = js["metadata"]
    error = (
        "jobs.batch \"ruled-slice-0\" is forbidden: ValidatingAdmissionPolicy 'deadline' with "
        "binding 'deadline' denied request: Jobs need spec.activeDeadlineSeconds"
    )
    now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    apiserver.core.create_namespaced_event(
        namespace,
        {
            "metadata": {"name": f"{meta['name']}.refused"},
            "involvedObject": {"kind": "JobSet", "apiVersion": "jobset.x-k8s.io/v1alpha2",
                               "name": meta["name"], "namespace": namespace, "uid": meta["uid"]},
            "reason": "JobCreationFailed",
            "message": f'job "ruled-slice-0" creation failed with error: {error}',
            "type": "Warning",
            "firstTimestamp": now,
            "lastTimestamp": now,
            "source": {"component": "jobset-controller"},
        },
    )  # fmt: skip
    failed = wait_failed(apiserver, namespace, "ruled", operator)
    assert failed["reason"] == "JobCreationFailed" and failed["message"].endswith(error)

    def suspended() -> dict | None:
        (current,) = jobsets(apiserver, namespace)
        return current if current["spec"].get("suspend") is True else None

    wait_for(suspended, timeout=20, what="the failed job's JobSet suspended")
    assert wait_for(lambda: "JobSetSuspended" in events(apiserver, namespace, "ruled"), timeout=20)
    apiserver.custom.patch_namespaced_custom_object(
        "jobset.x-k8s.io", "v1alpha2", namespace, "jobsets", "ruled", {"spec": {"suspend": False}}
    )
    again = wait_for(suspended, timeout=20, what="the JobSet suspended again")
    job_version = get_job(apiserver, namespace, "ruled")["metadata"]["resourceVersion"]
    time.sleep(3)
    (current,) = jobsets(apiserver, namespace)
    assert current["metadata"]["resourceVersion"] == again["metadata"]["resourceVersion"]
    assert get_job(apiserver, namespace, "ruled")["metadata"]["resourceVersion"] == job_version
    assert phase(apiserver, namespace, "ruled") == "Failed"


def operator_errors(op: OperatorProcess) -> float:
    return sum(
        op.metric("posttrain_reconcile_errors_total", f'handler="{h}"') or 0
        for h in ("create", "resync", "jobset")
    )


def foreign_jobset(name: str) -> dict:
    """A JobSet an attacker made before the job, with the name the job's will have and no
    owner reference."""
    return {
        "apiVersion": "jobset.x-k8s.io/v1alpha2",
        "kind": "JobSet",
        "metadata": {"name": name, "labels": {"posttrain.dev/job-name": name}},
        "spec": {
            "suspend": True,
            "replicatedJobs": [
                {
                    "name": "node",
                    "template": {
                        "spec": {
                            "template": {
                                "spec": {
                                    "restartPolicy": "Never",
                                    "containers": [{"name": "c", "image": "attacker"}],
                                }
                            }
                        }
                    },
                }
            ],
        },
    }


def test_foreign_jobset_is_never_used(apiserver: Cluster, namespace: str, operator):
    obj = foreign_jobset("victim")
    apiserver.apply(obj, namespace)
    planted = apiserver.get("JobSet", "victim", namespace)
    create_job(apiserver, namespace, "victim")
    failed = wait_failed(apiserver, namespace, "victim", operator)
    message = get_job(apiserver, namespace, "victim")["status"]["message"]
    assert failed["reason"] == "ForeignObject", failed
    assert "JobSet victim already exists and is not owned" in message
    assert "jobSetName" not in get_job(apiserver, namespace, "victim")["status"]
    # Not adopted: the planted JobSet is as it was, owned by no one.
    now = apiserver.get("JobSet", "victim", namespace)
    assert now["metadata"]["resourceVersion"] == planted["metadata"]["resourceVersion"]
    assert not now["metadata"].get("ownerReferences")
    wait_for(lambda: event_messages(apiserver, namespace, "victim", "ForeignObject"))


def test_trainer_access_already_there(apiserver: Cluster, namespace: str, operator):
    """A trainer ServiceAccount an admin made (say with a Workload Identity annotation) is
    used as it is; a RoleBinding of the trainer's name that grants something else is not:
    the namespace's jobs fail saying so, and run once it is gone."""
    sa = {
        "apiVersion": "v1",
        "kind": "ServiceAccount",
        "metadata": {"name": TRAINER, "annotations": {"iam.gke.io/gcp-service-account": "t@p"}},
    }
    apiserver.apply(sa, namespace)
    planted_sa = apiserver.get("ServiceAccount", TRAINER, namespace)
    binding = {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "RoleBinding",
        "metadata": {"name": TRAINER},
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": "view"},
        "subjects": [{"kind": "ServiceAccount", "name": TRAINER, "namespace": namespace}],
    }
    apiserver.apply(binding, namespace)
    create_job(apiserver, namespace, "blocked")
    failed = wait_failed(apiserver, namespace, "blocked", operator)
    assert failed["reason"] == "ForeignObject", failed
    message = get_job(apiserver, namespace, "blocked")["status"]["message"]
    assert f"RoleBinding {TRAINER} already exists and does not bind ClusterRole" in message
    assert jobsets(apiserver, namespace) == []
    apiserver.kubectl("delete", "rolebinding", TRAINER, "-n", namespace)
    create_job(apiserver, namespace, "unblocked")
    wait_for(lambda: jobsets(apiserver, namespace), timeout=30, describe=operator.logs)
    made = apiserver.get("rolebinding", TRAINER, namespace)
    assert made["roleRef"]["name"] == "posttrain-trainer"
    now = apiserver.get("ServiceAccount", TRAINER, namespace)
    assert now["metadata"]["resourceVersion"] == planted_sa["metadata"]["resourceVersion"]


def test_trainer_access_is_made_again_once_the_namespaces_jobs_are_gone(
    apiserver: Cluster, namespace: str, operator: OperatorProcess
):
    """A namespace deleted and made again under the same name loses its trainer
    ServiceAccount and RoleBinding with its jobs (simulated here: this tier runs no
    namespace controller). Once the namespace's last job is gone the operator remembers
    nothing of it: the next job gets them again at once, not after the 5-minute recheck."""

    def access() -> bool:
        found = apiserver.kubectl(
            "get", "serviceaccount,rolebinding", TRAINER, "-n", namespace, check=False
        )
        return found.returncode == 0

    create_job(apiserver, namespace, "first")
    wait_for(lambda: jobsets(apiserver, namespace), timeout=30, describe=operator.logs)
    assert access()
    apiserver.kubectl("delete", "ptj", "first", "-n", namespace)
    apiserver.kubectl("delete", "serviceaccount,rolebinding", TRAINER, "-n", namespace)
    wait_for(
        lambda: operator.metric("posttrain_jobs", 'phase="Pending"') == 0,
        timeout=30,
        what="the operator to see the job go",
    )
    create_job(apiserver, namespace, "second")
    wait_for(access, timeout=30, what="the trainer access made again", describe=operator.logs)


def test_missing_trainer_cluster_role_is_in_the_status(
    apiserver: Cluster, namespace: str, tmp_path
):
    """An operator installed by the chart whose trainer ClusterRole is missing cannot
    bind the namespace's trainers to it (the API server answers 404): the job waits,
    Pending, its status naming the ClusterRole, and gets its JobSet once the ClusterRole
    is there."""
    op = chart_operator(apiserver, namespace, tmp_path)
    cluster_role = op.env["POSTTRAIN_TRAINER_CLUSTER_ROLE"]
    apiserver.kubectl("delete", "clusterrole", cluster_role)
    try:
        op.start()
        create_job(apiserver, namespace, "no-access")
        status = wait_for(
            lambda: get_job(apiserver, namespace, "no-access").get("status") or None,
            timeout=30,
            what="a status",
            describe=op.logs,
        )
        assert status["phase"] == "Pending", status
        (waiting,) = [c for c in status["conditions"] if c["reason"] == "WaitingForTrainerAccess"]
        assert f"ClusterRole {cluster_role} missing" in status["message"], status
        assert f'"{cluster_role}" not found' in waiting["message"], waiting
        assert jobsets(apiserver, namespace) == []
        chart_identity(apiserver, namespace, tmp_path / "operator.kubeconfig")
        wait_for(lambda: jobsets(apiserver, namespace), timeout=60, describe=op.logs)
        made = apiserver.get("rolebinding", TRAINER, namespace)
        assert made["roleRef"]["name"] == cluster_role
    finally:
        op.stop()
        drop_chart_identity(apiserver, namespace)


def test_leftover_of_an_earlier_job_is_waited_for(
    apiserver: Cluster, namespace: str, operator: OperatorProcess
):
    # A JobSet of a deleted job of the same name (the garbage collector has not removed
    # it yet; this tier runs no garbage collector) is neither used nor a failure.
    leftover = foreign_jobset("again")
    leftover["metadata"]["ownerReferences"] = [
        {
            "apiVersion": f"{GROUP}/{VERSION}",
            "kind": "PostTrainJob",
            "name": "again",
            "uid": "00000000-0000-0000-0000-000000000001",
        }
    ]
    apiserver.apply(leftover, namespace)
    create_job(apiserver, namespace, "again")
    wait_for(lambda: phase(apiserver, namespace, "again") == "Pending", timeout=30)
    assert (
        "waiting for the garbage collector to delete JobSet again"
        in (get_job(apiserver, namespace, "again")["status"]["message"])
    )
    time.sleep(3)
    (still,) = jobsets(apiserver, namespace)
    assert (
        still["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]["containers"][0][
            "image"
        ]
        == "attacker"
    )
    apiserver.kubectl("delete", "jobset", "again", "-n", namespace)
    uid = get_job(apiserver, namespace, "again")["metadata"]["uid"]
    wait_for(
        lambda: [j for j in jobsets(apiserver, namespace) if uid in str(j["metadata"])],
        timeout=30,
    )


def throttled(apiserver: Cluster) -> float:
    """How many requests the API server has answered 429 since it started."""
    response = apiserver.api_client.call_api(
        "GET", apiserver.api_client.configuration.host + "/metrics"
    )
    response.read()
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in response.data.decode().splitlines()
        if line.startswith("apiserver_request_total{") and 'code="429"' in line
    )


def test_throttling_api_server_loses_no_job(apiserver: Cluster, namespace: str, tmp_path):
    """With the API server answering 429 (too many requests) to a share of requests,
    every job still gets its JobSet and its status: the operator retries with backoff.
    The operator runs as the Helm chart's ServiceAccount: the server never throttles
    system:masters, the tests' own identity."""
    from concurrent.futures import ThreadPoolExecutor

    from tests.cluster import control_plane

    def restart(*flags: str) -> None:
        control_plane._stop("kube-apiserver")
        control_plane._start_apiserver(control_plane.State.load(), flags)

    op = chart_operator(apiserver, namespace, tmp_path)
    restart("--max-requests-inflight=2", "--max-mutating-requests-inflight=1")
    names = [f"busy-{i:02d}" for i in range(40)]
    try:
        op.start()
        with ThreadPoolExecutor(8) as pool:
            list(pool.map(lambda name: create_job(apiserver, namespace, name), names))

        def all_reconciled() -> bool:
            items = apiserver.custom.list_namespaced_custom_object(
                GROUP, VERSION, namespace, PLURAL
            )["items"]
            return sum(bool((j.get("status") or {}).get("jobSetName")) for j in items) == 40

        wait_for(all_reconciled, timeout=180, interval=2, describe=op.logs)
        assert throttled(apiserver) > 0, "the API server answered no 429"
    finally:
        op.stop()
        restart()
        drop_chart_identity(apiserver, namespace)
    # Just restarted, the server answers 429 until its caches are filled again.
    listed = wait_for(lambda: jobsets(apiserver, namespace), timeout=60, what="a JobSet list")
    assert sorted(j["metadata"]["name"] for j in listed) == names
    for name in names:
        status = get_job(apiserver, namespace, name)["status"]
        assert status["phase"] == "Pending" and status["jobSetName"] == name
