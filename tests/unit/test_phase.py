"""Phase and condition logic: a table of JobSet states and the phase each one means."""

import dataclasses

import pytest

from posttrain.api.spec import Phase
from posttrain.controller.phase import (
    Observation,
    changed,
    cluster_queue_inactive,
    conditions_for,
    observation_patch,
    one_line,
    phase_from,
    pod_state,
    queue_positions,
    status_patch,
    status_reason,
    with_cluster_queue,
    without_workload,
    workload_activation,
    workload_state,
)


def jobset(
    suspend=False,
    conditions=(),
    restarts=0,
    ready=0,
    active=0,
    succeeded=0,
    replicas=1,
    queue=None,
    parallelism=1,
):
    js = {
        "metadata": {"name": "j", "labels": {"kueue.x-k8s.io/queue-name": queue} if queue else {}},
        "spec": {
            "suspend": suspend,
            "replicatedJobs": [
                {
                    "name": "slice",
                    "replicas": replicas,
                    "template": {"spec": {"parallelism": parallelism}},
                }
            ],
        },
        "status": {
            "restarts": restarts,
            "conditions": [
                {"type": t, "status": "True", "reason": r, "message": m} for t, r, m in conditions
            ],
            "replicatedJobsStatus": [
                {"name": "slice", "ready": ready, "active": active, "succeeded": succeeded}
            ],
        },
    }
    return js


TABLE = [
    # (case, jobset, user suspended, phase, reason)
    ("no jobset yet", None, False, "Pending", "Creating"),
    ("created, no pods", jobset(), False, "Pending", "WaitingForPods"),
    ("jobs active, pods not seen", jobset(active=1), False, "Pending", "WaitingForPods"),
    ("leader job ready", jobset(active=1, ready=1), False, "Running", "Running"),
    ("all ready", jobset(ready=2, replicas=2, active=2), False, "Running", "Running"),
    ("kueue holds it", jobset(suspend=True, queue="q"), False, "Queued", "WaitingForAdmission"),
    ("user suspended with queue", jobset(suspend=True, queue="q"), True, "Suspended", "Suspended"),
    ("user suspended", jobset(suspend=True), True, "Suspended", "Suspended"),
    ("suspended, no queue", jobset(suspend=True), False, "Suspended", "Suspended"),
    (
        "restarting",
        jobset(restarts=1, active=1, replicas=2, ready=1),
        False,
        "Restarting",
        "Restarting",
    ),
    (
        "restarted and ready",
        jobset(restarts=1, active=2, replicas=2, ready=2),
        False,
        "Running",
        "Running",
    ),
    (
        "completed",
        jobset(conditions=[("Completed", "AllJobsCompleted", "done")]),
        False,
        "Succeeded",
        "Completed",
    ),
    (
        "failed",
        jobset(
            conditions=[("Failed", "FailedJobs", "jobset failed: max restarts reached")], restarts=3
        ),
        False,
        "Failed",
        "FailedJobs",
    ),
    (
        "completed beats suspend",
        jobset(suspend=True, conditions=[("Completed", "x", "y")]),
        True,
        "Succeeded",
        "Completed",
    ),
]


@pytest.mark.parametrize("case,js,user_suspended,phase,reason", TABLE, ids=[t[0] for t in TABLE])
def test_phase_from(case, js, user_suspended, phase, reason):
    obs = phase_from(js, user_suspended)
    assert (obs.phase, obs.reason) == (phase, reason)


def test_failed_keeps_message_and_restarts():
    obs = phase_from(jobset(conditions=[("Failed", "FailedJobs", "boom")], restarts=3), False)
    assert obs.message == "boom" and obs.restarts == 3


def test_conditions_keep_transition_time_until_status_flips():
    running = phase_from(jobset(active=1, ready=1), False)
    first = conditions_for(running, [], "t1", 1)
    again = conditions_for(running, first, "t2", 1)
    by_type = {c["type"]: c for c in again}
    assert (
        by_type["Running"]["status"] == "True" and by_type["Running"]["lastTransitionTime"] == "t1"
    )
    done = conditions_for(
        phase_from(jobset(conditions=[("Completed", "a", "b")]), False), again, "t3", 1
    )
    by_type = {c["type"]: c for c in done}
    assert by_type["Succeeded"] == {
        "type": "Succeeded",
        "status": "True",
        "reason": "Completed",
        "message": "b",
        "lastTransitionTime": "t3",
        "observedGeneration": 1,
    }
    assert (
        by_type["Running"]["status"] == "False" and by_type["Running"]["lastTransitionTime"] == "t3"
    )
    assert sorted(by_type) == ["Failed", "Queued", "Running", "Succeeded", "Suspended"]


SPEC = {"output": {"uri": "gs://b/run/"}, "scheduling": {}}


def test_status_patch_times_and_outputs():
    p = status_patch(jobset(active=1, ready=1), SPEC, {}, "t1", 3)
    assert p["phase"] == "Running" and p["startTime"] == "t1" and "completionTime" not in p
    assert p["observedGeneration"] == 3 and p["jobSetName"] == "j"
    assert p["outputs"] == {
        "checkpoints": "gs://b/run/checkpoints",
        "tensorboard": "gs://b/run/tensorboard",
        "hfExport": "gs://b/run/hf",
    }
    done = status_patch(jobset(conditions=[("Completed", "a", "b")]), SPEC, p, "t2", 3)
    assert done["startTime"] == "t1" and done["completionTime"] == "t2"


