"""The operator's per-job gauges: what a PostTrainJob's status means for them."""

from __future__ import annotations

import copy
import datetime
import time
from typing import Any

import pytest
from prometheus_client import REGISTRY

from posttrain.controller import metrics

T0 = "2026-03-01T10:00:00Z"
T1 = "2026-03-01T10:05:00Z"


def ts(text: str) -> float:
    return datetime.datetime.fromisoformat(text.replace("Z", "+00:00")).timestamp()


def job(status: dict[str, Any] | None = None, name: str = "sft") -> dict[str, Any]:
    body: dict[str, Any] = {
        "metadata": {"namespace": "team-a", "name": name, "uid": f"uid-{name}"},
    }
    body["metadata"]["creationTimestamp"] = "2026-03-01T09:59:00Z"
    if status is not None:
        body["status"] = status
    return body


def cond(ctype: str, status: str, when: str) -> dict[str, str]:
    return {"type": ctype, "status": status, "lastTransitionTime": when}


CREATED = ts("2026-03-01T09:59:00Z")
NOW = ts("2026-03-01T12:00:00Z")
RUNNING_SINCE_T0 = {"phase": "Running", "conditions": [cond("Running", "True", T0)]}


def seen(phase: str, entered: float) -> metrics.JobSeries:
    return metrics.JobSeries("team-a", "sft", phase, entered, 0, None, None)


@pytest.mark.parametrize(
    ("status", "previous", "expected"),
    [
        # First seen (the operator just started): from the status.
        (None, None, CREATED),  # no status yet: created
        ({"phase": "Pending", "conditions": []}, None, CREATED),
        ({"phase": "Pending", "conditions": [cond("Running", "False", T0)]}, None, ts(T0)),
        (
            # Queued -> Running: Queued flipped to False when Running flipped to True.
            {
                "phase": "Running",
                "conditions": [cond("Queued", "False", T1), cond("Running", "True", T1)],
            },
            None,
            ts(T1),
        ),
        (
            # Running -> Pending: the newest transition is the Running flip.
            {
                "phase": "Pending",
                "conditions": [cond("Queued", "False", T0), cond("Running", "False", T1)],
            },
            None,
            ts(T1),
        ),
        (
            {"phase": "Queued", "conditions": [cond("Queued", "True", "not a time")]},
            None,
            CREATED,
        ),
        # Restarting keeps Running=True: its conditions date the run, not the restart.
        ({**RUNNING_SINCE_T0, "phase": "Restarting"}, None, NOW),
        # Seen before: the same phase keeps its time; a flip since dates the new phase.
        (RUNNING_SINCE_T0, seen("Running", ts(T0)), ts(T0)),
        (
            {
                "phase": "Pending",
                "conditions": [cond("Queued", "False", T1), cond("Running", "False", T1)],
            },
            seen("Queued", ts(T0)),
            ts(T1),
        ),
        # Running -> Restarting moves no condition: now.
        ({**RUNNING_SINCE_T0, "phase": "Restarting"}, seen("Running", ts(T0)), NOW),
        ({**RUNNING_SINCE_T0, "phase": "Restarting"}, seen("Restarting", NOW - 60), NOW - 60),
        # Restarting -> Running again, conditions still those of the first run: now.
        (RUNNING_SINCE_T0, seen("Restarting", NOW - 60), NOW),
    ],
)
def test_phase_entered(
    status: dict[str, Any] | None, previous: metrics.JobSeries | None, expected: float
) -> None:
    assert metrics.phase_entered(job(status), previous, NOW) == expected


