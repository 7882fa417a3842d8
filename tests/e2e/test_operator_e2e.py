"""The operator on the full local cluster: real JobSet controller (with its webhooks),
kube-controller-manager, kube-scheduler and kwok fake TPU hosts.

The operator runs with the Helm chart's ServiceAccount and RBAC, nothing more.
kwok ends a trainer pod according to its image tag (scripts/control-plane/kwok-stages.yaml):
`slow` completes after a few seconds, `exit-1` crashes, `exit-65` is a user error.
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import pytest
from invalid_jobs import valid_job
from operator_process import OperatorProcess, chart_env, chart_identity, drop_chart_identity

from posttrain.controller.phase import refusal_is_final
from tests.cluster import Cluster, unique_name, wait_for

pytestmark = pytest.mark.e2e
GROUP, VERSION, PLURAL = "posttrain.dev", "v1alpha1", "posttrainjobs"


@pytest.fixture(scope="module")
def operator_identity(cluster: Cluster, tmp_path_factory) -> tuple[Path, str]:
    """The operator runs as the Helm chart's ServiceAccount, with the chart's RBAC only."""
    release_ns = cluster.create_namespace("posttrain-system")
    kubeconfig = chart_identity(
        cluster, release_ns, tmp_path_factory.mktemp("identity") / "operator.kubeconfig"
    )
    yield kubeconfig, release_ns
    drop_chart_identity(cluster, release_ns)
    cluster.delete_namespace(release_ns)


@pytest.fixture
def operator(cluster: Cluster, namespace: str, operator_identity, tmp_path):
    kubeconfig, release_ns = operator_identity
    op = OperatorProcess(kubeconfig, tmp_path, release_ns, "-n", namespace)
    op.env.update(chart_env(release_ns))
    op.start()
    yield op
    op.stop()
    assert "Forbidden" not in op.logs() and " 403" not in op.logs(), op.logs()


def tpu_job(cluster: Cluster, namespace: str, name: str, image: str, **scheduling) -> dict:
    doc = valid_job(name)
    doc["spec"]["image"] = image
    doc["spec"]["resources"] = {"accelerator": "v6e-8"}  # 2 hosts of 4 chips, topology 2x4
    doc["spec"]["scheduling"] = {"maxRestarts": 2, **scheduling}
    return cluster.custom.create_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, doc)


def status(cluster: Cluster, namespace: str, name: str) -> dict:
    return (
        cluster.custom.get_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, name).get(
            "status"
        )
        or {}
    )


def wait_failed(cluster: Cluster, namespace: str, name: str, timeout: int) -> tuple[dict, dict]:
    """Waits for the job's Failed condition; returns its status and that condition."""
    cluster.kubectl(
        "wait", "--for=condition=Failed", f"ptj/{name}", "-n", namespace, f"--timeout={timeout}s"
    )
    st = status(cluster, namespace, name)
    return st, {c["type"]: c for c in st["conditions"]}["Failed"]


def reasons(cluster: Cluster, namespace: str, name: str) -> list[str]:
    items = cluster.core.list_namespaced_event(
        namespace, field_selector=f"involvedObject.name={name}"
    ).items
    # creationTimestamp has one-second resolution; the resourceVersion orders creation.
    return [e.reason for e in sorted(items, key=lambda e: int(e.metadata.resource_version))]


def pods(cluster: Cluster, namespace: str) -> list:
    return cluster.core.list_namespaced_pod(namespace).items


def wait_phase(
    cluster: Cluster,
    namespace: str,
    name: str,
    phase: str,
    *,
    timeout: int = 60,
    describe: str | None = None,
) -> None:
    """Waits until the job's status.phase is `phase`. With `describe` (kinds), a
    timeout's message carries `kubectl get <describe>` of the namespace."""
    wait_for(
        lambda: status(cluster, namespace, name).get("phase") == phase,
        timeout=timeout,
        describe=(lambda: cluster.describe(namespace, describe)) if describe else None,
    )


def set_suspend(cluster: Cluster, namespace: str, name: str, suspend: bool) -> None:
    """Sets the job's spec.scheduling.suspend, as a user does (kubectl patch)."""
    patch = '{"spec":{"scheduling":{"suspend":%s}}}' % ("true" if suspend else "false")
    cluster.kubectl("patch", "ptj", name, "-n", namespace, "--type=merge", "-p", patch)


def wait_pods_removed(cluster: Cluster, namespace: str, timeout: int) -> None:
    """Waits until no pod of the namespace is left that is not being deleted."""
    wait_for(
        lambda: not [p for p in pods(cluster, namespace) if not p.metadata.deletion_timestamp],
        timeout=timeout,
        what="pods removed while suspended",
    )


