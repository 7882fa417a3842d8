"""What one reconcile does (`actions.decide`), the JobSet summary the watches keep, and
the retry queue: tables of a job and what is observed of it."""

import asyncio
import json

import pytest

from posttrain.controller.actions import (
    Event,
    Observed,
    decide,
    scheduling_annotation,
    scheduling_update,
    status_event,
    stop_failed,
)
from posttrain.controller.phase import Cause, PodState, WorkloadState, status_patch
from posttrain.controller.watches import SCHEDULING_ANNOTATION, job_summary, jobset_summary
from posttrain.controller.workqueue import WorkQueue

NOW = "2026-01-01T00:00:00Z"


def job(status=None, scheduling=None, deleting=False):
    meta = {"name": "j", "namespace": "ns", "uid": "u1", "generation": 1}
    if deleting:
        meta["deletionTimestamp"] = NOW
    return {
        "apiVersion": "posttrain.dev/v1alpha1",
        "kind": "PostTrainJob",
        "metadata": meta,
        "spec": {"output": {"uri": "/o"}, "scheduling": scheduling or {}},
        "status": status or {},
    }


def jobset(suspend=False, annotation=None, ready=0, completed=False, labels=None, failed=False):
    meta = {"name": "j", "uid": "js1", "labels": labels or {}, "ownerReferences": [{"uid": "u1"}]}
    if annotation is not None:
        meta["annotations"] = {SCHEDULING_ANNOTATION: annotation}
    conditions = [{"type": "Completed", "status": "True", "message": "done"}] if completed else []
    if failed:
        conditions.append({"type": "Failed", "status": "True", "reason": "FailedJobs"})
    return {
        "metadata": meta,
        "spec": {
            "suspend": suspend,
            "replicatedJobs": [
                {"name": "slice", "replicas": 1, "template": {"spec": {"parallelism": 1}}}
            ],
        },
        "status": {
            "conditions": conditions,
            "replicatedJobsStatus": [{"name": "slice", "ready": ready}],
        },
    }


def written(js, scheduling=None):
    """The status the operator wrote for `js` (as the next reconcile reads it back)."""
    return status_patch(js, job(scheduling=scheduling)["spec"], {}, NOW, 1)


PENDING = written(jobset(annotation=scheduling_annotation({})))
ANNOTATED = scheduling_annotation({})
TABLE = [
    # (case, job, observed JobSet, create, status phase written or None, events)
    ("new job: make its objects", job(), None, True, None, []),
    (
        "JobSet gone while running: made again, with a Warning",
        job(status=PENDING),
        None,
        True,
        None,
        [("Warning", "JobSetDeleted")],
    ),
    ("first status", job(), jobset(annotation=ANNOTATED), False, "Pending", [("Normal", "Pending")]),
    ("unchanged status: no write, no Event", job(status=PENDING), jobset(annotation=ANNOTATED), False, None, []),
    (
        "JobSet ready: Running",
        job(status=PENDING),
        jobset(annotation=ANNOTATED, ready=1),
        False,
        "Running",
        [("Normal", "Running")],
    ),
    (
        "finished: nothing, not even a missing JobSet",
        job(status={"phase": "Succeeded"}),
        None,
        False,
        None,
        [],
    ),
    ("being deleted: nothing", job(deleting=True), None, False, None, []),
    (
        "completed JobSet: Succeeded",
        job(status=PENDING),
        jobset(annotation=ANNOTATED, completed=True),
        False,
        "Succeeded",
        [("Normal", "Succeeded")],
    ),
]  # fmt: skip


@pytest.mark.parametrize("case,ptj,js,create,phase,events", TABLE, ids=[t[0] for t in TABLE])
def test_decide(case, ptj, js, create, phase, events):
    actions = decide(ptj, Observed(jobset=js), NOW)
    assert actions.create is create
    assert (actions.status or {}).get("phase") == phase
    assert [(e.type, e.reason) for e in actions.events] == events
    assert actions.jobset_patch == {}


