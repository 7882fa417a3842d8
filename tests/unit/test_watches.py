"""The operator's caches: jobs held packed, Kueue's visibility API read per LocalQueue."""

import asyncio

import kopf

from posttrain.controller import watches
from posttrain.controller.watches import QueuePositions

SUMMARY = {
    "kind": "PendingWorkloadsSummary",
    "items": [
        {
            "metadata": {"name": "jobset-a-1"},
            "positionInLocalQueue": 0,
            "positionInClusterQueue": 2,
        },
        {
            "metadata": {"name": "jobset-b-1"},
            "positionInLocalQueue": 1,
            "positionInClusterQueue": 3,
        },
    ],
}


def test_one_read_per_local_queue_however_many_jobs():
    asked: list[tuple[str, str]] = []

    def fetch(namespace: str, queue: str):
        asked.append((namespace, queue))
        return SUMMARY if queue == "tpu" else None

    positions = QueuePositions(fetch, ttl=60, retry=60)
    for _ in range(50):  # fifty decisions about jobs of two queues
        assert positions.get("team", "tpu", "jobset-a-1") == (1, 3)
        assert positions.get("team", "tpu", "jobset-b-1") == (2, 4)
        assert positions.get("team", "gpu", "jobset-c-1") is None  # no API or no queue
    assert asked == [("team", "tpu"), ("team", "gpu")]


def test_positions_are_read_again_after_ttl():
    asked = []
    positions = QueuePositions(lambda ns, q: asked.append(q) or SUMMARY, ttl=0)
    positions.get("team", "tpu", "jobset-a-1")
    positions.get("team", "tpu", "jobset-a-1")
    assert asked == ["tpu", "tpu"]


def test_a_workload_not_listed_yet_is_asked_for_again_after_retry():
    summaries = [{"items": []}, SUMMARY]
    asked = []
    positions = QueuePositions(lambda ns, q: asked.append(q) or summaries[len(asked) - 1], 60, 0)
    assert positions.get("team", "tpu", "jobset-a-1") is None  # new since Kueue answered
    assert positions.get("team", "tpu", "jobset-a-1") == (1, 3)
    assert positions.get("team", "tpu", "jobset-b-1") == (2, 4)  # listed: no read
    assert asked == ["tpu", "tpu"]


def test_a_packed_job_reads_back_whole_and_as_a_fresh_copy():
    body = {
        "apiVersion": "posttrain.dev/v1alpha1",
        "kind": "PostTrainJob",
        "metadata": {"name": "j", "namespace": "ns", "uid": "u", "resourceVersion": "7"},
        "spec": {"model": {"id": "hf://m"}, "training": {"steps": 3}},
        "status": {"phase": "Pending", "conditions": [{"type": "Running", "status": "False"}]},
    }
    summary = watches.job_summary(body)
    stored = watches.packed(summary)
    assert isinstance(stored, bytes) and len(stored) < len(repr(summary))
    indexes = {"job_index": {("ns", "j"): [stored]}}
    first = watches.job(indexes, "ns", "j")
    assert first == summary
    first["status"]["phase"] = "Running"  # a reconcile's changes stay its own
    assert watches.job(indexes, "ns", "j") == summary
    assert watches.job(indexes, "ns", "other") is None


def _event_body(**fields):
    meta = {
        "name": "tune-1",
        "namespace": "team",
        "uid": "u1",
        "resourceVersion": "7",
        "labels": {"posttrain.dev/job-name": "tune"},
        "ownerReferences": [{"kind": "PostTrainJob", "name": "tune", "uid": "j1"}],
        "annotations": {"kubectl.kubernetes.io/last-applied-configuration": "x" * 4000},
        "managedFields": [{"manager": "posttrain", "fieldsV1": {"f:spec": {}}}],
    }
    raw = {"apiVersion": "v1", "kind": "Thing", "metadata": meta, **fields}
    return raw, kopf.Body(raw)


def test_an_indexed_jobset_leaves_kopf_only_its_metadata():
    template = {"spec": {"containers": [{"name": "trainer", "image": "t"}]}}
    raw, body = _event_body(
        spec={"replicatedJobs": [{"name": "node", "template": {"spec": {"template": template}}}]},
        status={"conditions": []},
    )
    index = asyncio.run(
        watches.jobset_index(namespace="team", labels=body.metadata.labels, body=body)
    )
    (summary,) = index.values()
    assert summary["spec"]["replicatedJobs"][0]["name"] == "node"  # the index has what it needs
    assert set(raw) == {"apiVersion", "kind", "metadata"}  # kopf's copy: no spec, no status
    assert "managedFields" not in raw["metadata"] and "annotations" not in raw["metadata"]
    assert raw["metadata"]["labels"] == {"posttrain.dev/job-name": "tune"}
    assert raw["metadata"]["ownerReferences"][0]["uid"] == "j1"


