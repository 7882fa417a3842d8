"""Admission: the PriorityClass, WorkloadPriorityClass and LocalQueue a job names.

`reference_checks` is pure over an `exists(kind, name, namespace)` lookup; the webhook
passes one that reads the API server (tests/integration/test_operator.py runs it)."""

import pytest
from invalid_jobs import valid_job

from posttrain.controller.admission import reference_checks
from posttrain.controller.webhook import review_response


def job(**scheduling) -> dict:
    body = valid_job("prio")
    body["metadata"]["namespace"] = "ml"
    body["spec"]["scheduling"] = scheduling
    return body


def lookup(present: set[tuple[str, str, str | None]], unknown: bool = False):
    calls = []

    def exists(kind, name, namespace):
        calls.append((kind, name, namespace))
        return None if unknown else (kind, name, namespace) in present

    return exists, calls


@pytest.mark.parametrize(
    "scheduling, present, field, fragment",
    [
        (
            {"priorityClass": "high"},
            set(),
            "spec.scheduling.priorityClass",
            "PriorityClass 'high' does not exist",
        ),
        (
            {"workloadPriorityClass": "urgent"},
            set(),
            "spec.scheduling.workloadPriorityClass",
            "WorkloadPriorityClass 'urgent' does not exist, so Kueue would never admit",
        ),
    ],
)
def test_missing_classes_are_refused(scheduling, present, field, fragment):
    exists, _ = lookup(present)
    errors, warnings = reference_checks(job(**scheduling), exists)
    assert [e.field for e in errors] == [field] and fragment in str(errors[0])
    assert warnings == []


def test_existing_references_pass_and_lookups_name_the_namespace():
    present = {
        ("PriorityClass", "high", None),
        ("WorkloadPriorityClass", "urgent", None),
        ("LocalQueue", "tpu", "ml"),
    }
    exists, calls = lookup(present)
    body = job(priorityClass="high", workloadPriorityClass="urgent", queue="tpu")
    assert reference_checks(body, exists) == ([], [])
    assert sorted(calls) == sorted(present)


def test_missing_queue_is_a_warning_and_failed_lookups_are_neither():
    exists, _ = lookup(set())
    errors, warnings = reference_checks(job(queue="tpu"), exists)
    assert errors == []
    assert warnings == [
        "spec.scheduling.queue: Kueue LocalQueue 'tpu' does not exist in namespace 'ml'; "
        "the job waits in phase Queued until it does"
    ]
    exists, _ = lookup(set(), unknown=True)
    assert reference_checks(job(queue="tpu", priorityClass="x"), exists) == ([], [])


def test_review_carries_the_refusal_and_the_warning():
    review = {"request": {"uid": "u1", "operation": "CREATE", "object": job(priorityClass="nope")}}
    exists, _ = lookup(set())
    response = review_response(review, exists)["response"]
    assert response["allowed"] is False
    assert "spec.scheduling.priorityClass" in response["status"]["message"]
    review["request"]["object"] = job(queue="tpu")
    response = review_response(review, exists)["response"]
    assert response["allowed"] is True and "LocalQueue 'tpu'" in response["warnings"][0]
    assert "warnings" not in review_response(review)["response"]  # no lookup: no check


def test_updates_check_only_changed_names():
    """A job whose PriorityClass was deleted after it was created can still be suspended;
    a changed workloadPriorityClass is checked again."""
    exists, calls = lookup(set())
    old = job(priorityClass="gone", workloadPriorityClass="urgent")
    new = job(priorityClass="gone", workloadPriorityClass="urgent", suspend=True)
    assert reference_checks(new, exists, old) == ([], []) and calls == []
    new["spec"]["scheduling"]["workloadPriorityClass"] = "other"
    errors, _ = reference_checks(new, exists, old)
    assert [e.field for e in errors] == ["spec.scheduling.workloadPriorityClass"]