SCHEDULING = [
    # (case, spec.scheduling, JobSet (suspended, annotation), patch, events)
    ("unchanged", {}, (False, ANNOTATED), {}, []),
    (
        "user suspends",
        {"suspend": True},
        (False, ANNOTATED),
        {"spec": {"suspend": True}},
        ["Suspending"],
    ),
    (
        "user resumes",
        {},
        (True, scheduling_annotation({"scheduling": {"suspend": True}})),
        {"spec": {"suspend": False}},
        ["Resuming"],
    ),
    (
        "user resumes a queued job: Kueue starts it when it admits it again",
        {"queue": "tpu"},
        (True, scheduling_annotation({"scheduling": {"queue": "tpu", "suspend": True}})),
        {},
        ["Resuming"],
    ),
    ("Kueue suspended it: left alone", {}, (True, ANNOTATED), {}, []),
    (
        "priority and ttl changed",
        {"workloadPriorityClass": "low", "ttlSecondsAfterFinished": 60},
        (False, ANNOTATED),
        {
            "spec": {"ttlSecondsAfterFinished": 60},
            "metadata": {"labels": {"kueue.x-k8s.io/priority-class": "low"}},
        },
        [],
    ),
    ("made before the annotation: nothing to undo", {}, (True, None), {}, []),
]


@pytest.mark.parametrize(
    "case,scheduling,js,patch,events", SCHEDULING, ids=[t[0] for t in SCHEDULING]
)
def test_scheduling_update(case, scheduling, js, patch, events):
    suspended, annotation = js
    spec = {"scheduling": scheduling}
    got, got_events = scheduling_update(spec, jobset(suspend=suspended, annotation=annotation))
    annotations = got.get("metadata", {}).pop("annotations", None)
    if not got.get("metadata", True):
        got.pop("metadata")
    assert got == patch
    assert [e.reason for e in got_events] == events
    if patch or events:  # the patch records what the JobSet now carries
        assert json.loads(annotations[SCHEDULING_ANNOTATION]) == json.loads(
            scheduling_annotation(spec)
        )


ADMITTED = WorkloadState(True, name="w")
DEACTIVATED = WorkloadState(False, "Deactivated", "m", "w", False)
SUSPEND = {"spec": {"suspend": True}}
STOPS = [
    # (case, phase, JobSet, Workload, JobSet patch, Workload spec.active)
    ("failed, JobSet active: suspended", "Failed", jobset(), None, SUSPEND, None),
    ("failed under Kueue: suspended, Workload deactivated", "Failed", jobset(), ADMITTED, SUSPEND, False),
    ("failed, JobSet suspended, Workload admitted: deactivated", "Failed", jobset(suspend=True), ADMITTED, {}, False),
    ("failed, Kueue started it again: suspended again", "Failed", jobset(), DEACTIVATED, SUSPEND, None),
    ("failed, both stopped: nothing", "Failed", jobset(suspend=True), DEACTIVATED, {}, None),
    ("failed, Workload not made yet: JobSet only", "Failed", jobset(), WorkloadState(False), SUSPEND, None),
    ("JobSet failed: its controller stopped it", "Failed", jobset(failed=True), ADMITTED, {}, None),
    ("JobSet completed: its controller stopped it", "Failed", jobset(completed=True), None, {}, None),
    ("failed, no JobSet: nothing", "Failed", None, ADMITTED, {}, None),
    ("succeeded: nothing", "Succeeded", jobset(), ADMITTED, {}, None),
    ("running: nothing", "Running", jobset(), ADMITTED, {}, None),
]  # fmt: skip