def test_status_patch_never_touches_progress():
    previous = {"phase": "Running", "progress": {"step": 10, "loss": 1.5}}
    assert "progress" not in status_patch(jobset(active=1, ready=1), SPEC, previous, "t", 1)


def test_finished_job_stays_finished_when_jobset_goes():
    previous = {"phase": "Succeeded", "completionTime": "t1"}
    assert status_patch(None, SPEC, previous, "t2", 1) == {}


def test_changed():
    p = status_patch(jobset(active=1, ready=1), SPEC, {}, "t1", 1)
    assert changed({}, p)
    assert not changed({**p, "progress": {"step": 1}}, p)


def test_user_error_failure_is_explained():
    js = jobset(
        conditions=[
            ("Failed", "FailJobSetFailurePolicyAction", "applying FailJobSet (first failed job: x)")
        ]
    )
    obs = phase_from(js, False)
    assert (obs.phase, obs.reason) == ("Failed", "InvalidInput")
    assert "exited with code 65" in obs.message and "first failed job: x" in obs.message


def test_started_job_does_not_fall_back_to_pending():
    running = status_patch(jobset(active=1, ready=1), SPEC, {}, "t1", 1)
    between = status_patch(jobset(), SPEC, running, "t2", 1)  # pods done, Jobs not yet complete
    assert between["phase"] == "Running"
    assert status_patch(jobset(), SPEC, {}, "t1", 1)["phase"] == "Pending"


@pytest.mark.parametrize(
    "text,limit,expected",
    [
        ("plain words", 200, "plain words"),
        ("two\nlines", 200, "two\\nlines"),
        ("esc \x1b[31mred", 200, "esc \\x1b[31mred"),
        ("rtl \u202eevil", 200, "rtl \\u202eevil"),
        ("tab\there", 200, "tab\\there"),
        ("x" * 10, 5, "xxxx…"),
        ("ünïcode stays", 200, "ünïcode stays"),
    ],
)
def test_one_line(text, limit, expected):
    assert one_line(text, limit) == expected


def test_observation_patch_is_terminal_with_reason_and_condition():
    long = "the API server refused JobSet j: " + "x" * 300 + "\nforged line"
    p = observation_patch(Observation(Phase.failed, "InvalidSpec", long), SPEC, {}, "t1", 2)
    assert p["phase"] == "Failed" and p["completionTime"] == "t1" and p["observedGeneration"] == 2
    assert "\n" not in p["message"] and len(p["message"]) == 200 and p["message"].endswith("…")
    failed = {c["type"]: c for c in p["conditions"]}["Failed"]
    assert failed["status"] == "True" and failed["reason"] == "InvalidSpec"
    assert failed["message"].endswith("\\nforged line")  # whole, on one line
    assert "jobSetName" not in p
    # Once failed, nothing more is written (no retry loop rewrites it).
    again = Observation(Phase.failed, "InvalidSpec", "again")
    assert observation_patch(again, SPEC, p, "t2", 2) == {}
    assert status_patch(None, SPEC, p, "t2", 2) == {}


# -- pods and Workloads: the reasons come from what the scheduler, kubelet and Kueue wrote


def pod(
    index=0,
    host=0,
    phase="Pending",
    containers=None,
    conditions=(),
    attempt=0,
    memory=None,
    gates=(),
):
    """A JobSet pod as the API server returns it (the fields the phase reads)."""
    trainer = {"name": "trainer", "image": "ghcr.io/posttrain/trainer:0.1.0"}
    if memory:
        trainer["resources"] = {"limits": {"memory": memory}}
    return {
        "metadata": {
            "name": f"j-slice-{index}-{host}-x",
            "labels": {
                "jobset.sigs.k8s.io/replicatedjob-name": "slice",
                "jobset.sigs.k8s.io/job-index": str(index),
                "jobset.sigs.k8s.io/restart-attempt": str(attempt),
            },
        },
        "spec": {"containers": [trainer], "schedulingGates": [{"name": g} for g in gates]},
        "status": {
            "phase": phase,
            "conditions": list(conditions),
            "containerStatuses": containers or [],
        },
    }


def container(state, last=None, image="ghcr.io/posttrain/trainer:0.1.0", restarts=0):
    out = {"name": "trainer", "image": image, "state": state, "restartCount": restarts}
    if last:
        out["lastState"] = last
    return out


RUNNING = container({"running": {"startedAt": "t"}})
UNSCHEDULABLE = {
    "type": "PodScheduled",
    "status": "False",
    "reason": "Unschedulable",
    "message": "0/8 nodes are available: 2 node(s) had untolerated taint(s), 6 node(s) didn't "
    "match Pod's node affinity/selector. preemption: 0/8 nodes are available: 8 Preemption is "
    "not helpful for scheduling.",
}
GATED = {"type": "PodScheduled", "status": "False", "reason": "SchedulingGated"}
# What a v1.36 kubelet writes: the pull's error, then a back-off wrapping it, and again.
PULL_ERROR = (
    'rpc error: code = NotFound desc = failed to pull and unpack image "docker.io/library/bad:tag"'
    ": not found"
)
ERR_PULL = container(
    {"waiting": {"reason": "ErrImagePull", "message": PULL_ERROR}},
    image="bad:tag",
)
PULL = container(
    {
        "waiting": {
            "reason": "ImagePullBackOff",
            "message": f'Back-off pulling image "bad:tag": ErrImagePull: {PULL_ERROR}',
        }
    },
    image="bad:tag",
)
OOM = container(
    {"terminated": {"reason": "OOMKilled", "exitCode": 137}},
)
CREATING = container({"waiting": {"reason": "ContainerCreating"}})
CRASHLOOP = container(
    {"waiting": {"reason": "CrashLoopBackOff", "message": "back-off 40s"}},
    last={"terminated": {"reason": "Error", "exitCode": 1}},
    restarts=3,
)


