"""Admission checks beyond CEL, and the memory estimate behind one of them."""

import pytest
from hostile_jobs import CASES as HOSTILE
from invalid_jobs import CASES, valid_job

from posttrain import capacity, catalog
from posttrain.api.spec import PostTrainJobSpec
from posttrain.checks import printable, validate
from posttrain.controller.admission import admission_errors
from posttrain.controller.webhook import review_response


def test_admission_refuses_what_does_not_fit_with_numbers():
    doc = valid_job()
    doc["spec"]["model"] = {"source": "gs://m/Llama-3.1-70B"}
    doc["spec"]["resources"] = {"accelerator": "v6e-8"}
    (err,) = admission_errors(doc, None)
    assert err.field == "spec.resources.accelerator"
    assert "does not fit" in err.message and "GiB" in err.message
    s = PostTrainJobSpec.model_validate(doc["spec"])
    placement = catalog.resolve("v6e-8")
    assert err.message == capacity.refusal(s, placement, capacity.estimate(s, placement))


def test_admission_refuses_catalog_errors_and_immutable_changes():
    webhook_only = [c for c in CASES if not c.server]
    assert webhook_only
    for case in webhook_only:
        assert case.field in {e.field for e in admission_errors(case.doc(), None)}
    old = valid_job()
    new = valid_job()
    new["spec"]["data"] = {"source": "/data/other.jsonl"}
    assert [e.field for e in admission_errors(new, old)] == ["spec.data"]
    new = valid_job()
    new["spec"]["scheduling"] = {"suspend": True}
    assert admission_errors(new, old) == []


def test_admission_refuses_bad_lora_regex():
    doc = valid_job()
    doc["spec"]["lora"] = {"targetModules": "q_proj("}
    (err,) = admission_errors(doc, None)
    assert err.field == "spec.lora.targetModules"


def test_admission_checks_lora_module_names_against_the_family():
    doc = valid_job()
    doc["spec"]["model"] = {"source": "/models/gemma", "family": "gemma3"}
    doc["spec"]["lora"] = {"targetModules": "q_proj, query_key_value"}
    (err,) = admission_errors(doc, None)
    assert err.field == "spec.lora.targetModules" and "'query_key_value'" in err.message
    doc["spec"]["lora"] = {"targetModules": "q_einsum,kv_einsum"}
    assert admission_errors(doc, None) == []
    doc["spec"]["model"]["family"] = "llama3"
    (err,) = admission_errors(doc, None)
    assert "llama3 models have no module named 'q_einsum', 'kv_einsum'" in err.message
    doc["spec"]["lora"] = {"targetModules": "layers/\\\\d+/attn/q_proj"}  # a regex: not a name list
    assert admission_errors(doc, None) == []


@pytest.mark.parametrize("case", HOSTILE, ids=lambda c: c.id)
def test_webhook_answers_the_hostile_corpus_as_validate_does(case):
    doc = case.doc()
    assert admission_errors(doc, None) == validate(doc)[1]
    review = {"request": {"uid": "u1", "operation": "CREATE", "object": doc}}
    response = review_response(review)["response"]
    assert response["uid"] == "u1" and response["allowed"] == (case.field is None)
    if case.field is not None:
        message = response["status"]["message"]
        assert printable(case.field) in message and "\n" not in message
