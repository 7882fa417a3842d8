"""posttrain validate: every invalid job is refused with an error naming its field."""

import pytest
from invalid_jobs import CASES, valid_job

from posttrain.checks import FieldError, immutable_changes, validate


def test_valid_job_has_no_errors():
    job, errors = validate(valid_job())
    assert errors == []
    assert job is not None
    assert job.spec.training.steps == 1000  # defaults filled in
    assert job.spec.resources.accelerator == "cpu"


def test_case_table_is_large_and_ids_unique():
    assert len(CASES) >= 25
    assert len({c.id for c in CASES}) == len(CASES)


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_invalid_job_names_field(case):
    _, errors = validate(case.doc())
    assert errors, f"{case.id} was accepted"
    matching = [e for e in errors if e.field == case.field]
    assert matching, f"no error names {case.field}; got {[str(e) for e in errors]}"
    assert any(case.message.lower() in e.message.lower() for e in matching), matching


def test_wrong_kind_and_version():
    doc = valid_job()
    doc["apiVersion"] = "posttrain.dev/v1"
    doc["kind"] = "TrainJob"
    _, errors = validate(doc)
    assert {e.field for e in errors} >= {"apiVersion", "kind"}


def test_every_error_reported_at_once():
    doc = valid_job()
    doc["spec"]["training"] = {"steps": 0, "learningRate": -1}
    doc["spec"]["lora"] = {"rank": 0}
    _, errors = validate(doc)
    fields = {e.field for e in errors}
    assert {"spec.training.steps", "spec.training.learningRate", "spec.lora.rank"} <= fields


def test_not_a_mapping():
    _, errors = validate(["a", "list"])
    assert errors == [FieldError("(document)", "expected a PostTrainJob mapping")]


def test_immutable_changes_lists_changed_fields_only():
    old = valid_job()["spec"]
    new = valid_job()["spec"]
    new["model"] = {"source": "/models/other"}
    new["scheduling"] = {"suspend": True, "ttlSecondsAfterFinished": 60}
    errors = immutable_changes(old, new)
    assert [e.field for e in errors] == ["spec.model"]
    assert "cannot change" in errors[0].message
    new["scheduling"]["queue"] = "other"
    assert "spec.scheduling.queue" in [e.field for e in immutable_changes(old, new)]


# -- strict reading, as the CRD reads ---------------------------------------------------


def test_valid_job_parsed_strictly_keeps_python_names_for_code():
    job, errors = validate(valid_job())
    assert errors == [] and job is not None
    # Python code may still build models by field name; documents may not.
    from posttrain.api.spec import TrainingSpec

    assert TrainingSpec(batch_size=4).batch_size == 4


@pytest.mark.parametrize(
    "value,field",
    [
        ("8", "spec.training.batchSize"),
        (8.5, "spec.training.batchSize"),
        (True, "spec.training.batchSize"),
    ],
)
def test_no_coercion(value, field):
    doc = valid_job()
    doc["spec"]["training"] = {"batchSize": value}
    _, errors = validate(doc)
    assert [e.field for e in errors] == [field]


def test_nan_and_inf_refused():
    for value in (float("nan"), float("inf"), float("-inf")):
        doc = valid_job()
        doc["spec"]["training"] = {"learningRate": value}
        _, errors = validate(doc)
        assert [e.field for e in errors] == ["spec.training.learningRate"]


def test_values_json_cannot_carry_are_refused():
    doc = valid_job()
    doc["spec"]["model"]["source"] = b"/models/tiny"
    _, errors = validate(doc)
    assert [e.field for e in errors] == ["(document)"]


def test_printable_escapes_control_and_bidi_characters():
    err = FieldError("spec.a\nb", "x\x1b[31m \u202eevil")
    assert str(err) == "spec.a\\nb: x\\x1b[31m \\u202eevil"


def test_status_is_read_as_the_operator_and_trainer_write_it():
    doc = valid_job()
    doc["status"] = {"phase": "Running", "progress": {"step": 3, "etaSeconds": 12.0}}
    job, errors = validate(doc)
    assert errors == [] and job.status.progress.eta_seconds == 12
    doc["status"] = {"phase": "Exploded"}
    _, errors = validate(doc)
    assert [e.field for e in errors] == ["status.phase"]


def test_max_restarts_cannot_change_as_jobsets_failure_policy_cannot():
    old, new = {"scheduling": {"maxRestarts": 3}}, {"scheduling": {"maxRestarts": 7}}
    assert [e.field for e in immutable_changes(old, new)] == ["spec.scheduling.maxRestarts"]


@pytest.mark.parametrize(
    "path,wrong,right",
    [
        ("training", "batch_size", "batchSize"),
        ("training", "learnig_rate", "learningRate"),
        ("output", "exporthf", "exportHF"),
        ("", "lorra", "lora"),
    ],
)
def test_an_unknown_field_says_which_it_may_mean(path, wrong, right):
    doc = valid_job()
    section = doc["spec"].setdefault(path, {}) if path else doc["spec"]
    section[wrong] = 1
    field = f"spec.{path}.{wrong}" if path else f"spec.{wrong}"
    (error,) = [e for e in validate(doc)[1] if e.field == field]
    assert error.message == f"unknown field (did you mean {right}?)"


def test_a_yaml_error_names_the_file_line_and_column(tmp_path):
    from posttrain.checks import InvalidJob, load_job

    path = tmp_path / "job.yaml"
    path.write_text("spec:\n  training: {steps: 10\n  x: 1\n")
    with pytest.raises(InvalidJob) as e:
        load_job(path)
    assert str(e.value).startswith(f"{path}: ") and "<unicode string>" not in str(e.value)
    assert "line 3, column" in str(e.value)