def test_an_indexed_job_keeps_its_spec_and_status_for_the_event_handler():
    raw, body = _event_body(spec={"technique": "sft"}, status={"phase": "Running"})
    index = asyncio.run(watches.job_index(namespace="team", name="tune-1", body=body))
    assert watches.job({"job_index": {k: [v] for k, v in index.items()}}, "team", "tune-1")[
        "status"
    ] == {"phase": "Running"}
    assert raw["spec"] == {"technique": "sft"} and raw["status"] == {"phase": "Running"}
    assert set(raw["metadata"]) == {
        "name",
        "namespace",
        "uid",
        "resourceVersion",
        "labels",
        "ownerReferences",
    }


def test_a_jobsets_refusal_events_make_it_blocked_until_its_jobs_are_made():
    """The JobSet controller's JobCreationFailed Events are indexed by JobSet name; with
    fewer Jobs than the JobSet asks for, the latest one is why the job waits or fails."""
    message = (
        'job "tune-node-0" creation failed with error: jobs.batch "tune-node-0" is forbidden: '
        "exceeded quota: jobs, requested: count/jobs.batch=1, used: count/jobs.batch=0, "
        "limited: count/jobs.batch=0"
    )
    raw = {
        "apiVersion": "v1",
        "kind": "Event",
        "metadata": {"name": "tune.1", "namespace": "team", "managedFields": [{}]},
        "involvedObject": {"kind": "JobSet", "name": "tune", "uid": "js1"},
        "reason": "JobCreationFailed",
        "message": message,
        "lastTimestamp": "2026-01-01T00:00:00Z",
        "source": {"component": "jobset"},
    }
    index = asyncio.run(watches.refusal_index(namespace="team", body=kopf.Body(raw)))
    assert set(raw) == {"apiVersion", "kind", "metadata", "involvedObject"}  # kopf's copy
    jobset = {
        "metadata": {"name": "tune", "uid": "js1"},
        "spec": {"replicatedJobs": [{"name": "node", "replicas": 1}]},
        "status": {},
    }
    indexes = {"refusal_index": {k: [v] for k, v in index.items()}, "batch_job_index": {}}
    cause = watches.blocked(indexes, "team", jobset)
    assert cause.reason == "JobCreationFailed" and not cause.final
    assert cause.message.endswith("limited: count/jobs.batch=0")
    indexes["batch_job_index"] = {("team", "tune"): [("job1", "js1")]}  # its Job is made
    assert watches.blocked(indexes, "team", jobset) is None
    other = {"involvedObject": {"kind": "Pod", "name": "p"}, "reason": "JobCreationFailed"}
    assert asyncio.run(watches.refusal_index(namespace="team", body=kopf.Body(other))) == {}


def test_a_jobs_refused_pods_block_its_job_until_they_are_made():
    raw = {
        "apiVersion": "events.k8s.io/v1",
        "kind": "Event",
        "metadata": {"name": "tune-node-0.1", "namespace": "team"},
        "regarding": {"kind": "Job", "name": "tune-node-0", "uid": "job1"},
        "reason": "FailedCreate",
        "note": 'Error creating: pods "tune-node-0-0-x" is forbidden: exceeded quota: q, '
        "requested: pods=1, used: pods=0, limited: pods=0",
        "eventTime": "2026-01-01T00:00:00.000000Z",
    }
    index = asyncio.run(watches.pod_refusal_index(namespace="team", body=kopf.Body(raw)))
    assert set(raw) == {"apiVersion", "kind", "metadata", "regarding"}
    jobset = {
        "metadata": {"name": "tune", "uid": "js1"},
        "spec": {"replicatedJobs": [{"name": "node", "replicas": 1}]},
        "status": {},
    }
    indexes = {
        "pod_refusal_index": {k: [v] for k, v in index.items()},
        "batch_job_index": {("team", "tune"): [("job1", "js1")]},
    }
    cause = watches.blocked(indexes, "team", jobset, pods_made=0)
    assert cause.reason == "PodCreationFailed" and "limited: pods=0" in cause.message
    assert watches.blocked(indexes, "team", jobset, pods_made=1) is None
    indexes["batch_job_index"] = {("team", "tune"): [("job1", "another-jobset")]}
    assert watches.blocked(indexes, "team", jobset, pods_made=0) is None