@pytest.mark.parametrize("case,phase,js,workload,patch,active", STOPS, ids=[t[0] for t in STOPS])
def test_stop_failed(case, phase, js, workload, patch, active):
    actions = stop_failed(phase, js, workload)
    assert actions.jobset_patch == patch
    assert [e.reason for e in actions.jobset_events] == (["JobSetSuspended"] if patch else [])
    assert actions.workload_active is active
    assert not actions.create and actions.status is None and actions.events == []


def test_a_job_that_fails_stops_its_jobset_in_the_same_reconcile_and_after():
    """The reconcile that writes Failed for a refusal that stays also suspends the JobSet
    and deactivates its Workload; later reconciles of the failed job suspend it again if
    Kueue started it before it saw the deactivation, and touch nothing else."""
    refused = Cause("JobCreationFailed", "the API server refuses the JobSet's Job j", 0, True)
    queued = {"queue": "tpu"}
    js = jobset(annotation=scheduling_annotation({"scheduling": queued}))
    actions = decide(job(PENDING, queued), Observed(js, (), ADMITTED, refused), NOW)
    assert actions.status["phase"] == "Failed"
    assert [(e.type, e.reason) for e in actions.events] == [("Warning", "JobCreationFailed")]
    assert actions.jobset_patch == SUSPEND and actions.workload_active is False
    assert [e.reason for e in actions.jobset_events] == ["JobSetSuspended"]

    failed = job(actions.status, queued)
    again = decide(failed, Observed(js, (), DEACTIVATED, refused), NOW)
    assert again.status is None and again.events == [] and not again.create
    assert again.jobset_patch == SUSPEND and again.workload_active is None
    stopped = decide(failed, Observed(jobset(suspend=True), (), DEACTIVATED, refused), NOW)
    assert stopped.jobset_patch == {} and stopped.workload_active is None
    assert decide(failed, Observed(None), NOW).create is False  # a JobSet gone stays gone
    deleting = job(actions.status, queued, deleting=True)
    assert decide(deleting, Observed(js, (), ADMITTED, refused), NOW).jobset_patch == {}


def test_status_event_on_phase_and_new_warning_reasons():
    pending = {
        "phase": "Pending",
        "conditions": [{"type": "Running", "status": "False", "reason": "WaitingForPods"}],
    }
    unschedulable = {
        **pending,
        "conditions": [{"type": "Running", "status": "False", "reason": "Unschedulable"}],
        "message": "m",
    }
    assert status_event({}, pending) == Event("Normal", "Pending", "")
    assert status_event(pending, pending) is None
    assert status_event(pending, unschedulable) == Event("Warning", "Unschedulable", "m")
    assert status_event(unschedulable, unschedulable) is None
    assert status_event(pending, {}) is None


def test_summaries_keep_what_is_read_and_drop_the_rest():
    full = jobset(annotation=ANNOTATED, labels={"kueue.x-k8s.io/queue-name": "q"})
    full["metadata"]["managedFields"] = [{"manager": "x"}]
    full["metadata"]["annotations"]["other"] = "x" * 1000
    template = full["spec"]["replicatedJobs"][0]["template"]["spec"]
    template["template"] = {
        "spec": {"containers": [{"name": "trainer", "env": [{"name": "A"}] * 50}]}
    }
    summary = jobset_summary(full)
    assert "managedFields" not in summary["metadata"]
    assert summary["metadata"]["annotations"] == {SCHEDULING_ANNOTATION: ANNOTATED}
    assert summary["spec"]["replicatedJobs"] == [
        {"name": "slice", "replicas": 1, "template": {"spec": {"parallelism": 1}}}
    ]
    assert summary["metadata"]["labels"] == {"kueue.x-k8s.io/queue-name": "q"}
    assert summary["status"] == full["status"]
    ptj = job(status=PENDING)
    ptj["metadata"]["annotations"] = {"kubectl.kubernetes.io/last-applied-configuration": "{}"}
    ptj["metadata"]["managedFields"] = [{}]
    kept = job_summary(ptj)
    assert "annotations" not in kept["metadata"] and "managedFields" not in kept["metadata"]
    assert kept["spec"] == ptj["spec"] and kept["status"] == PENDING