def workload(*conditions, active=True):
    return {
        "spec": {"active": active},
        "status": {
            "conditions": [
                {"type": t, "status": st, "reason": r, "message": m} for t, st, r, m in conditions
            ]
        },
    }


NO_QUEUE = workload(("QuotaReserved", "False", "Inadmissible", "LocalQueue tpu doesn't exist"))
NO_QUOTA = workload(
    (
        "QuotaReserved",
        "False",
        "Pending",
        "couldn't assign flavors to pod set slice: insufficient quota for google.com/tpu in "
        "flavor v6e-2x4, previously considered podsets requests (0) + current podset request "
        "(8) > maximum capacity (0)",
    )
)
INACTIVE = workload(("QuotaReserved", "False", "Inadmissible", "ClusterQueue cq is inactive"))
TWO_HOSTS = {"parallelism": 2}

POD_TABLE = [
    # (case, jobset, pods, workload, phase, reason, message part)
    (
        "no nodes for the accelerator",
        jobset(active=1),
        [pod(conditions=[UNSCHEDULABLE])],
        None,
        "Pending",
        "Unschedulable",
        "pod j-slice-0-0-x: 0/8 nodes are available: 2 node(s) had untolerated taint(s), 6 "
        "node(s) didn't match Pod's node affinity/selector.",
    ),
    (
        "image cannot be pulled",
        jobset(active=1),
        [pod(containers=[ERR_PULL])],
        None,
        "Pending",
        "ErrImagePull",
        f"container trainer of pod j-slice-0-0-x cannot pull image 'bad:tag': {PULL_ERROR}",
    ),
    (
        "image pull backing off: the same reason and message",
        jobset(active=1),
        [pod(containers=[PULL])],
        None,
        "Pending",
        "ErrImagePull",
        f"container trainer of pod j-slice-0-0-x cannot pull image 'bad:tag': {PULL_ERROR}",
    ),
    (
        "container starting",
        jobset(active=1),
        [pod(containers=[CREATING])],
        None,
        "Pending",
        "PodsStarting",
        "0 of 1 pods running",
    ),
    (
        "pod phase Running but its trainer not yet",
        jobset(active=1),
        [pod(phase="Running", containers=[CREATING])],
        None,
        "Pending",
        "PodsStarting",
        "0 of 1 pods running",
    ),
    (
        "trainer runs",
        jobset(active=1),
        [pod(phase="Running", containers=[RUNNING])],
        None,
        "Running",
        "Running",
        "1 of 1 pods running",
    ),
    (
        "one of two hosts runs",
        jobset(active=1, **TWO_HOSTS),
        [pod(phase="Running", containers=[RUNNING]), pod(host=1, containers=[CREATING])],
        None,
        "Pending",
        "PodsStarting",
        "1 of 2 pods running",
    ),
    (
        "exclusive placement: a follower waits for its gate",
        jobset(active=1, **TWO_HOSTS),
        [pod(phase="Running", containers=[RUNNING]), pod(host=1, conditions=[GATED], gates=["g"])],
        None,
        "Pending",
        "SchedulingGated",
        "pod j-slice-0-1-x is held by scheduling gates g",
    ),
    (
        "leader slice runs, second slice does not yet",
        jobset(active=2, replicas=2, **TWO_HOSTS),
        [pod(host=h, phase="Running", containers=[RUNNING]) for h in (0, 1)]
        + [pod(index=1, host=h, conditions=[UNSCHEDULABLE]) for h in (0, 1)],
        None,
        "Running",
        "Running",
        "2 of 4 pods running",
    ),
    (
        "the unschedulable pod outranks one starting",
        jobset(active=1, **TWO_HOSTS),
        [pod(containers=[CREATING]), pod(host=1, conditions=[UNSCHEDULABLE])],
        None,
        "Pending",
        "Unschedulable",
        "pod j-slice-0-1-x: 0/8 nodes",
    ),
    (
        "OOMKilled, restarting",
        jobset(active=1, restarts=1),
        [pod(phase="Failed", containers=[OOM], attempt=1, memory="16Gi")],
        None,
        "Restarting",
        "OOMKilled",
        "restart 1: container trainer of pod j-slice-0-0-x was killed for using more memory "
        "than its limit 16Gi",
    ),
    (
        "OOMKilled without a limit",
        jobset(active=1, restarts=1),
        [pod(phase="Failed", containers=[OOM], attempt=1)],
        None,
        "Restarting",
        "OOMKilled",
        "than the node's memory (no memory limit)",
    ),
    (
        "pods of the attempt before a restart are ignored",
        jobset(active=1, restarts=1),
        [pod(phase="Failed", containers=[OOM], attempt=0), pod(attempt=1, containers=[CREATING])],
        None,
        "Restarting",
        "Restarting",
        "restart 1: 0 of 1 pods running",
    ),
    (
        "failed after OOMs",
        jobset(restarts=2, conditions=[("Failed", "FailedJobs", "reached max restarts")]),
        [pod(phase="Failed", containers=[OOM], attempt=2, memory="8Gi")],
        None,
        "Failed",
        "OOMKilled",
        "container trainer of pod j-slice-0-0-x was killed for using more memory than its limit "
        "8Gi (reached max restarts)",
    ),
    (
        "a sidecar crash-loops",
        jobset(active=1),
        [pod(phase="Running", containers=[CRASHLOOP])],
        None,
        "Pending",
        "CrashLoopBackOff",
        "container trainer of pod j-slice-0-0-x keeps crashing (3 restarts, last exit code 1)",
    ),
    (
        "Kueue: no such LocalQueue",
        jobset(suspend=True, queue="tpu"),
        [],
        NO_QUEUE,
        "Queued",
        "Inadmissible",
        "Kueue queue 'tpu': LocalQueue tpu doesn't exist",
    ),
    (
        "Kueue: no quota",
        jobset(suspend=True, queue="tpu"),
        [],
        NO_QUOTA,
        "Queued",
        "Pending",
        "Kueue queue 'tpu': couldn't assign flavors to pod set slice: insufficient quota for "
        "google.com/tpu in flavor v6e-2x4",
    ),
    (
        "Kueue: inactive ClusterQueue",
        jobset(suspend=True, queue="tpu"),
        [],
        INACTIVE,
        "Queued",
        "Inadmissible",
        "ClusterQueue cq is inactive",
    ),
    (
        "Kueue: no Workload yet",
        jobset(suspend=True, queue="tpu"),
        [],
        None,
        "Queued",
        "WaitingForAdmission",
        "waiting for Kueue queue 'tpu'",
    ),
    (
        "Kueue: deactivated",
        jobset(suspend=True, queue="tpu"),
        [],
        workload(active=False),
        "Queued",
        "Deactivated",
        "the Workload is deactivated",
    ),
    (
        "Kueue admitted: the scheduler's word next",
        jobset(active=1, queue="tpu"),
        [pod(conditions=[UNSCHEDULABLE])],
        workload(("QuotaReserved", "True", "QuotaReserved", ""), ("Admitted", "True", "A", "")),
        "Pending",
        "Unschedulable",
        "0/8 nodes are available",
    ),
    (
        "Kueue and suspend: resumed by the user before admission",
        jobset(active=0, queue="tpu"),
        [],
        NO_QUOTA,
        "Queued",
        "Pending",
        "insufficient quota",
    ),
    (
        "Kueue and suspend: evicted, not yet suspended again",
        jobset(active=1, queue="tpu"),
        [pod(phase="Running", containers=[RUNNING])],
        workload(("Evicted", "True", "Preempted", "Preempted to accommodate a workload")),
        "Queued",
        "Preempted",
        "Preempted to accommodate a workload",
    ),
    (
        "Kueue evicted it",
        jobset(suspend=True, queue="tpu"),
        [],
        workload(("Evicted", "True", "Preempted", "Preempted to accommodate a workload")),
        "Queued",
        "Preempted",
        "Kueue queue 'tpu': Preempted to accommodate a workload",
    ),
]


