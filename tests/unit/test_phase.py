"""Phase and condition logic: a table of JobSet states and the phase each one means."""

import pytest

from posttrain.controller.phase import changed, conditions_for, phase_from, status_patch


def jobset(
    suspend=False, conditions=(), restarts=0, ready=0, active=0, succeeded=0, replicas=1, queue=None
):
    js = {
        "metadata": {"name": "j", "labels": {"kueue.x-k8s.io/queue-name": queue} if queue else {}},
        "spec": {"suspend": suspend, "replicatedJobs": [{"name": "slice", "replicas": replicas}]},
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
    ("pods active", jobset(active=1), False, "Running", "Running"),
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
    running = phase_from(jobset(active=1), False)
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
    p = status_patch(jobset(active=1), SPEC, {}, "t1", 3)
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
    assert "progress" not in status_patch(jobset(active=1), SPEC, previous, "t", 1)


def test_finished_job_stays_finished_when_jobset_goes():
    previous = {"phase": "Succeeded", "completionTime": "t1"}
    assert status_patch(None, SPEC, previous, "t2", 1) == {}


def test_changed():
    p = status_patch(jobset(active=1), SPEC, {}, "t1", 1)
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
    running = status_patch(jobset(active=1), SPEC, {}, "t1", 1)
    between = status_patch(jobset(), SPEC, running, "t2", 1)  # pods done, Jobs not yet complete
    assert between["phase"] == "Running"
    assert status_patch(jobset(), SPEC, {}, "t1", 1)["phase"] == "Pending"