def test_job_runs_to_success_and_deletion_cleans_up(cluster: Cluster, namespace: str, operator):
    tpu_job(cluster, namespace, "happy", "posttrain-trainer:slow")
    wait_phase(
        cluster, namespace, "happy", "Running", timeout=90, describe="jobsets,jobs,pods,events"
    )
    placed = {p.spec.node_name for p in pods(cluster, namespace)}
    assert len(placed) == 2 and all(n.startswith("tpu-v6e-2x4-") for n in placed)
    assert len({n.rsplit("-", 1)[0] for n in placed}) == 1  # one slice's node pool
    cluster.kubectl(
        "wait", "--for=condition=Succeeded", "ptj/happy", "-n", namespace, "--timeout=120s"
    )
    st = status(cluster, namespace, "happy")
    assert st["phase"] == "Succeeded" and st["restarts"] == 0 and st["completionTime"]

    # The Succeeded event may follow the status patch that `kubectl wait` saw.
    def succeeded_reported() -> list[str] | None:
        found = reasons(cluster, namespace, "happy")
        return found if "Succeeded" in found else None

    all_seen = wait_for(succeeded_reported, timeout=30, what="a Succeeded event")
    seen = [r for r in all_seen if r in ("Pending", "Running", "Succeeded")]
    # Two handlers may both report the first Pending; the order is what matters.
    transitions = [r for i, r in enumerate(seen) if i == 0 or seen[i - 1] != r]
    assert transitions == ["Pending", "Running", "Succeeded"], seen
    assert not {"JobCreationFailed", "PodCreationFailed"} & set(all_seen), all_seen
    cluster.kubectl("delete", "ptj", "happy", "-n", namespace)

    def gone() -> bool:
        js = cluster.kubectl(
            "get",
            "jobsets",
            "-n",
            namespace,
            "-l",
            "posttrain.dev/job-name=happy",
            "-o",
            "name",
        ).stdout
        return js.strip() == ""

    wait_for(gone, timeout=90, what="garbage collection of the job's JobSet")


def test_crashing_job_restarts_then_fails(cluster: Cluster, namespace: str, operator):
    tpu_job(cluster, namespace, "crashy", "posttrain-trainer:exit-1")
    st, failed = wait_failed(cluster, namespace, "crashy", 240)
    assert st["restarts"] == 2
    assert failed["status"] == "True" and failed["reason"] and failed["message"]
    assert "Restarting" in reasons(cluster, namespace, "crashy") or st["restarts"] == 2
    assert failed["reason"] not in {"JobCreationFailed", "PodCreationFailed"}, failed
    # Restarts recreate Jobs and pods: the controllers' steps on the way are no refusals
    # (a restart's new Job waits for the one before it to be gone). On a loaded machine
    # the API server may answer a create late; the operator may then say that the JobSet
    # controller retries, never that the job is refused.
    events = cluster.core.list_namespaced_event(
        namespace, field_selector="involvedObject.name=crashy"
    ).items
    refusals = {"JobCreationFailed", "PodCreationFailed"}
    mine = [(e.reason, e.message) for e in events if e.involved_object.kind == "PostTrainJob"]
    said = [m for reason, m in mine if reason in refusals]
    assert all("retries" in m and " already exists" not in m for m in said), mine
    theirs = [e.message for e in events if e.involved_object.kind != "PostTrainJob"
              and e.reason in refusals]  # fmt: skip
    assert all(" already exists" in m or not refusal_is_final(m) for m in theirs), theirs


def test_user_error_fails_without_restarts(cluster: Cluster, namespace: str, operator):
    tpu_job(cluster, namespace, "baddata", "posttrain-trainer:exit-65")
    st, failed = wait_failed(cluster, namespace, "baddata", 120)
    assert st["restarts"] == 0
    assert failed["reason"] == "InvalidInput" and "exited with code 65" in failed["message"], failed


def test_suspend_and_resume(cluster: Cluster, namespace: str, operator):
    tpu_job(cluster, namespace, "pause", "posttrain-trainer:slow")
    wait_phase(cluster, namespace, "pause", "Running", timeout=90)
    set_suspend(cluster, namespace, "pause", True)
    wait_phase(cluster, namespace, "pause", "Suspended")
    wait_pods_removed(cluster, namespace, 60)
    set_suspend(cluster, namespace, "pause", False)
    cluster.kubectl(
        "wait", "--for=condition=Succeeded", "ptj/pause", "-n", namespace, "--timeout=120s"
    )
    assert {"Suspending", "Resuming"} <= set(reasons(cluster, namespace, "pause"))


def test_kueue_queue_holds_job_until_admitted(cluster: Cluster, namespace: str, operator):
    queue = cluster.tpu_queue(namespace, "tpu", chips=0)  # nothing fits until the quota grows
    cq = queue[1]["metadata"]["name"]
    try:
        tpu_job(cluster, namespace, "queued", "posttrain-trainer:slow", queue="tpu")
        wait_phase(cluster, namespace, "queued", "Queued", describe="jobsets,workloads,pods,events")
        # Kueue's own word on why (zero quota), in plain `kubectl get ptj`.
        row = wait_row(cluster, namespace, "queued", "insufficient quota", kinds="workloads")
        # ... and its place in the queue, from Kueue's visibility API.
        assert "Queued" in row and "Kueue queue 'tpu', position 1: couldn't assign" in row, row
        assert "google.com/tpu" in row, row
        assert pods(cluster, namespace) == []
        cluster.kubectl(
            "patch",
            "clusterqueue",
            cq,
            "--type=json",
            "-p",
            '[{"op":"replace","path":"/spec/resourceGroups/0/flavors/0/resources/0/nominalQuota","value":8}]',
        )
        cluster.kubectl(
            "wait", "--for=condition=Succeeded", "ptj/queued", "-n", namespace, "--timeout=180s"
        )
        wait_for(
            lambda: (
                {"Queued", "Running", "Succeeded"} <= set(reasons(cluster, namespace, "queued"))
            ),
            timeout=30,
            what="Queued, Running and Succeeded events",
        )
    finally:
        cluster.kubectl("delete", "ptj", "--all", "-n", namespace, "--wait=true", check=False)
        cluster.delete_all(queue)