@pytest.mark.parametrize(
    "case,js,pods,wl,phase,reason,message", POD_TABLE, ids=[t[0] for t in POD_TABLE]
)
def test_phase_from_pods_and_workload(case, js, pods, wl, phase, reason, message):
    obs = phase_from(
        js,
        False,
        [pod_state(p) for p in pods],
        workload_state(wl) if wl is not None else None,
    )
    assert (obs.phase, obs.reason) == (phase, reason), obs
    assert message in obs.message, obs.message


def test_pending_says_why_in_status_and_running_condition():
    p = status_patch(
        jobset(active=1), SPEC, {}, "t1", 1, [pod_state(pod(conditions=[UNSCHEDULABLE]))]
    )
    assert p["phase"] == "Pending" and p["message"].startswith("pod j-slice-0-0-x: 0/8 nodes")
    assert "preemption" not in p["message"]
    running = {c["type"]: c for c in p["conditions"]}["Running"]
    assert running["status"] == "False" and running["reason"] == "Unschedulable"
    assert status_reason(p) == "Unschedulable"
    assert status_reason(status_patch(None, SPEC, {}, "t1", 1)) == "Creating"
    done = status_patch(
        jobset(conditions=[("Completed", "AllJobsCompleted", "ok")]), SPEC, p, "t", 1
    )
    assert status_reason(done) == "Completed"


def test_running_job_does_not_flap_while_pods_finish():
    up = [pod_state(pod(phase="Running", containers=[RUNNING]))]
    running = status_patch(jobset(active=1), SPEC, {}, "t1", 1, up)
    assert running["phase"] == "Running"
    done = [pod_state(pod(phase="Succeeded"))]
    assert status_patch(jobset(active=1), SPEC, running, "t2", 1, done)["phase"] == "Running"
    # ... but pods that wait again (a resume after suspend) are Pending again.
    waiting = [pod_state(pod(conditions=[UNSCHEDULABLE]))]
    assert status_patch(jobset(active=1), SPEC, running, "t2", 1, waiting)["phase"] == "Pending"