def test_queue_runs_each_key_once_at_a_time_and_backs_off():
    async def scenario():
        runs, gate = [], asyncio.Event()

        async def work(key):
            runs.append((key, asyncio.get_running_loop().time()))
            if key == "slow":
                await gate.wait()

        queue = WorkQueue(work, workers=4)
        queue.start()
        for key in ("slow", "a", "a", "b"):
            queue.add(key)
        await asyncio.sleep(0.05)
        assert [k for k, _ in runs] == ["slow", "a", "b"]  # "a" queued once
        queue.add("slow")  # while it runs: once more after, not twice at once
        await asyncio.sleep(0.05)
        assert [k for k, _ in runs].count("slow") == 1
        gate.set()
        await asyncio.sleep(0.05)
        assert [k for k, _ in runs].count("slow") == 2
        start = asyncio.get_running_loop().time()
        queue.retry("c", 0.05)
        queue.add("c")  # an event before the retry is due does not run it sooner
        await asyncio.sleep(0.02)
        assert "c" not in [k for k, _ in runs]
        await asyncio.sleep(0.06)
        first = [t for k, t in runs if k == "c"]
        assert len(first) == 1 and first[0] - start >= 0.05
        queue.retry("c", 0.05)  # the second failure in a row waits twice as long
        before = asyncio.get_running_loop().time()
        await asyncio.sleep(0.07)
        assert len([k for k, _ in runs if k == "c"]) == 1
        await asyncio.sleep(0.06)
        assert [t for k, t in runs if k == "c"][-1] - before >= 0.1
        queue.forget("c")
        await queue.stop()

    asyncio.run(scenario())


def test_user_suspend_deactivates_an_admitted_workload():
    from posttrain.controller.phase import WorkloadState

    suspended = job(status=PENDING, scheduling={"suspend": True})
    js = jobset(annotation=scheduling_annotation(suspended["spec"]), suspend=False)
    admitted = WorkloadState(True, name="w")
    assert decide(suspended, Observed(js, (), admitted), NOW).workload_active is False
    inactive = WorkloadState(False, "Deactivated", "m", "w", False)
    assert decide(suspended, Observed(js, (), inactive), NOW).workload_active is None
    resumed = job(status=PENDING)
    assert decide(resumed, Observed(js, (), inactive), NOW).workload_active is True
    assert decide(resumed, Observed(js, (), None), NOW).workload_active is None


# The progress deadline (spec.scheduling.progressDeadlineSeconds): a running job whose
# trainer stopped reporting is restarted while maxRestarts allows, else failed.
START = "2026-01-01T10:00:00Z"  # the trainer's pods started (this attempt)


def running_job(progress=None, restarts=0, pods=(), **scheduling):
    """A job whose status the operator wrote for its running JobSet and `pods`."""
    js = jobset(annotation=ANNOTATED, ready=1)
    js["status"]["restarts"] = restarts
    spec = job(scheduling=scheduling)["spec"]
    status = status_patch(js, spec, {}, NOW, 1, pods) | {"progress": progress or {}}
    return job(status=status, scheduling=scheduling), js


def pod(started=START, attempt=0):
    return PodState("j-slice-0-0", "slice", 0, attempt, True, False, started_at=started)


def beat(at, phase="training", step=812):
    return {"updatedAt": at, "phase": phase, "step": step}


