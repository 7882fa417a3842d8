"""posttrain validate against the hostile corpus: every bad job refused with the field
named, every edge-case valid job accepted, nothing raised."""

import pytest
from hostile_jobs import CASES

from posttrain.checks import validate
from posttrain.render import render


def test_corpus_is_large_and_ids_unique():
    assert len(CASES) >= 150
    assert len({c.id for c in CASES}) == len(CASES)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_validate_agrees_with_the_corpus(case):
    job, errors = validate(case.doc())
    if case.field is None:
        assert errors == [], [str(e) for e in errors]
        assert [o["kind"] for o in render(job)][-1] == "JobSet"  # what is admitted renders
        return
    assert errors, f"{case.id} was accepted"
    assert case.field in {e.field for e in errors}, [str(e) for e in errors]
    for e in errors:  # what is echoed cannot forge lines or reorder text
        assert "\n" not in str(e) and "\x1b" not in str(e) and "\u202e" not in str(e)


def test_the_crds_name_limits_are_the_coordinator_labels():
    from posttrain.api import rules
    from posttrain.render.names import max_name_length

    assert rules.NAME_MAX == max_name_length("node") == max_name_length("slice") == 26
    assert rules.NAME_MAX_PATHWAYS == max_name_length("pathways-head") == 22


@pytest.mark.parametrize(
    "model,key",
    [
        ("zero-heads", "num_attention_heads"),
        ("hidden-overflow", "hidden_size"),
        ("list", "expected a JSON object"),
        ("not-json", "not JSON"),
        ("vision-list", "vision_config"),
    ],
)
def test_a_bad_config_json_is_one_line_naming_the_file_and_key(model, key):
    from hostile_jobs import MODELS, valid_job

    doc = valid_job("bad-config")
    doc["spec"]["model"]["source"] = str(MODELS / model)
    _, errors = validate(doc)
    (error,) = [e for e in errors if e.field == "spec.model.source"]
    assert f"{MODELS / model / 'config.json'}: " in error.message and key in error.message
    assert "\n" not in str(error)


def test_bytes_that_are_not_utf8_are_refused_in_the_field_that_holds_them():
    from hostile_jobs import SPEC

    from posttrain.api.documents import parse_documents

    text = SPEC.replace("NAME", "bytes").replace("/models/tiny", "/models/ti\xffny")
    (doc,) = parse_documents(text.encode("utf-8").replace(b"\xc3\xbf", b"\xff"))
    _, errors = validate(doc)
    assert [e.field for e in errors] == ["spec.model.source"] and "not UTF-8" in str(errors[0])