ADMITTED = workload(("QuotaReserved", "True", "QuotaReserved", ""), ("Admitted", "True", "A", ""))


def named(wl, name="jobset-j-1"):
    return {**wl, "metadata": {"name": name}}


@pytest.mark.parametrize(
    "case,js,user_suspended,wl,phase",
    [
        (
            "user suspends while queued",
            jobset(suspend=True, queue="q"),
            True,
            NO_QUOTA,
            "Suspended",
        ),
        (
            "user suspends while admitted",
            jobset(suspend=True, queue="q"),
            True,
            ADMITTED,
            "Suspended",
        ),
        (
            "user resumes, Kueue re-suspends",
            jobset(suspend=True, queue="q"),
            False,
            NO_QUOTA,
            "Queued",
        ),
        ("user resumes, Kueue not yet", jobset(queue="q"), False, NO_QUOTA, "Queued"),
        ("admitted again, pods starting", jobset(active=1, queue="q"), False, ADMITTED, "Pending"),
        (
            "user suspends while running: Kueue starts it once more before it deactivates",
            jobset(active=1, ready=1, queue="q"),
            True,
            named(ADMITTED),
            "Suspended",
        ),
        (
            "resumed and active again: Queued, not 'deactivated'",
            jobset(suspend=True, queue="q"),
            False,
            named(workload(("Evicted", "True", "Deactivated", "The workload is deactivated"))),
            "Queued",
        ),
        (
            "user resumes: deactivated until the operator activates it",
            jobset(queue="q"),
            False,
            named(workload(active=False)),
            "Queued",
        ),
    ],
)
def test_user_suspend_with_kueue(case, js, user_suspended, wl, phase):
    """spec.scheduling.suspend wins while set; after a resume the job is Queued until Kueue
    admits it (never Pending in between), then follows its pods."""
    assert phase_from(js, user_suspended, [], workload_state(wl)).phase == phase


def classed(wpc=None, pc=None, queue="tpu"):
    """A JobSet Kueue holds, naming a WorkloadPriorityClass (label) and/or a PriorityClass
    (its pods)."""
    js = jobset(suspend=True, queue=queue)
    if wpc:
        js["metadata"]["labels"]["kueue.x-k8s.io/priority-class"] = wpc
    if pc:
        js["spec"]["replicatedJobs"][0]["template"]["spec"]["template"] = {
            "spec": {"priorityClassName": pc}
        }
    return js


@pytest.mark.parametrize(
    "case,js,workload_classes,classes,reason,message",
    [
        (
            "WorkloadPriorityClass missing",
            classed(wpc="urgent"),
            {"low"},
            {"high"},
            "PriorityClassNotFound",
            "Kueue queue 'tpu': WorkloadPriorityClass.kueue.x-k8s.io \"urgent\" not found: Kueue "
            "makes no Workload until it exists (spec.scheduling.workloadPriorityClass)",
        ),
        (
            "PriorityClass of the pods missing",
            classed(pc="high"),
            set(),
            {"low"},
            "PriorityClassNotFound",
            "Kueue queue 'tpu': PriorityClass.scheduling.k8s.io \"high\" not found: Kueue makes no "
            "Workload until it exists (spec.scheduling.priorityClass)",
        ),
        (
            "Kueue reads the WorkloadPriorityClass, not the pods' class",
            classed(wpc="urgent", pc="high"),
            {"urgent"},
            set(),
            "WaitingForAdmission",
            "waiting for Kueue queue 'tpu'",
        ),
        (
            "both exist: the Workload is on its way",
            classed(wpc="urgent", pc="high"),
            {"urgent"},
            {"high"},
            "WaitingForAdmission",
            "waiting for Kueue queue 'tpu'",
        ),
        (
            "no class named",
            classed(),
            set(),
            set(),
            "WaitingForAdmission",
            "waiting for Kueue queue 'tpu'",
        ),
        (
            "classes not known",
            classed(wpc="urgent", pc="high"),
            None,
            None,
            "WaitingForAdmission",
            "waiting for Kueue queue 'tpu'",
        ),
    ],
)
def test_priority_class_kueue_cannot_find(case, js, workload_classes, classes, reason, message):
    """Without a Workload, a missing class is why: Kueue's own words (its log's NotFound
    error), the field to fix, in one line under 200 characters."""
    obs = phase_from(js, False, [], without_workload(js, workload_classes, classes))
    assert (obs.phase, obs.reason, obs.message) == ("Queued", reason, message), obs
    assert len(obs.message) < 200


def test_priority_class_missing_only_matters_to_kueue():
    assert without_workload(classed(wpc="urgent", queue=None), set(), set()) is None
    assert without_workload(None, set(), set()) is None
    # The user's suspend still wins.
    js = classed(wpc="urgent")
    assert phase_from(js, True, [], without_workload(js, set(), set())).phase == "Suspended"


