"""Where `posttrain run`/`generate`/`export` keep compiled programs (compile_cache)."""

from __future__ import annotations

from pathlib import Path

from posttrain.trainer.compile_cache import directory, kept_copy


def test_the_cache_is_under_the_users_cache_unless_told_otherwise():
    assert directory({}) == str(Path.home() / ".cache" / "posttrain" / "jax")
    assert directory({"POSTTRAIN_JAX_CACHE": "/scratch/jax"}) == "/scratch/jax"
    assert directory({"POSTTRAIN_JAX_CACHE": ""}) is None  # off
    assert directory({"JAX_COMPILATION_CACHE_DIR": "/mine"}) is None  # JAX's own wins


def test_a_pod_keeps_its_cache_on_the_jobs_volume_for_the_pod_a_restart_makes():
    assert directory({}, "/outputs/run") == "/outputs/run/compile-cache"
    assert directory({"POSTTRAIN_JAX_CACHE": "/scratch"}, "/outputs/run") == (
        "/outputs/run/compile-cache"
    )
    assert directory({"JAX_COMPILATION_CACHE_DIR": "/mine"}, "/outputs/run") is None
    assert kept_copy("/outputs/run") is None


def test_a_pod_with_a_gcs_output_keeps_its_own_cache_and_a_copy_beside_the_checkpoints():
    assert directory({}, "gs://bucket/run") == str(Path.home() / ".cache" / "posttrain" / "jax")
    assert kept_copy("gs://bucket/run/") == "gs://bucket/run/compile-cache"
    assert kept_copy(None) is None
