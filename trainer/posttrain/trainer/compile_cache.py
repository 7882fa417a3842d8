"""One persistent JAX compilation cache for `posttrain run`, `generate` and `export` on
this machine, so a program compiled once (a model's decoding step, a job's train step)
loads from disk the next time instead of compiling again.

It lives in ~/.cache/posttrain/jax (POSTTRAIN_JAX_CACHE names another directory; empty
turns it off), at most CACHE_MAX_BYTES, the least recently used entries going first. A
JAX_COMPILATION_CACHE_DIR already set (the user's own, the test tier's) wins. Entries are
keyed by the program, the compile options and the jax/jaxlib versions, so a stale one is
never loaded.

A pod's own file system goes with it, so a pod keeps its cache beside its checkpoints
when the job's output is a volume path (output.uri a local path: a PersistentVolumeClaim):
`<output.uri>/compile-cache`, where the pod a restart (preemption, a lost host) makes
finds the programs the last one compiled. A gs:// output keeps none: every restart
compiles again."""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from pathlib import Path

log = logging.getLogger("posttrain.trainer")
CACHE_MAX_BYTES = 2 << 30
ENV = "POSTTRAIN_JAX_CACHE"


POD_DIR = "compile-cache"


def directory(environ: Mapping[str, str] = os.environ, output_uri: str | None = None) -> str | None:
    """Where the cache is, or None when it is off or JAX_COMPILATION_CACHE_DIR decides.
    `output_uri`: a pod's (its cache under a local output, none under gs://)."""
    if environ.get("JAX_COMPILATION_CACHE_DIR"):
        return None
    if output_uri is not None:
        return None if "://" in output_uri else str(Path(output_uri) / POD_DIR)
    chosen = environ.get(ENV)
    if chosen == "":
        return None
    return chosen or str(Path.home() / ".cache" / "posttrain" / "jax")


def enable(environ: Mapping[str, str] = os.environ, output_uri: str | None = None) -> str | None:
    """Point JAX at the cache (before the first compile); returns its directory, or None
    when it is off or already chosen by JAX_COMPILATION_CACHE_DIR. `output_uri`: a pod's
    job output (see the module's docstring)."""
    path = directory(environ, output_uri)
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
