"""spec.tracking: MLflow and Weights & Biases settings, each error naming its field, and no
credential in a tracker's URI."""

import pytest
from invalid_jobs import valid_job

from posttrain.checks import validate


def _job(tracking: dict) -> dict:
    doc = valid_job()
    doc["spec"]["tracking"] = tracking
    return doc


def test_both_trackers_accepted_with_defaults():
    job, errors = validate(
        _job(
            {
                "mlflow": {
                    "trackingUri": "https://mlflow.example.com:5000/prefix",
                    "tokenSecret": {"name": "mlflow-token"},
                },
                "wandb": {"project": "posttrain", "apiKeySecret": {"name": "wandb", "key": "k"}},
            }
        )
    )
    assert errors == []
    tracking = job.spec.tracking
    assert tracking.mlflow.run_name == "{name}" and tracking.mlflow.experiment is None
    assert tracking.wandb.mode == "online" and tracking.log_weights is False
    wire = job.spec.to_wire()["tracking"]
    assert wire["mlflow"]["tokenSecret"] == {"name": "mlflow-token", "key": "token"}


@pytest.mark.parametrize(
    "tracking, field, message",
    [
        ({"mlflow": {"trackingUri": "https://user:pw@mlflow.example.com"}},
         "spec.tracking.mlflow.trackingUri", "no credentials"),
        ({"mlflow": {"trackingUri": "https://mlflow.example.com/?token=abc"}},
         "spec.tracking.mlflow.trackingUri", "query string"),
        ({"mlflow": {"trackingUri": "file:///tmp/mlruns"}},
         "spec.tracking.mlflow.trackingUri", "http:// or https://"),
        ({"mlflow": {"trackingUri": "HTTP://mlflow"}},
         "spec.tracking.mlflow.trackingUri", "lower case"),
        ({"mlflow": {"runName": "{name}-{pod}"}}, "spec.tracking.mlflow.runName", "{pod}"),
        ({"mlflow": {"usernameSecret": {"name": "basic", "key": "username"}}},
         "spec.tracking.mlflow", "both usernameSecret and passwordSecret"),
        ({"mlflow": {"tokenSecret": {"name": "t"}, "usernameSecret": {"name": "b"},
                     "passwordSecret": {"name": "b", "key": "password"}}},
         "spec.tracking.mlflow", "not both"),
        ({"mlflow": {"tokenSecret": {"name": "t", "key": ".."}}},
         "spec.tracking.mlflow.tokenSecret.key", ""),
        ({"wandb": {"project": "p", "mode": "sometimes"}}, "spec.tracking.wandb.mode", ""),
        ({"wandb": {}}, "spec.tracking.wandb.project", ""),
        ({"wandb": {"project": "a/b"}}, "spec.tracking.wandb.project", ""),
        ({"wandb": {"project": "p", "baseUrl": "https://key@wandb.example.com"}},
         "spec.tracking.wandb.baseUrl", "no credentials"),
        ({"wandb": {"project": "p", "apiKey": "secret-value"}}, "spec.tracking.wandb.apiKey", ""),
        ({}, "spec.tracking", "mlflow, wandb or both"),
    ],
)  # fmt: skip
def test_bad_tracking_names_its_field(tracking, field, message):
    _, errors = validate(_job(tracking))
    matching = [e for e in errors if e.field == field]
    assert matching, [str(e) for e in errors]
    assert any(message.lower() in e.message.lower() for e in matching), matching
    # A refused credential is not echoed back in the error.
    assert not any("pw@" in e.message or "abc" in e.message for e in errors)
