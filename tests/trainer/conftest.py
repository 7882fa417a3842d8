"""Trainer tier: one persistent JAX compilation cache for the whole session, shared with
the `posttrain` processes the tests start (a resumed run, a second host), so programs
that compile the same way load instead of compiling again. With POSTTRAIN_TEST_JAX_CACHE
set (scripts/test.sh sets it under ~/.cache) the cache outlives the session, so a
machine that has run the tier once compiles only what changed; otherwise it is a fresh
directory per session. Entries are keyed by the program, the compile options and the
jax/jaxlib versions, so a stale one is never loaded."""

from __future__ import annotations

import os
from pathlib import Path

import pytest


def _drop_entries_without_atime(path: Path) -> None:
    """With a maximum size, every write to JAX's cache first reads the access time file
    (`<key>-atime`) of every entry (`<key>-cache`); one entry without it (its process
    killed between the two writes, or written with no maximum size) makes every later
    write fail with a warning, and the kept cache stops growing for good. Such an entry
    may be cut short too: it goes, and compiles again once."""
    for entry in path.glob("*-cache"):
        if not entry.with_name(entry.name.removesuffix("-cache") + "-atime").exists():
            entry.unlink(missing_ok=True)


@pytest.fixture(scope="session", autouse=True)
def compilation_cache(tmp_path_factory):
    import jax
    from jax.experimental.compilation_cache import compilation_cache as cc

    kept = os.environ.get("POSTTRAIN_TEST_JAX_CACHE")  # kept between runs (scripts/test.sh)
    path = kept or str(tmp_path_factory.mktemp("jax-cache"))
    settings = {
        "jax_compilation_cache_dir": path,
        "jax_persistent_cache_min_compile_time_secs": 0.0,
    }
    if kept:
        settings["jax_compilation_cache_max_size"] = 2 << 30  # least recently used go first
        _drop_entries_without_atime(Path(kept))
    before = {name: getattr(jax.config, name) for name in settings}
    mp = pytest.MonkeyPatch()
    for name, value in settings.items():
        jax.config.update(name, value)
        mp.setenv(name.upper(), str(value))  # for child processes
    cc.reset_cache()
    yield path
    mp.undo()
    for name, value in before.items():
        jax.config.update(name, value)
    cc.reset_cache()


@pytest.fixture(scope="module", autouse=True)
def empty_jax_caches():
    """Each module starts with JAX's in-memory tracing and compilation caches empty, as a
    job's own process does (the persistent cache above still serves the programs). Late
    in the tier, a stale entry one module left (a cached signature holding a tracer) has
    failed a later module's trace with TracerBoolConversionError ("checking equality of
    metadata fields of pytree"): test_loop after test_models..test_compile_figures,
    test_vision after test_scan, test_vision_export; each module alone passes."""
    import jax

    jax.clear_caches()


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    """A tiny random Llama checkpoint (tiny_model.make_tiny_llama), made once per module."""
    from tiny_model import make_tiny_llama

    return make_tiny_llama(tmp_path_factory.mktemp("tiny") / "llama")