@pytest.mark.parametrize(
    "message,detail",
    [
        ('Back-off pulling image "bad:tag": ErrImagePull: not found', "not found"),
        (
            'Back-off pulling image "r/x:1": RegistryUnavailable: image pull failed',
            "image pull failed",
        ),
        ('Back-off pulling image "bad:tag"', ""),  # no earlier error kept (kubelet restarted)
    ],
)
def test_image_pull_back_off_keeps_the_pull_error(message, detail):
    cs = container({"waiting": {"reason": "ImagePullBackOff", "message": message}}, image="i")
    cause = pod_state(pod(containers=[cs])).cause
    head = "container trainer of pod j-slice-0-0-x cannot pull image 'i'"
    assert (cause.reason, cause.message) == (
        "ErrImagePull",
        f"{head}: {detail}" if detail else head,
    )


MISSING_FLAVOR = {
    "status": {
        "conditions": [
            {
                "type": "Active",
                "status": "False",
                "reason": "FlavorNotFound",
                "message": "Can't admit new workloads: references missing ResourceFlavor(s): "
                "v6e-2x4.",
            }
        ]
    }
}
READY_CQ = {"status": {"conditions": [{"type": "Active", "status": "True", "reason": "Ready"}]}}


@pytest.mark.parametrize(
    "case,wl,queues,message",
    [
        (
            "inactive: with the ClusterQueue's own reason",
            INACTIVE,
            {"cq": MISSING_FLAVOR},
            "Kueue queue 'tpu': ClusterQueue cq is inactive: Can't admit new workloads: "
            "references missing ResourceFlavor(s): v6e-2x4.",
        ),
        (
            "inactive, its ClusterQueue not (yet) seen",
            INACTIVE,
            {},
            "Kueue queue 'tpu': ClusterQueue cq is inactive",
        ),
        (
            "another ClusterQueue is the inactive one",
            INACTIVE,
            {"other": MISSING_FLAVOR, "cq": READY_CQ},
            "Kueue queue 'tpu': ClusterQueue cq is inactive",
        ),
        ("no quota: untouched", NO_QUOTA, {"cq": MISSING_FLAVOR}, "Kueue queue 'tpu': couldn't"),
    ],
)
def test_inactive_cluster_queue_says_why(case, wl, queues, message):
    inactive = {n: w for n, q in queues.items() if (w := cluster_queue_inactive(q))}
    state = with_cluster_queue(workload_state(wl), inactive.get)
    obs = phase_from(jobset(suspend=True, queue="tpu"), False, [], state)
    assert obs.phase == "Queued" and obs.message.startswith(message), obs


@pytest.mark.parametrize(
    "case,user_suspended,wl,active",
    [
        ("suspend an admitted job: deactivate", True, named(ADMITTED), False),
        ("suspend a queued job: deactivate", True, named(NO_QUOTA), False),
        ("suspended and deactivated: nothing", True, named(workload(active=False)), None),
        ("resume: activate", False, named(workload(active=False)), True),
        ("running and active: nothing", False, named(ADMITTED), None),
        (
            "active again, the old eviction not yet cleared: nothing",
            False,
            named(workload(("Evicted", "True", "Deactivated", "The workload is deactivated"))),
            None,
        ),
        ("no Workload yet: nothing", True, None, None),
    ],
)
def test_workload_follows_user_suspend(case, user_suspended, wl, active):
    """Kueue starts a suspended JobSet it admitted: the user's suspend is the Workload's
    spec.active (Kueue's own way to stop a job)."""
    state = workload_state(wl) if wl is not None else None
    assert workload_activation(user_suspended, state) is active
    assert (
        workload_activation(user_suspended, without_workload(classed(wpc="x"), set(), set()))
        is None
    )


@pytest.mark.parametrize(
    "case,wl,position,message",
    [
        (
            "no quota, second in line",
            NO_QUOTA,
            (2, 5),
            "Kueue queue 'tpu', position 2 (5 in its ClusterQueue): couldn't assign flavors",
        ),
        ("first in both", NO_QUOTA, (1, 1), "Kueue queue 'tpu', position 1: couldn't assign"),
        ("no word from Kueue yet", workload(), (3, 3), "Kueue queue 'tpu', position 3"),
        ("no visibility API", NO_QUOTA, None, "Kueue queue 'tpu': couldn't assign flavors"),
    ],
)
def test_queued_job_shows_its_position(case, wl, position, message):
    state = dataclasses.replace(workload_state(named(wl)), position=position)
    obs = phase_from(jobset(suspend=True, queue="tpu"), False, [], state)
    assert obs.phase == "Queued" and obs.message.startswith(message), obs
    assert wl is NO_QUOTA or obs.message == message, obs  # nothing more to say


def test_queue_positions_from_kueue_summary():
    summary = {
        "items": [
            {"metadata": {"name": "w1"}, "positionInLocalQueue": 0, "positionInClusterQueue": 4},
            {"metadata": {"name": "w2"}},
        ]
    }
    assert queue_positions(summary) == {"w1": (1, 5), "w2": (1, 1)}
    assert queue_positions({"items": []}) == {}


@pytest.mark.parametrize(
    "uri", ["gs://TOKEN@bucket/run", "gs://key:TOKEN@bucket/run", "GS://TOKEN@bucket/run"]
)
def test_a_refused_output_uri_never_reaches_the_status(uri):
    import json

    from invalid_jobs import valid_job

    from posttrain.checks import validate
    from posttrain.controller.phase import Observation, observation_patch

    doc = valid_job("leaky")
    doc["spec"]["output"]["uri"] = uri
    _, errors = validate(doc)
    message = "; ".join(str(e) for e in errors)
    assert "spec.output.uri" in message
    patch = observation_patch(
        Observation(Phase.failed, "InvalidSpec", message), doc["spec"], {}, "t", 1
    )
    assert patch["phase"] == "Failed" and "outputs" not in patch
    assert "TOKEN" not in json.dumps(patch)