def get_row(cluster: Cluster, namespace: str, name: str) -> str:
    """The job's line in plain `kubectl get ptj` (its columns as a user sees them)."""
    out = cluster.kubectl("get", "ptj", name, "-n", namespace).stdout
    header, row = out.splitlines()
    assert header.split()[-1] == "MESSAGE", header
    return row


def wait_row(
    cluster: Cluster,
    namespace: str,
    name: str,
    *texts: str,
    timeout: int = 60,
    kinds: str = "jobsets,jobs,pods,events",
) -> str:
    """Waits until the job's `kubectl get ptj` row holds every one of `texts`; returns the
    row. A timeout's message carries `kubectl get <kinds>` of the namespace."""
    return wait_for(
        lambda: (r := get_row(cluster, namespace, name)) and all(t in r for t in texts) and r,
        timeout=timeout,
        describe=lambda: cluster.describe(namespace, kinds),
    )


def test_accelerator_without_nodes_says_why(cluster: Cluster, namespace: str, operator):
    doc = valid_job("nowhere")
    doc["spec"]["image"] = "posttrain-trainer:slow"
    doc["spec"]["resources"] = {"accelerator": "v5p-16"}  # no v5p nodes in this cluster
    cluster.custom.create_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, doc)
    row = wait_row(cluster, namespace, "nowhere", "nodes are available")
    fields = row.split()
    assert fields[4] == "Pending", row
    assert "didn't match Pod's node affinity/selector" in row and "preemption" not in row, row
    st = status(cluster, namespace, "nowhere")
    running = {c["type"]: c for c in st["conditions"]}["Running"]
    assert running["status"] == "False" and running["reason"] == "Unschedulable", running
    # The events tell the story in order, and say why.
    seen = wait_for(
        lambda: (r := reasons(cluster, namespace, "nowhere")) and "Unschedulable" in r and r,
        timeout=30,
    )
    assert "Running" not in seen, seen
    assert seen.index("Pending") < seen.index("Unschedulable")
    time.sleep(3)
    assert status(cluster, namespace, "nowhere")["phase"] == "Pending"


def test_missing_local_queue_says_so(cluster: Cluster, namespace: str, operator):
    tpu_job(cluster, namespace, "orphan", "posttrain-trainer:slow", queue="no-such-queue")
    row = wait_row(
        cluster,
        namespace,
        "orphan",
        "no-such-queue",
        "exist",
        kinds="jobsets,workloads,pods,events",
    )
    assert row.split()[4] == "Queued", row
    assert "LocalQueue no-such-queue doesn't exist" in row, row
    queued = {c["type"]: c for c in status(cluster, namespace, "orphan")["conditions"]}["Queued"]
    assert queued["status"] == "True" and queued["reason"] == "Inadmissible", queued
    assert pods(cluster, namespace) == []


def test_oom_killed_trainer_is_named_with_its_memory(cluster: Cluster, namespace: str, operator):
    # kwok ends a `posttrain-trainer:oom` container as the kernel would: OOMKilled, 137.
    doc = valid_job("hungry")
    doc["spec"]["image"] = "posttrain-trainer:oom"
    doc["spec"]["resources"] = {"accelerator": "v6e-8", "memory": "1Gi"}
    doc["spec"]["scheduling"] = {"maxRestarts": 1}
    cluster.custom.create_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, doc)
    _, failed = wait_failed(cluster, namespace, "hungry", 180)
    assert failed["reason"] == "OOMKilled", failed
    row = get_row(cluster, namespace, "hungry")
    assert row.split()[4] == "Failed", row
    assert "container trainer of pod hungry-slice-0-" in row, row
    assert "was killed for using more memory than the node's memory" in row, row
    # The row shows the first 200 characters; the condition has the whole message.
    assert "(no memory limit; it requested 1Gi)" in failed["message"], failed
    assert "reaching max number of restarts" in failed["message"], failed
    assert "OOMKilled" in reasons(cluster, namespace, "hungry")


def test_suspend_while_queued_then_resume(cluster: Cluster, namespace: str, operator):
    """A user's suspend wins over Kueue's; a resume before admission is Queued again at
    once (no Pending in between), and admission then runs it."""
    queue = cluster.tpu_queue(namespace, "tpu", chips=0)
    cq = queue[1]["metadata"]["name"]
    try:
        tpu_job(cluster, namespace, "held", "posttrain-trainer:slow", queue="tpu")
        wait_phase(cluster, namespace, "held", "Queued")
        set_suspend(cluster, namespace, "held", True)
        wait_phase(cluster, namespace, "held", "Suspended", timeout=30)
        assert pods(cluster, namespace) == []
        set_suspend(cluster, namespace, "held", False)
        wait_phase(cluster, namespace, "held", "Queued", timeout=30)
        time.sleep(3)
        assert status(cluster, namespace, "held")["phase"] == "Queued"
        cluster.kubectl(
            "patch", "clusterqueue", cq, "--type=json", "-p",
            '[{"op":"replace","path":"/spec/resourceGroups/0/flavors/0/resources/0/nominalQuota","value":8}]',
        )  # fmt: skip
        cluster.kubectl(
            "wait", "--for=condition=Succeeded", "ptj/held", "-n", namespace, "--timeout=180s"
        )
        seen = wait_for(
            lambda: (r := reasons(cluster, namespace, "held")) and "Succeeded" in r and r,
            timeout=30,
        )
        phases = [
            r for r in seen if r in ("Pending", "Queued", "Running", "Suspended", "Succeeded")
        ]
        after_suspend = phases[phases.index("Suspended") :]
        assert after_suspend[:2] == ["Suspended", "Queued"], phases
        assert "Pending" not in phases[: phases.index("Suspended")], phases
    finally:
        cluster.kubectl("delete", "ptj", "--all", "-n", namespace, "--wait=true", check=False)
        cluster.delete_all(queue)


