"""One persistent JAX compilation cache for `posttrain run`, `generate` and `export` on
this machine, so a program compiled once (a model's decoding step, a job's train step)
loads from disk the next time instead of compiling again.

It lives in ~/.cache/posttrain/jax (POSTTRAIN_JAX_CACHE names another directory; empty
turns it off), at most CACHE_MAX_BYTES, the least recently used entries going first. A
JAX_COMPILATION_CACHE_DIR already set (the user's own, the test tier's) wins. Entries are
keyed by the program, the compile options and the jax/jaxlib versions, so a stale one is
never loaded. Pods do not use it: their file system goes with them."""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from pathlib import Path

log = logging.getLogger("posttrain.trainer")
CACHE_MAX_BYTES = 2 << 30
ENV = "POSTTRAIN_JAX_CACHE"


def directory(environ: Mapping[str, str] = os.environ) -> str | None:
    """Where the cache is, or None when it is off or JAX_COMPILATION_CACHE_DIR decides."""
    if environ.get("JAX_COMPILATION_CACHE_DIR"):
        return None
    chosen = environ.get(ENV)
    if chosen == "":
        return None
    return chosen or str(Path.home() / ".cache" / "posttrain" / "jax")


def enable(environ: Mapping[str, str] = os.environ) -> str | None:
    """Point JAX at the cache (before the first compile); returns its directory, or None
    when it is off or already chosen by JAX_COMPILATION_CACHE_DIR."""
    path = directory(environ)
    if path is None:
        return None
    try:
        Path(path).mkdir(parents=True, exist_ok=True)
    except OSError as e:  # a read-only home: compile every time, as before
        log.info("no JAX compilation cache (%s)", e)
        return None
    import jax

    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_compilation_cache_max_size", CACHE_MAX_BYTES)
    return path