def test_only_pods_whose_owner_chain_leads_to_the_jobset_count():
    from posttrain.controller.phase import owned_pods

    def owned_by(body, uid):
        body["metadata"]["ownerReferences"] = [
            {"apiVersion": "batch/v1", "kind": "Job", "name": "j-slice-0", "uid": uid,
             "controller": True}
        ]  # fmt: skip
        return body

    running = {"phase": "Running", "containers": [RUNNING]}
    mine = pod_state(owned_by(pod(**running), "job-1"))
    foreign = [
        pod_state(pod(**running)),  # the job's name label, no owner
        pod_state(owned_by(pod(**running), "job-2")),  # a Job of another JobSet
        pod_state(owned_by(pod(**running), "job-3")),  # a Job no JobSet controls
    ]
    jobs = [("job-1", "js-uid"), ("job-2", "other-js"), ("job-3", None)]
    assert owned_pods([mine, *foreign], jobs, "js-uid") == [mine]
    # A job whose own pods cannot schedule is not Running for a foreign pod.
    waiting = pod_state(owned_by(pod(conditions=[UNSCHEDULABLE]), "job-1"))
    pods = owned_pods([waiting, *foreign], jobs, "js-uid")
    p = status_patch(jobset(active=1), SPEC, {}, "t", 1, pods)
    assert p["phase"] == "Pending" and p["conditions"][1]["reason"] == "Unschedulable", p


def test_a_missing_priority_class_outside_kueue_keeps_the_job_pending_with_why():
    from posttrain.controller.phase import missing_priority_class

    js = classed(pc="urgent", queue=None)
    js["spec"]["suspend"] = False
    cause = missing_priority_class(js, {"low"})
    p = status_patch(js, SPEC, {}, "t", 1, [], None, cause)
    running = {c["type"]: c for c in p["conditions"]}["Running"]
    assert p["phase"] == "Pending" and running["reason"] == "PriorityClassNotFound"
    assert '"urgent" not found' in p["message"] and "spec.scheduling.priorityClass" in p["message"]
    assert missing_priority_class(js, {"urgent"}) is None
    assert missing_priority_class(js, None) is None  # not known
    assert missing_priority_class(classed(pc="urgent"), {"low"}) is None  # Kueue's case


# -- the API server refusing a JobSet's Jobs (the JobSet controller's Events) ---------

QUOTA = (
    'job "j-slice-0" creation failed with error: jobs.batch "j-slice-0" is forbidden: '
    "exceeded quota: jobs, requested: count/jobs.batch=1, used: count/jobs.batch=0, "
    "limited: count/jobs.batch=0"
)
POLICY = (
    'job "j-slice-0" creation failed with error: jobs.batch "j-slice-0" is forbidden: '
    "ValidatingAdmissionPolicy 'deadline' with binding 'deadline' denied request: "
    "Jobs need spec.activeDeadlineSeconds"
)
INVALID = (
    'job "j-slice-0" creation failed with error: Job.batch "j-slice-0" is invalid: '
    'spec.template.spec.containers[0].env[0].valueFrom.secretKeyRef.key: Invalid value: "..": '
    "must be a valid config key"
)
WEBHOOK = (
    'job "j-slice-0" creation failed with error: admission webhook "jobs.policy.example" '
    "denied the request: no Jobs on Sundays"
)
TIMEOUT = (
    'job "j-slice-0" creation failed with error: Timeout: request did not complete within '
    "requested timeout - context deadline exceeded"
)


def refusal(message, uid="u1", seen="2026-01-01T00:00:00Z", kind="JobSet"):
    return {
        "metadata": {"creationTimestamp": "2026-01-01T00:00:00Z"},
        "involvedObject": {"kind": kind, "name": "j", "uid": uid},
        "reason": "JobCreationFailed",
        "message": message,
        "lastTimestamp": seen,
    }


def made(uid="u1", replicas=1):
    js = jobset(replicas=replicas)
    js["metadata"]["uid"] = uid
    return js


@pytest.mark.parametrize(
    "case,message,final",
    [
        ("a ResourceQuota on Jobs", QUOTA, False),
        ("a ValidatingAdmissionPolicy", POLICY, True),
        ("an invalid Job (422)", INVALID, True),
        ("a webhook's denial", WEBHOOK, False),
        ("a timeout", TIMEOUT, False),
    ],
)
def test_a_refused_job_fails_the_job_or_keeps_it_waiting_in_the_api_servers_words(
    case, message, final
):
    from posttrain.controller.phase import job_refusal, refusal_event

    js = made()
    cause = job_refusal(js, [refusal_event(refusal(message))], 0)
    error = message.split("creation failed with error: ", 1)[1]
    assert cause is not None and cause.reason == "JobCreationFailed" and cause.final == final
    assert cause.message.endswith(error) and "Job j-slice-0" in cause.message
    p = status_patch(js, SPEC, {}, "t", 1, [], None, cause)
    conditions = {c["type"]: c for c in p["conditions"]}
    if final:
        assert p["phase"] == "Failed" and conditions["Failed"]["reason"] == "JobCreationFailed"
    else:
        assert p["phase"] == "Pending" and conditions["Running"]["reason"] == "JobCreationFailed"
        assert "retries" in p["message"]
    assert conditions["Failed" if final else "Running"]["message"].endswith(error)