def test_missing_priority_class_says_so(cluster: Cluster, namespace: str, operator):
    """Kueue makes no Workload (and no Event) for a JobSet whose WorkloadPriorityClass
    does not exist; the job says which class, in Kueue's words (here no admission webhook
    refuses the job first). Outside Kueue, a missing PriorityClass is said the same way."""
    queue = cluster.tpu_queue(namespace, "tpu")
    try:
        tpu_job(
            cluster, namespace, "classless", "posttrain-trainer:slow",
            queue="tpu", workloadPriorityClass="no-such-class",
        )  # fmt: skip
        row = wait_row(
            cluster,
            namespace,
            "classless",
            "not found",
            timeout=30,
            kinds="jobsets,workloads,pods,events",
        )
        assert row.split()[4] == "Queued", row
        assert (
            "Kueue queue 'tpu': WorkloadPriorityClass.kueue.x-k8s.io \"no-such-class\" not found: "
            "Kueue makes no Workload until it exists (spec.scheduling.workloadPriorityClass)"
        ) in row, row
        queued = {c["type"]: c for c in status(cluster, namespace, "classless")["conditions"]}
        assert queued["Queued"]["reason"] == "PriorityClassNotFound", queued
        assert "PriorityClassNotFound" in wait_for(
            lambda: reasons(cluster, namespace, "classless"), timeout=10
        )
        workloads = cluster.kubectl("get", "workloads", "-n", namespace, "-o", "name").stdout
        assert workloads.strip() == "" and pods(cluster, namespace) == []
        # Outside Kueue the Job controller creates no pod (the API server refuses each) and
        # says so only in the Jobs' Events: the job waits, naming the class.
        tpu_job(
            cluster, namespace, "unclassed", "posttrain-trainer:slow",
            priorityClass=f"{namespace}-none",
        )  # fmt: skip
        row = wait_row(cluster, namespace, "unclassed", "not found", timeout=30)
        assert row.split()[4] == "Pending", row
        assert (
            f'PriorityClass.scheduling.k8s.io "{namespace}-none" not found: the Job '
            "controller creates no pods"
        ) in status(cluster, namespace, "unclassed")["message"]
        assert pods(cluster, namespace) == []
    finally:
        cluster.kubectl("delete", "ptj", "--all", "-n", namespace, "--wait=true", check=False)
        cluster.delete_all(queue)


def test_image_that_cannot_be_pulled_is_named(cluster: Cluster, namespace: str, operator):
    """kwok answers `posttrain-trainer:no-such-tag` as a v1.36 kubelet does: ErrImagePull,
    then ImagePullBackOff wrapping the pull's error, and again. The job names the image
    and the pull's error, and stays still while the kubelet alternates."""
    tpu_job(cluster, namespace, "nopull", "posttrain-trainer:no-such-tag")
    try:
        row = wait_row(cluster, namespace, "nopull", "cannot pull")
        assert row.split()[4] == "Pending", row
        assert "container trainer of pod nopull-slice-0-" in row, row
        assert (
            "cannot pull image 'posttrain-trainer:no-such-tag': rpc error: code = NotFound" in row
        )
        seen, statuses, both = set(), set(), {"ErrImagePull", "ImagePullBackOff"}
        deadline = time.monotonic() + 6
        while time.monotonic() < deadline or not both <= seen:
            assert time.monotonic() < deadline + 20, seen
            seen |= {
                cs.state.waiting.reason
                for p in pods(cluster, namespace)
                for cs in p.status.container_statuses or []
                if cs.state.waiting
            }
            st = status(cluster, namespace, "nopull")
            running = {c["type"]: c for c in st["conditions"]}["Running"]
            statuses.add((st["phase"], st["message"], running["reason"]))
            time.sleep(0.3)
        assert len(statuses) == 1 and statuses.pop()[2] == "ErrImagePull", statuses
        assert reasons(cluster, namespace, "nopull").count("ErrImagePull") == 1
    finally:  # its pods hold a slice until they go
        cluster.kubectl("delete", "ptj", "--all", "-n", namespace, "--wait=true", check=False)


