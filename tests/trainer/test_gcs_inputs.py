"""A gs:// input that is not in its bucket is named before anything loads; the output,
which the run creates, need not exist."""

from __future__ import annotations

import pytest
from tiny_job import tiny_job, validated

from posttrain.trainer import storage
from posttrain.trainer.loop import check_gcs_locations

pytestmark = pytest.mark.trainer


def test_a_missing_gcs_input_is_named(monkeypatch):
    present = {"gs://models/tiny", "gs://data/train.jsonl"}
    monkeypatch.setattr(storage, "check_reachable", lambda uri, field: None)
    monkeypatch.setattr(storage, "exists", lambda uri: uri in present)
    doc = tiny_job("gs://models/tiny", "gs://data/train.jsonl", "gs://runs/new", steps=2, every=1)
    check_gcs_locations(validated(doc).spec)  # the output is made by the run
    doc["spec"]["data"]["source"] = "gs://data/tran.jsonl"
    with pytest.raises(ValueError, match=r"^spec.data.source: gs://data/tran.jsonl: no such"):
        check_gcs_locations(validated(doc).spec)
