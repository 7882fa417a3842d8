"""The operator's caches: jobs held packed, Kueue's visibility API read per LocalQueue."""

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
