"""Which pod `posttrain logs` reads: JAX process 0 of the newest restart attempt."""

from __future__ import annotations

from posttrain.logs import leader_pod


def pod(name, rjob="slice", job_index="0", index="0", attempt="0", created="2026-01-01T00:00:00Z"):
    labels = {
        "jobset.sigs.k8s.io/replicatedjob-name": rjob,
        "jobset.sigs.k8s.io/job-index": job_index,
        "jobset.sigs.k8s.io/restart-attempt": attempt,
    }
    meta = {"name": name, "labels": labels, "creationTimestamp": created}
    if index is not None:
        meta["annotations"] = {"batch.kubernetes.io/job-completion-index": index}
    return {"metadata": meta}


def test_process_zero_of_the_first_replicated_job():
    pods = [
        pod("w1", rjob="slice", index="1"),
        pod("s1", rjob="slice", job_index="1"),
        pod("p0", rjob="slice"),
        pod("worker", rjob="worker"),
    ]
    assert leader_pod(pods, "slice")["metadata"]["name"] == "p0"
    assert leader_pod(pods, "pathways-head") is None


def test_the_newest_restart_attempt_wins_then_the_newest_pod():
    pods = [
        pod("a0", attempt="0"),
        pod("a2-old", attempt="2", created="2026-01-01T00:00:01Z"),
        pod("a2-new", attempt="2", created="2026-01-01T00:00:05Z"),
        pod("a10", attempt="10"),  # numeric order, not text order
    ]
    assert leader_pod(pods, "slice")["metadata"]["name"] == "a10"
    assert leader_pod(pods[:3], "slice")["metadata"]["name"] == "a2-new"


def test_the_completion_index_may_be_a_label():
    p = pod("p", index=None)
    p["metadata"]["labels"]["batch.kubernetes.io/job-completion-index"] = "0"
    assert leader_pod([p], "slice") is p
    assert leader_pod([pod("q", index=None)], "slice") is None


def test_why_a_pod_has_no_log_yet():
    from posttrain.logs import not_started

    assert not_started({"status": {}}) == "not scheduled yet"
    unschedulable = {"type": "PodScheduled", "status": "False", "message": "0/3 nodes"}
    assert not_started({"status": {"phase": "Pending", "conditions": [unschedulable]}}) == (
        "not scheduled: 0/3 nodes"
    )
    pulling = {"name": "trainer", "state": {"waiting": {"reason": "ErrImagePull", "message": "x"}}}
    assert not_started({"status": {"phase": "Pending", "containerStatuses": [pulling]}}) == (
        "ErrImagePull: x"
    )
    assert not_started({"status": {"phase": "Pending"}, "spec": {"nodeName": "n"}}) == "Pending"
    assert not_started({"status": {"phase": "Running"}}) is None