DEADLINES = [
    # (case, progress, restarts, scheduling, now, pods, outcome, message or check-in seconds)
    ("step reported 10 min ago: look again in 21 (the watchdog's minute first)",
     beat("2026-01-01T11:00:00Z"), 0, {}, "2026-01-01T11:10:00Z", [pod()], "wait", 1260),
    ("30 min and the watchdog's minute: restart 1 of 3", beat("2026-01-01T11:00:00Z"), 0,
     {}, "2026-01-01T11:31:00Z", [pod()], "restart",
     "no progress since 11:00 UTC (last: step 812, training; deadline 30m, "
     "spec.scheduling.progressDeadlineSeconds): restarting the JobSet (restart 1 of 3)"),
    ("evaluating: the same deadline", beat("2026-01-01T11:00:00Z", "evaluating"), 1, {},
     "2026-01-01T11:31:00Z", [pod(attempt=1)], "restart", "restart 2 of 3"),
    ("no restarts left: failed with the reason", beat("2026-01-01T14:02:00Z"), 3, {},
     "2026-01-01T14:40:00Z", [pod(attempt=3)], "fail",
     "no progress since 14:02 UTC (last: step 812, training; deadline 30m, "
     "spec.scheduling.progressDeadlineSeconds); no restarts left "
     "(spec.scheduling.maxRestarts 3)"),
    ("maxRestarts 0: fails at once", beat("2026-01-01T11:00:00Z"), 0, {"maxRestarts": 0},
     "2026-01-01T11:31:00Z", [pod()], "fail", "no restarts left"),
    ("compiling the first step: 3 times as long", beat("2026-01-01T10:05:00Z", "compiling", 0),
     0, {}, "2026-01-01T11:00:00Z", [pod()], "wait", 2160),
    ("exporting: 3 times as long", beat("2026-01-01T11:00:00Z", "exporting", 1000), 0, {},
     "2026-01-01T12:00:00Z", [pod()], "wait", 1860),
    ("nothing reported since the pods started: 90 min grace", None, 0, {},
     "2026-01-01T11:29:00Z", [pod()], "wait", 120),
    ("nothing reported since the pods started, past the grace", None, 0, {},
     "2026-01-01T11:31:00Z", [pod()], "restart",
     "no progress since 10:00 UTC (no report since the trainer started; deadline 90m"),
    ("a report of the attempt before the restart does not count",
     beat("2026-01-01T09:00:00Z"), 1, {}, "2026-01-01T10:20:00Z",
     [pod("2026-01-01T10:00:00Z", attempt=1)], "wait", 4260),
    ("pods of an earlier attempt do not count", None, 1, {}, "2026-01-01T11:40:00Z",
     [pod("2026-01-01T08:00:00Z", attempt=0), pod("2026-01-01T10:30:00Z", attempt=1)],
     "wait", 1260),
    ("a shorter deadline, a tenth of it after the watchdog", beat("2026-01-01T11:00:00Z"), 0,
     {"progressDeadlineSeconds": 90}, "2026-01-01T11:01:38Z", [pod()], "wait", 1),
    ("a shorter deadline, passed", beat("2026-01-01T11:00:00Z"), 0,
     {"progressDeadlineSeconds": 90}, "2026-01-01T11:01:39Z", [pod()], "restart",
     "deadline 90s"),
    ("deadline 0: never", beat("2026-01-01T11:00:00Z"), 0, {"progressDeadlineSeconds": 0},
     "2026-01-02T11:00:00Z", [pod()], "wait", None),
    ("no pod start known yet: nothing to measure", None, 0, {}, "2026-01-02T11:00:00Z",
     [pod(None)], "wait", None),
]  # fmt: skip