def test_inactive_cluster_queue_says_why(cluster: Cluster, namespace: str, operator):
    """A ClusterQueue naming a ResourceFlavor that does not exist is inactive: the job
    says so with the ClusterQueue's own reason (its Workload only says 'inactive')."""
    cq, flavor = unique_name("inactive-cq", 20), unique_name("no-such-flavor", 24)
    quota = {"name": "google.com/tpu", "nominalQuota": 8}
    group = {
        "coveredResources": ["google.com/tpu"],
        "flavors": [{"name": flavor, "resources": [quota]}],
    }
    kueue = "kueue.x-k8s.io/v1beta2"
    objects = [
        {"apiVersion": kueue, "kind": "ClusterQueue", "metadata": {"name": cq},
         "spec": {"namespaceSelector": {}, "resourceGroups": [group]}},
        {"apiVersion": kueue, "kind": "LocalQueue", "metadata": {"name": "tpu", "namespace": namespace},
         "spec": {"clusterQueue": cq}},
    ]  # fmt: skip
    cluster.apply(objects)
    try:
        tpu_job(cluster, namespace, "stuck", "posttrain-trainer:slow", queue="tpu")
        row = wait_row(
            cluster, namespace, "stuck", "missing", kinds="jobsets,workloads,pods,events"
        )
        assert row.split()[4] == "Queued", row
        assert (
            f"Kueue queue 'tpu': ClusterQueue {cq} is inactive: Can't admit new workloads: "
            f"references missing ResourceFlavor(s): {flavor}."
        ) in row, row
        assert pods(cluster, namespace) == []
    finally:
        cluster.kubectl("delete", "ptj", "--all", "-n", namespace, "--wait=true", check=False)
        cluster.delete_all(objects)


class PhaseWatch:
    """Every phase a job's status passes through, in order, from a watch of the job (a
    poll could miss a short one)."""

    def __init__(self, cluster: Cluster, namespace: str, name: str):
        from kubernetes import client, config

        api = config.new_client_from_config(config_file=str(cluster.kubeconfig))
        self.custom, self.api = client.CustomObjectsApi(api), api
        self.namespace, self.name = namespace, name
        self.phases: list[str] = []
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        from kubernetes import watch

        version = None
        while not self.done.is_set():
            stream = watch.Watch().stream(
                self.custom.list_namespaced_custom_object, GROUP, VERSION, self.namespace,
                PLURAL, field_selector=f"metadata.name={self.name}", timeout_seconds=2,
                **({"resource_version": version} if version else {}),
            )  # fmt: skip
            for event in stream:
                body = event["object"]
                version = body["metadata"]["resourceVersion"]
                phase = (body.get("status") or {}).get("phase")
                if phase and (not self.phases or self.phases[-1] != phase):
                    self.phases.append(phase)

    def stop(self) -> list[str]:
        self.done.set()
        self.thread.join(10)
        self.api.close()
        return self.phases


def is_subsequence(seen: list[str], of: list[str]) -> bool:
    rest = iter(of)
    return all(p in rest for p in seen)


def test_suspend_while_running_on_kueue_then_resume(cluster: Cluster, namespace: str, operator):
    """A user's suspend of a job Kueue admitted and that runs: Suspended (its pods go,
    Kueue gives its quota back); resume: Queued until Kueue admits it again, then
    Pending and Running. Every phase the job passes through is in that order, none twice
    in a row of flips."""
    queue = cluster.tpu_queue(namespace, "tpu", chips=8)
    watch = PhaseWatch(cluster, namespace, "pausing")
    try:
        tpu_job(cluster, namespace, "pausing", "posttrain-trainer:long", queue="tpu")
        wait_phase(
            cluster, namespace, "pausing", "Running", describe="posttrainjobs,workloads,pods"
        )
        set_suspend(cluster, namespace, "pausing", True)
        wait_phase(cluster, namespace, "pausing", "Suspended", timeout=30)
        wait_pods_removed(cluster, namespace, 30)
        row = get_row(cluster, namespace, "pausing")
        assert row.split()[4] == "Suspended" and "suspended by spec.scheduling.suspend" in row
        set_suspend(cluster, namespace, "pausing", False)
        wait_phase(cluster, namespace, "pausing", "Running")
        time.sleep(2)  # nothing moves it from Running now
        seen = watch.stop()
    finally:
        watch.stop()
        cluster.kubectl("delete", "ptj", "--all", "-n", namespace, "--wait=true", check=False)
        cluster.delete_all(queue)
    expected = ["Pending", "Queued", "Pending", "Running", "Suspended", "Queued", "Pending"]
    assert is_subsequence(seen, [*expected, "Running"]), " ".join(seen)  # once each, in order
    first_run = seen.index("Running")
    assert seen[first_run : first_run + 2] == ["Running", "Suspended"], seen
    assert seen[-1] == "Running", seen


