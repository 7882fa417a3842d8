"""Trainer tier: one persistent JAX compilation cache for the whole session, shared with
the `posttrain` processes the tests start (a resumed run, a second host), so programs
that compile the same way load instead of compiling again."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="session", autouse=True)
def compilation_cache(tmp_path_factory):
    import jax
    from jax.experimental.compilation_cache import compilation_cache as cc

    path = str(tmp_path_factory.mktemp("jax-cache"))
    settings = {
        "jax_compilation_cache_dir": path,
        "jax_persistent_cache_min_compile_time_secs": 0.0,
    }
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


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    """A tiny random Llama checkpoint (tiny_model.make_tiny_llama), made once per module."""
    from tiny_model import make_tiny_llama

    return make_tiny_llama(tmp_path_factory.mktemp("tiny") / "llama")
