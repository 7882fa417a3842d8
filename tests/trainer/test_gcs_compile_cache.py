"""A pod whose job writes to gs:// keeps its JAX compilation cache beside the checkpoints:
the entries it added are pushed when its run ends, and the pod a restart makes pulls them
before it compiles (against the GCS API of fake-gcs-server)."""

from __future__ import annotations

import logging

import pytest

from posttrain.trainer import compile_cache
from tests.trainer.data_helpers import gcs_bucket

pytestmark = pytest.mark.trainer


def test_a_pods_cache_goes_to_the_bucket_and_back(tmp_path):
    with gcs_bucket("ptcache") as bucket:
        remote = compile_cache.kept_copy(f"{bucket}/run")
        first = tmp_path / "first"
        first.mkdir()
        (first / "abc-cache").write_bytes(b"program")
        (first / "abc-atime").write_bytes(b"1")
        (first / ".lockfile").write_bytes(b"")  # the cache's own lock stays in the pod
        assert compile_cache.push(first, remote) == 2
        assert compile_cache.push(first, remote) == 0  # only what the bucket lacks
        again = tmp_path / "again"
        again.mkdir()
        (again / "abc-atime").write_bytes(b"2")  # what the pod has, it keeps
        assert compile_cache.pull(remote, again) == 1
        assert (again / "abc-cache").read_bytes() == b"program"
        assert (again / "abc-atime").read_bytes() == b"2"
        assert not (again / ".lockfile").exists()


def test_a_copy_that_cannot_be_read_costs_a_compile_not_the_run(tmp_path, caplog):
    with gcs_bucket("ptcache2"), caplog.at_level(logging.WARNING, "posttrain.trainer"):
        assert compile_cache.pull("gs://no-such-bucket/run/compile-cache", tmp_path) == 0
        assert compile_cache.push(tmp_path, "gs://no-such-bucket/run/compile-cache") == 0
    assert "compilation cache gs://no-such-bucket/run/compile-cache not read" in caplog.text
    assert "compilation cache not copied to gs://no-such-bucket" in caplog.text