@pytest.mark.parametrize(
    "case,progress,restarts,scheduling,now,pods,outcome,expected",
    DEADLINES,
    ids=[t[0] for t in DEADLINES],
)
def test_progress_deadline(case, progress, restarts, scheduling, now, pods, outcome, expected):
    ptj, js = running_job(progress, restarts, pods, **scheduling)
    actions = decide(ptj, Observed(js, tuple(pods)), now)
    if outcome == "wait":
        assert actions.restart is None and actions.status is None
        assert actions.check_in == expected
    elif outcome == "restart":
        assert actions.restart is not None and actions.restart.type == "Warning"
        assert actions.restart.reason == "ProgressDeadlineExceeded"
        assert expected in actions.restart.message
        # Restarting, saying why, until the JobSet controller has restarted it.
        assert actions.status["phase"] == "Restarting"
        assert actions.status["message"] == actions.restart.message
        running = {c["type"]: c for c in actions.status["conditions"]}["Running"]
        assert running["reason"] == "ProgressDeadlineExceeded"
        assert not actions.events and not actions.jobset_patch
    else:
        assert actions.restart is None
        assert actions.status["phase"] == "Failed" and actions.status["restarts"] == restarts
        assert expected in actions.status["message"]
        failed = {c["type"]: c for c in actions.status["conditions"]}["Failed"]
        assert failed["reason"] == "ProgressDeadlineExceeded"
        assert expected in failed["message"]
        assert [(e.type, e.reason) for e in actions.events] == [
            ("Warning", "ProgressDeadlineExceeded")
        ]
        assert actions.jobset_patch == {"spec": {"suspend": True}}  # its pods stop


def test_a_stalled_job_is_restarted_once_per_attempt():
    """Until the JobSet controller restarts it, later reconciles do not end it again."""
    ptj, js = running_job(beat("2026-01-01T11:00:00Z"), 0, [pod()])
    first = decide(ptj, Observed(js, (pod(),)), "2026-01-01T12:00:00Z")
    ptj["status"] |= first.status  # as written: Restarting, with why
    observed = Observed(js, (pod(),), restart_requested=True)
    actions = decide(ptj, observed, "2026-01-01T12:00:10Z")
    assert actions.restart is None and actions.status is None and actions.check_in is None
    assert not actions.events and not actions.jobset_patch


def test_a_job_not_running_has_no_deadline():
    ptj, js = running_job(beat("2026-01-01T11:00:00Z"))
    js["status"]["replicatedJobsStatus"] = [{"name": "slice", "ready": 0}]
    waiting = PodState("p", "slice", 0, 0, False, False, started_at=START)
    actions = decide(ptj, Observed(js, (waiting,)), "2026-01-02T12:00:00Z")
    assert actions.restart is None and actions.check_in is None
    assert actions.status["phase"] == "Pending"


def test_queue_later_keeps_the_earlier_time():
    """A job's progress deadline moves earlier when its trainer starts steps (a compile's
    longer deadline ends): `later` runs it at the earlier of two times, once."""

    async def scenario():
        runs = []

        async def work(key):
            runs.append(asyncio.get_running_loop().time())

        queue = WorkQueue(work, workers=1)
        queue.start()
        start = asyncio.get_running_loop().time()
        queue.later("j", 5.0)
        queue.later("j", 0.05)  # earlier: replaces it
        queue.later("j", 1.0)  # later than the one set: ignored
        await asyncio.sleep(0.2)
        assert len(runs) == 1 and 0.05 <= runs[0] - start < 0.2
        await asyncio.sleep(1.0)
        assert len(runs) == 1  # nothing left from the others
        await queue.stop()

    asyncio.run(scenario())


def test_the_trainers_labels_name_the_heartbeat_phases():
    from posttrain.api import heartbeat
    from posttrain.api.spec import SchedulingSpec

    assert SchedulingSpec().progress_deadline_seconds == heartbeat.DEFAULT_DEADLINE_S == 1800
    labels = {
        "compiling and running step 1": "compiling",
        "evaluating step 20": "evaluating",
        "checkpointing step 20": "checkpointing",
        "exporting": "exporting",
        None: "training",
        "something else": "training",
    }
    assert {k: heartbeat.phase_of(k) for k in labels} == labels
    assert heartbeat.deadline_seconds(600, "training") == 600
    assert heartbeat.deadline_seconds(600, "compiling") == 1800
    assert heartbeat.deadline_seconds(600, None) == 1800  # nothing reported since start
    assert heartbeat.deadline_seconds(0, "training") is None