@pytest.mark.parametrize(
    ("status", "phase", "restarts", "progress", "tokens"),
    [
        (None, "Pending", 0, None, None),
        ({"phase": "Queued"}, "Queued", 0, None, None),
        (
            {"phase": "Running", "restarts": 2, "progress": {"step": 25, "totalSteps": 100}},
            "Running",
            2,
            0.25,
            None,
        ),
        (
            {"phase": "Running", "progress": {"step": 5, "tokensPerSecond": 812.5}},
            "Running",
            0,
            None,  # no totalSteps: no ratio
            812.5,
        ),
        (
            {"phase": "Restarting", "progress": {"step": 3, "totalSteps": 0}},
            "Restarting",
            0,
            None,
            None,
        ),
    ],
)
def test_active_job_series(status, phase, restarts, progress, tokens) -> None:
    series = metrics.job_series(job(status))
    assert series is not None
    assert (series.namespace, series.name, series.phase) == ("team-a", "sft", phase)
    assert (series.restarts, series.progress, series.tokens_per_second) == (
        restarts,
        progress,
        tokens,
    )


@pytest.mark.parametrize("phase", ["Succeeded", "Failed"])
def test_finished_jobs_have_no_series(phase: str) -> None:
    assert (
        metrics.job_series(job({"phase": phase, "conditions": [cond(phase, "True", T0)]})) is None
    )


def sample(name: str, **labels: str) -> float | None:
    return REGISTRY.get_sample_value(name, labels)


def test_series_follow_the_job_and_go_with_it() -> None:
    labels = {"job_namespace": "team-a", "job_name": "gauges"}
    entered = "posttrain_job_phase_entered_timestamp_seconds"
    queued = job({"phase": "Queued", "conditions": [cond("Queued", "True", T0)]}, "gauges")
    metrics.observe_job_series(queued)
    assert sample(entered, **labels, phase="Queued") == ts(T0)
    assert sample("posttrain_job_progress_ratio", **labels) is None

    running = job(
        {
            "phase": "Running",
            "restarts": 1,
            "conditions": [cond("Queued", "False", T1), cond("Running", "True", T1)],
            "progress": {"step": 10, "totalSteps": 40, "tokensPerSecond": 100.0},
        },
        "gauges",
    )
    metrics.observe_job_series(running)
    assert sample(entered, **labels, phase="Queued") is None  # one phase series per job
    assert sample(entered, **labels, phase="Running") == ts(T1)
    assert sample("posttrain_job_restarts", **labels) == 1
    assert sample("posttrain_job_progress_ratio", **labels) == 0.25
    assert sample("posttrain_job_tokens_per_second", **labels) == 100.0

    restarting = copy.deepcopy(running)
    restarting["status"].update(phase="Restarting", restarts=2)
    before = time.time()
    metrics.observe_job_series(restarting)  # the Running condition did not move
    assert sample(entered, **labels, phase="Restarting") >= before
    assert sample("posttrain_job_restarts", **labels) == 2

    done = job({"phase": "Succeeded", "conditions": [cond("Succeeded", "True", T1)]}, "gauges")
    metrics.observe_job_series(done)
    for name in (
        "posttrain_job_restarts",
        "posttrain_job_progress_ratio",
        "posttrain_job_tokens_per_second",
    ):
        assert sample(name, **labels) is None, name
    assert sample(entered, **labels, phase="Running") is None

    metrics.observe_job_series(running)
    metrics.forget_job("uid-gauges")  # deleted
    assert sample(entered, **labels, phase="Running") is None
    assert sample("posttrain_job_restarts", **labels) is None


def test_jobs_by_phase_counts_each_job_once() -> None:
    def counts() -> dict[str, float | None]:
        return {p: sample("posttrain_jobs", phase=p) for p in ("Pending", "Running", "Failed")}

    before = counts()
    metrics.observe_job("uid-count-a", "Pending")
    metrics.observe_job("uid-count-a", "Pending")  # the same job again: counted once
    metrics.observe_job("uid-count-b", "Pending")
    metrics.observe_job("uid-count-b", "Running")
    after = counts()
    assert after["Pending"] == before["Pending"] + 1
    assert after["Running"] == before["Running"] + 1
    assert after["Failed"] == before["Failed"] is not None  # every phase has a series
    metrics.forget_job("uid-count-a")
    metrics.forget_job("uid-count-b")
    metrics.forget_job("uid-count-b")  # gone already: no change
    assert counts() == before
