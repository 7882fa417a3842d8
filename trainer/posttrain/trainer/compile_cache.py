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
finds the programs the last one compiled. A gs:// output keeps the cache in the pod
(~/.cache/posttrain/jax) and a copy beside the checkpoints (`gs://.../compile-cache`):
a pod pulls the copy before its first compile (`enable`) and pushes the entries it
added when its run ends or stops on a signal (`push`), so the pod a preemption makes
loads its steps rather than compiling them. A copy that cannot be reached costs a
compile, never the run."""

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
    `output_uri`: a pod's (its cache under a local output; under gs://, the pod's own
    cache, copied to and from `kept_copy(output_uri)`)."""
    if environ.get("JAX_COMPILATION_CACHE_DIR"):
        return None
    if output_uri is not None and "://" not in output_uri:
        return str(Path(output_uri) / POD_DIR)
    chosen = environ.get(ENV)
    if chosen == "":
        return None
    return chosen or str(Path.home() / ".cache" / "posttrain" / "jax")


def kept_copy(output_uri: str | None) -> str | None:
    """Where a pod's cache is copied when the job's output is on gs:// (None otherwise)."""
    if output_uri is None or not output_uri.startswith("gs://"):
        return None
    return output_uri.rstrip("/") + "/" + POD_DIR


def pull(remote: str, local: str | os.PathLike[str]) -> int:
    """Copies the entries of `remote` that `local` lacks; returns how many. Unreachable or
    unreadable: a warning, and the programs compile."""
    from posttrain.trainer import storage

    try:
        have = {p.name for p in Path(local).iterdir()}
        fetched = 0
        for uri in storage.list_uri(remote):
            name = uri.rsplit("/", 1)[-1]
            if name not in have:
                storage.write_bytes(Path(local) / name, storage.read_bytes(uri))
                fetched += 1
        return fetched
    except Exception as e:  # noqa: BLE001 - a cache that cannot be read costs a compile
        log.warning("compilation cache %s not read (%s); compiling", remote, e)
        return 0


def push(local: str | os.PathLike[str], remote: str) -> int:
    """Copies the entries of `local` that `remote` lacks; returns how many. A failure is a
    warning: the next pod compiles."""
    from posttrain.trainer import storage

    try:
        there = {uri.rsplit("/", 1)[-1] for uri in storage.list_uri(remote)}
        added = [p for p in sorted(Path(local).iterdir())
                 if p.is_file() and p.name not in there and not p.name.startswith(".")]  # fmt: skip
        for path in added:
            storage.write_bytes(f"{remote}/{path.name}", path.read_bytes())
        return len(added)
    except Exception as e:  # noqa: BLE001 - the run's own outputs are already written
        log.warning("compilation cache not copied to %s (%s)", remote, e)
        return 0


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
    if (remote := kept_copy(output_uri)) is not None:
        log.info("compilation cache: %d programs from %s", pull(remote, path), remote)
    return path