def test_queued_jobs_show_their_position(cluster: Cluster, namespace: str, operator):
    """Two jobs waiting for quota: each row says its place in the queue, from Kueue's
    visibility API (read per LocalQueue, not per job: tests/unit/test_watches.py)."""
    queue = cluster.tpu_queue(namespace, "tpu", chips=0)
    try:
        tpu_job(cluster, namespace, "first", "posttrain-trainer:slow", queue="tpu")
        # Kueue orders equal priorities by their Workloads' creation times, in whole
        # seconds: the second job's comes over a second after the first's.
        wait_for(
            lambda: cluster.kubectl("get", "workloads", "-n", namespace, "-o", "name").stdout,
            timeout=30,
            what="the first job's Workload",
        )
        time.sleep(1.1)
        tpu_job(cluster, namespace, "second", "posttrain-trainer:slow", queue="tpu")
        first = wait_row(
            cluster, namespace, "first", "position 1:", kinds="posttrainjobs,workloads"
        )
        assert first.split()[4] == "Queued", first
        assert "Kueue queue 'tpu', position 1: couldn't assign flavors" in first, first
        assert "insufficient quota for google.com/tpu" in first, first
        # Kueue tries only the head of the queue: the second job has no word from Kueue
        # but its place.
        second = wait_row(
            cluster, namespace, "second", "position 2", kinds="posttrainjobs,workloads"
        )
        assert second.split()[4] == "Queued", second
        assert second.endswith("Kueue queue 'tpu', position 2"), second
    finally:
        cluster.kubectl("delete", "ptj", "--all", "-n", namespace, "--wait=true", check=False)
        cluster.delete_all(queue)


def deadline_policy(namespace: str, resource: str = "jobs") -> list[dict]:
    """A cluster's rule, as admins write them: a ValidatingAdmissionPolicy (bound to
    `namespace` only) that refuses Jobs (or pods) without spec.activeDeadlineSeconds. The
    JobSet passes its webhook and posttrain's checks; each of its Jobs (pods) is refused."""
    name = f"{namespace}-{resource}-deadline"
    group = "batch" if resource == "jobs" else ""
    policy = {
        "apiVersion": "admissionregistration.k8s.io/v1",
        "kind": "ValidatingAdmissionPolicy",
        "metadata": {"name": name},
        "spec": {
            "failurePolicy": "Fail",
            "matchConstraints": {"resourceRules": [
                {"apiGroups": [group], "apiVersions": ["v1"], "operations": ["CREATE"],
                 "resources": [resource]}]},
            "validations": [{"expression": "has(object.spec.activeDeadlineSeconds)",
                             "message": f"{resource.title()} need spec.activeDeadlineSeconds"}],
        },
    }  # fmt: skip
    binding = {
        "apiVersion": "admissionregistration.k8s.io/v1",
        "kind": "ValidatingAdmissionPolicyBinding",
        "metadata": {"name": name},
        "spec": {
            "policyName": name,
            "validationActions": ["Deny"],
            "matchResources": {"namespaceSelector": {
                "matchLabels": {"kubernetes.io/metadata.name": namespace}}},
        },
    }  # fmt: skip
    return [policy, binding]


def enforce(cluster: Cluster, namespace: str, policy: list[dict]) -> None:
    """Applies ``deadline_policy``'s objects and waits until the API server enforces them:
    a bare Job (pod) created in `namespace` with a server-side dry run is refused. A new
    policy takes the API server a moment to load, longer on a busy machine."""
    cluster.apply(policy)
    resource = policy[0]["spec"]["matchConstraints"]["resourceRules"][0]["resources"][0]
    container = {"name": "c", "image": "probe"}
    pod_spec = {"containers": [container], "restartPolicy": "Never"}
    probe = (
        {"apiVersion": "batch/v1", "kind": "Job", "metadata": {"name": "probe"},
         "spec": {"template": {"spec": pod_spec}}}
        if resource == "jobs"
        else {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "probe"}, "spec": pod_spec}
    )  # fmt: skip

    def refused() -> bool:
        proc = cluster.kubectl("create", "--dry-run=server", "-n", namespace, "-f", "-",
                               input=json.dumps(probe), check=False)  # fmt: skip
        return proc.returncode != 0 and "need spec.activeDeadlineSeconds" in proc.stderr

    wait_for(refused, timeout=60, what=f"the API server to enforce {policy[0]['metadata']['name']}")


def jobs_of(cluster: Cluster, namespace: str, jobset: str, kind: str = "jobs") -> list[dict]:
    """The JobSet's Jobs (or pods), by the label the JobSet controller gives them."""
    label = f"jobset.sigs.k8s.io/jobset-name={jobset}"
    out = cluster.kubectl("get", kind, "-n", namespace, "-l", label, "-o", "json").stdout
    return json.loads(out)["items"]


def wait_stopped(cluster: Cluster, namespace: str, name: str) -> None:
    """Waits until the failed job's JobSet is suspended, and each Job it has made too
    (the Job controller makes no pod for a suspended Job), with the job's Event."""
    wait_for(
        lambda: (
            cluster.get_jobset(name, namespace)["spec"].get("suspend") is True
            and all(j["spec"].get("suspend") for j in jobs_of(cluster, namespace, name))
            and "JobSetSuspended" in reasons(cluster, namespace, name)
        ),
        timeout=30,
        describe=lambda: cluster.describe(namespace, "jobsets,jobs,workloads,pods,events"),
    )