def test_a_refusal_counts_only_while_its_jobsets_jobs_are_missing():
    from posttrain.controller.phase import job_refusal, refusal_event

    js = made(replicas=2)
    old, new = (
        refusal(QUOTA, seen="2026-01-01T00:00:00Z"),
        refusal(POLICY, seen="2026-01-01T00:05:00Z"),
    )
    events = [refusal_event(new), refusal_event(old)]
    assert job_refusal(js, events, 1).final  # the latest Event: the policy's
    assert job_refusal(js, events, 2) is None  # every Job made (the quota was raised)
    assert job_refusal(js, [refusal_event(refusal(POLICY, uid="earlier"))], 0) is None
    assert job_refusal(None, events, 0) is None
    assert refusal_event(refusal(QUOTA, kind="Job")) is None
    assert refusal_event({**refusal(QUOTA), "reason": "SuccessfulCreate"}) is None
    # A restart's Job that waits for the one of the attempt before: no refusal.
    again = 'job "j-slice-0" creation failed with error: jobs.batch "j-slice-0" already exists'
    assert job_refusal(js, [refusal_event(refusal(again, seen="2026-01-02T00:00:00Z"))], 0) is None
    # Several Jobs refused at once: the first, and how many more.
    two = QUOTA + "\n" + QUOTA.replace("j-slice-0", "j-slice-1")
    cause = job_refusal(js, [refusal_event(refusal(two))], 0)
    assert "(and 1 more Jobs)" in cause.message and "\n" not in cause.message
    # A Running JobSet whose Jobs were all made is not held back by an old Event.
    running = made()
    running["status"]["replicatedJobsStatus"][0]["ready"] = 1
    assert phase_from(running, False, [], None, job_refusal(running, events, 1)).phase == "Running"


def test_an_events_api_refusal_is_read_from_its_series():
    """Events the JobSet controller posts through events.k8s.io/v1 have no lastTimestamp:
    their time is the series' last observation (or eventTime)."""
    from posttrain.controller.phase import refusal_event

    event = refusal(QUOTA)
    del event["lastTimestamp"]
    event["eventTime"] = "2026-01-01T00:00:01.000000Z"
    event["series"] = {"count": 4, "lastObservedTime": "2026-01-01T00:09:00.123456Z"}
    assert refusal_event(event) == ("u1", "2026-01-01T00:09:00", QUOTA)


POD_QUOTA = (
    'Error creating: pods "j-slice-0-0-abcde" is forbidden: exceeded quota: tpu, requested: '
    "google.com/tpu=4, used: google.com/tpu=0, limited: google.com/tpu=0"
)
LIMIT_RANGE = (
    'Error creating: pods "j-slice-0-0-abcde" is forbidden: maximum memory usage per '
    "Container is 1Gi, but limit is 64Gi"
)


def pod_refused(message, uid="job1", seen="2026-01-01T00:00:00Z"):
    """The Job controller's FailedCreate Event as events.k8s.io/v1 shows it."""
    return {
        "metadata": {"creationTimestamp": "2026-01-01T00:00:00Z"},
        "regarding": {"kind": "Job", "name": "j-slice-0", "uid": uid},
        "reason": "FailedCreate",
        "note": message,
        "deprecatedLastTimestamp": seen,
    }


@pytest.mark.parametrize("message,final", [(POD_QUOTA, False), (LIMIT_RANGE, True)])
def test_refused_pods_fail_the_job_or_keep_it_waiting_in_the_api_servers_words(message, final):
    from posttrain.controller.phase import pod_refusal, refusal_event

    js = made(replicas=1)
    js["spec"]["replicatedJobs"][0]["template"]["spec"]["parallelism"] = 2
    events = [refusal_event(pod_refused(message))]
    cause = pod_refusal(js, events, ["job1"], 1)  # one of the two pods made
    error = message.removeprefix("Error creating: ")
    assert cause.reason == "PodCreationFailed" and cause.final == final
    assert cause.message.endswith(error)
    p = status_patch(js, SPEC, {}, "t", 1, [], None, cause)
    assert p["phase"] == ("Failed" if final else "Pending"), p
    assert pod_refusal(js, events, ["job1"], 2) is None  # every pod made
    assert pod_refusal(js, events, ["job2"], 0) is None  # an Event of another Job
    # A missing PriorityClass is said by missing_priority_class, naming the field.
    no_class = 'Error creating: pods "p" is forbidden: no PriorityClass with name x was found'
    assert not pod_refusal(js, [refusal_event(pod_refused(no_class))], ["job1"], 0).final
    # JobSet's webhook holds a slice's other pods until its first is placed: no refusal.
    placement = (
        'Error creating: admission webhook "vpod.kb.io" denied the request: follower pod node '
        "selector for topology domain not found. missing selector: cloud.google.com/gke-nodepool"
    )
    assert pod_refusal(js, [refusal_event(pod_refused(placement))], ["job1"], 1) is None