def test_jobs_the_api_server_refuses_fail_or_wait_in_its_words(
    cluster: Cluster, namespace: str, operator
):
    """The API server refusing a JobSet's Jobs shows only as the JobSet controller's
    JobCreationFailed Events (it retries for ever): a quota that passes with time keeps
    the job Pending with the refusal said, and it runs once the quota allows; a rule
    that stays (a ValidatingAdmissionPolicy) fails the job in the API server's words,
    and its JobSet is suspended: once the rule is gone, its Jobs are made suspended and
    make no pod. Nothing of the job's Secret reaches its status, its Events or the
    operator's log."""
    token = "hf_e2e_SECRET_VALUE"
    cluster.core.create_namespaced_secret(
        namespace, {"metadata": {"name": "hf"}, "stringData": {"token": token}}
    )
    quota = {"apiVersion": "v1", "kind": "ResourceQuota",
             "metadata": {"name": "jobs", "namespace": namespace},
             "spec": {"hard": {"count/jobs.batch": "0"}}}  # fmt: skip
    cluster.apply(quota)
    doc = valid_job("quota")
    doc["spec"] |= {"image": "posttrain-trainer:slow", "hfTokenSecret": {"name": "hf"}}
    cluster.custom.create_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, doc)
    row = wait_row(cluster, namespace, "quota", "exceeded quota", timeout=60)
    assert row.split()[4] == "Pending", row
    waiting = {c["type"]: c for c in status(cluster, namespace, "quota")["conditions"]}["Running"]
    assert waiting["reason"] == "JobCreationFailed", waiting
    assert "the JobSet controller retries" in waiting["message"], waiting
    assert "limited: count/jobs.batch=0" in waiting["message"], waiting
    quota["spec"]["hard"]["count/jobs.batch"] = "10"
    cluster.apply(quota)
    wait_phase(cluster, namespace, "quota", "Running", timeout=90, describe="jobsets,jobs,events")
    cluster.kubectl("delete", "resourcequota", "jobs", "-n", namespace)

    policy = deadline_policy(namespace)
    try:
        enforce(cluster, namespace, policy)
        doc = valid_job("ruled")
        doc["spec"] |= {"image": "posttrain-trainer:slow", "hfTokenSecret": {"name": "hf"}}
        cluster.custom.create_namespaced_custom_object(GROUP, VERSION, namespace, PLURAL, doc)
        st, failed = wait_failed(cluster, namespace, "ruled", timeout=120)
        assert failed["reason"] == "JobCreationFailed", failed
        assert (
            "ValidatingAdmissionPolicy" in failed["message"]
            and "denied request: Jobs need spec.activeDeadlineSeconds" in failed["message"]
        ), failed
        assert st["message"].startswith("the API server refuses the JobSet's Job ruled-"), st
        assert "JobCreationFailed" in wait_for(
            lambda: reasons(cluster, namespace, "ruled"), timeout=10
        )
        wait_stopped(cluster, namespace, "ruled")
    finally:
        cluster.delete_all(policy)
    # The JobSet controller makes the Jobs at its next retry (its back-off about doubles
    # the time since the JobSet was made): suspended as their JobSet, so no pod.
    made = wait_for(
        lambda: jobs_of(cluster, namespace, "ruled"),
        timeout=120,
        describe=lambda: cluster.describe(namespace, "jobsets,jobs,events"),
    )
    assert all(j["spec"]["suspend"] for j in made), made
    assert jobs_of(cluster, namespace, "ruled", "pods") == []
    assert status(cluster, namespace, "ruled")["phase"] == "Failed"
    for name in ("quota", "ruled"):
        said = str(status(cluster, namespace, name)) + " ".join(
            e.message or "" for e in cluster.core.list_namespaced_event(namespace).items
        )
        assert token not in said
    assert token not in operator.logs()


def test_pods_the_api_server_refuses_fail_or_wait_in_its_words(
    cluster: Cluster, namespace: str, operator
):
    """The API server refusing a Job's pods shows only as the Job controller's
    FailedCreate Events: a ResourceQuota keeps the job Pending with the refusal said
    until the quota allows the pods; a LimitRange's maximum fails it in its words, and
    its JobSet and Jobs are suspended (no more pods are asked for). Under Kueue, whose
    Workload was admitted for the pods to be asked for at all, the failed job's Workload
    is deactivated and its quota given back."""
    quota = {"apiVersion": "v1", "kind": "ResourceQuota",
             "metadata": {"name": "pods", "namespace": namespace},
             "spec": {"hard": {"pods": "1"}}}  # fmt: skip
    cluster.apply(quota)
    tpu_job(cluster, namespace, "squeezed", "posttrain-trainer:slow")  # 2 hosts: 2 pods
    row = wait_row(cluster, namespace, "squeezed", "exceeded quota", timeout=60)
    assert row.split()[4] == "Pending", row
    waiting = {c["type"]: c for c in status(cluster, namespace, "squeezed")["conditions"]}
    assert waiting["Running"]["reason"] == "PodCreationFailed", waiting
    assert "(the Job controller retries)" in waiting["Running"]["message"], waiting
    assert "limited: pods=1" in waiting["Running"]["message"], waiting
    quota["spec"]["hard"]["pods"] = "10"
    cluster.apply(quota)
    wait_for(  # the slow trainer may finish before a reconcile sees it run
        lambda: status(cluster, namespace, "squeezed").get("phase") in ("Running", "Succeeded"),
        timeout=90,
        describe=lambda: cluster.describe(namespace, "jobs,pods,events"),
    )
    cluster.kubectl("delete", "ptj", "squeezed", "-n", namespace, "--wait=true")
    limits = {"apiVersion": "v1", "kind": "LimitRange",
              "metadata": {"name": "tpus", "namespace": namespace},
              "spec": {"limits": [{"type": "Container", "max": {"google.com/tpu": "1"}}]}}  # fmt: skip
    cluster.apply(limits)
    tpu_job(cluster, namespace, "limited", "posttrain-trainer:slow")
    st, failed = wait_failed(cluster, namespace, "limited", timeout=60)
    assert failed["reason"] == "PodCreationFailed", failed
    assert "maximum google.com/tpu usage per Container is 1" in failed["message"], failed
    assert st["message"].startswith("the API server refuses the Jobs' pods: "), st
    wait_stopped(cluster, namespace, "limited")
    cluster.kubectl("delete", "limitrange", "tpus", "-n", namespace)  # Kueue checks them

    queue = cluster.tpu_queue(namespace, "tpu", chips=8)
    cq = queue[1]["metadata"]["name"]
    policy = deadline_policy(namespace, "pods")

    def released() -> bool:
        (workload,) = [
            w
            for w in json.loads(
                cluster.kubectl("get", "workloads", "-n", namespace, "-o", "json").stdout
            )["items"]
            if any(o["name"] == "admitted" for o in w["metadata"].get("ownerReferences") or [])
        ]
        usage = cluster.get("clusterqueue", cq).get("status") or {}
        return (
            workload["spec"].get("active") is False
            and usage.get("reservingWorkloads") == 0
            and usage.get("admittedWorkloads") == 0
        )

    try:
        enforce(cluster, namespace, policy)
        tpu_job(cluster, namespace, "admitted", "posttrain-trainer:slow", queue="tpu")
        st, failed = wait_failed(cluster, namespace, "admitted", timeout=90)
        assert failed["reason"] == "PodCreationFailed", failed
        assert "denied request: Pods need spec.activeDeadlineSeconds" in failed["message"]
        wait_stopped(cluster, namespace, "admitted")
        wait_for(
            released,
            timeout=60,
            what="the failed job's Workload deactivated and its quota given back",
            describe=lambda: cluster.describe(namespace, "workloads,jobsets,jobs,events"),
        )
        assert jobs_of(cluster, namespace, "admitted", "pods") == []
    finally:
        cluster.kubectl("delete", "ptj", "admitted", "-n", namespace, "--wait=true", check=False)
        cluster.delete_all([*queue, *policy])


def report(cluster: Cluster, namespace: str, name: str, step: int) -> None:
    """What the trainer's heartbeat writes (posttrain.trainer.progress): the phase and
    step it is at, with the time, in status.progress."""
    now = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    progress = {"phase": "training", "step": step, "totalSteps": 1000, "updatedAt": now}
    cluster.custom.patch_namespaced_custom_object_status(
        GROUP, VERSION, namespace, PLURAL, name, {"status": {"progress": progress}}
    )


def test_trainer_that_stops_reporting_is_restarted_then_failed(
    cluster: Cluster, namespace: str, operator
):
    """A trainer whose pods keep running but which reports no progress (a hung
    collective): past spec.scheduling.progressDeadlineSeconds the operator restarts its
    JobSet (counted against maxRestarts), and with no restart left fails the job, saying
    since when and where it stood; its JobSet stops."""
    name = "hung"
    watch = PhaseWatch(cluster, namespace, name)
    tpu_job(cluster, namespace, name, "posttrain-trainer:long",
            maxRestarts=1, progressDeadlineSeconds=3)  # fmt: skip
    wait_phase(cluster, namespace, name, "Running", timeout=90, describe="jobsets,jobs,pods")
    report(cluster, namespace, name, 5)  # then nothing more: it hangs

    def restarted() -> bool:
        st = status(cluster, namespace, name)
        return st.get("restarts") == 1 and st.get("phase") == "Running"

    wait_for(restarted, timeout=90, what="a restart of the hung job, running again",
             describe=lambda: cluster.describe(namespace, "jobsets,jobs,pods,events"))  # fmt: skip
    events = cluster.core.list_namespaced_event(
        namespace, field_selector=f"involvedObject.name={name},reason=ProgressDeadlineExceeded"
    ).items
    restart = [e.message for e in events if "restarting the JobSet" in e.message]
    assert restart and restart[0].startswith("no progress since "), restart
    assert "(last: step 5, training; deadline 3s" in restart[0], restart
    assert restart[0].endswith("restarting the JobSet (restart 1 of 1)"), restart
    # The Jobs of the first start were ended by their deadline, not by a crash.
    report(cluster, namespace, name, 7)  # the second start reports once, then hangs too
    st, failed = wait_failed(cluster, namespace, name, 60)
    assert failed["reason"] == "ProgressDeadlineExceeded", failed
    assert st["restarts"] == 1, st
    assert st["message"].startswith("no progress since "), st["message"]
    assert "(last: step 7, training; deadline 3s" in st["message"], st["message"]
    assert st["message"].endswith("no restarts left (spec.scheduling.maxRestarts 1)"), st
    assert "ProgressDeadlineExceeded" in reasons(cluster, namespace, name)
    wait_stopped(cluster, namespace, name)
    seen = watch.stop()
    assert is_subsequence(["Running", "Restarting", "Running", "Failed"], seen), seen
    assert operator.metric("posttrain_progress_deadline_exceeded_total", 'action="restart"') == 1
    assert operator.metric("posttrain_progress_deadline_exceeded_total", 'action="fail"') == 1
