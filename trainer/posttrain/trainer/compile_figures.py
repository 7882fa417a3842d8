"""The TPU compiler's figures for programs compiled on compile-only devices, kept on disk.

A program compiled for compile-only TPU devices (libtpu's compile-only client, on a
machine without a TPU: ``posttrain estimate --compile``, the checks, the benches) cannot
go into JAX's persistent compilation cache: there is no TPU client to load it back into,
so every such compile ran in full again (a full-depth model's takes minutes). What is
read from it is its figures, ``memory_analysis()`` and ``cost_analysis()``, or the
compiler's out-of-memory refusal, which the compiler gives alike for the same program:
``compile`` keeps them beside JAX's cache (``<jax_compilation_cache_dir>/tpu-figures``,
none when that cache is off), keyed by the lowered program's text, the devices it is for,
the compiler's flags and the jax and libtpu versions, and reads them instead of compiling
the same program again. Compiles for real devices go to JAX's own cache as before; a
compile-only one is kept out of it (JAX would write the executable, tens of MB for a full
model, that nothing can load, and warn each time it failed to read it back).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import tempfile
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import jax

DIRECTORY = "tpu-figures"
_MEMORY = ("argument", "output", "alias", "temp")
_FLAGS = ("LIBTPU_INIT_ARGS", "XLA_FLAGS")


class Figures:
    """A compile-only program's stored figures, read as a compiled program's."""

    def __init__(self, memory: dict[str, int], cost: dict[str, float]):
        self.memory, self.cost = memory, cost

    def memory_analysis(self) -> Any:
        figures = {f"{k}_size_in_bytes": v for k, v in self.memory.items() if k in _MEMORY}
        return SimpleNamespace(**figures, peak_memory_in_bytes=self.memory.get("peak", 0))

    def cost_analysis(self) -> dict[str, float]:
        return dict(self.cost)


class StoredRefusal(RuntimeError):
    """The compiler's out-of-memory refusal of this program, as it said it the first time."""


def compile(lowered: Any, mesh: jax.sharding.Mesh) -> Any:
    """`lowered.compile()` for `mesh`'s devices; for compile-only TPU devices, the stored
    ``Figures`` of the same program when there are some (or its stored refusal, raised),
    else compiled and its figures stored."""
    devices = list(mesh.devices.flat)
    if devices[0].platform != "tpu" or jax.default_backend() == "tpu":
        return lowered.compile()  # real devices: JAX's own cache
    directory = _cache_root()
    if directory is None:
        with _kept_out_of_jax_cache():
            return lowered.compile()
    path = directory / f"{_key(lowered, devices)}.json"
    try:
        stored = json.loads(path.read_text())
    except (OSError, ValueError):
        stored = None
    if isinstance(stored, dict) and "error" in stored:
        raise StoredRefusal(stored["error"])
    if isinstance(stored, dict) and set(_MEMORY) <= set(stored.get("memory", {})):
        keys = [*_MEMORY, *(["peak"] if "peak" in stored["memory"] else [])]
        return Figures({k: int(stored["memory"][k]) for k in keys}, stored.get("cost", {}))
    try:
        with _kept_out_of_jax_cache():
            compiled = lowered.compile()
    except Exception as e:
        if is_out_of_memory(str(e)):
            _store(path, {"error": str(e)})
        raise
    memory = compiled.memory_analysis()
    _store(path, {
        "memory": {**{k: int(getattr(memory, f"{k}_size_in_bytes")) for k in _MEMORY},
                   "peak": int(getattr(memory, "peak_memory_in_bytes", 0))},
        "cost": {k: float(v) for k, v in cost_of(compiled).items() if isinstance(v, int | float)},
    })  # fmt: skip
    return compiled


@contextlib.contextmanager
def _kept_out_of_jax_cache():
    """JAX's persistent cache writes no executable that compiled in less than its minimum
    compile time: set out of reach for the compile, then back."""
    name = "jax_persistent_cache_min_compile_time_secs"
    before = getattr(jax.config, name)
    jax.config.update(name, float("inf"))
    try:
        yield
    finally:
        jax.config.update(name, before)


def is_out_of_memory(message: str) -> bool:
    """Whether a compile error is the TPU compiler's out-of-memory refusal."""
    return "RESOURCE_EXHAUSTED" in message or "Ran out of memory" in message


def cost_of(compiled: Any) -> dict[str, Any]:
    """A compiled program's cost_analysis() as one dict (older JAX: one per program)."""
    cost = compiled.cost_analysis()
    if isinstance(cost, list):
        cost = cost[0] if cost else {}
    return cost or {}


def _cache_root() -> Path | None:
    """Beside JAX's persistent cache; none when that is off."""
    cache = jax.config.jax_compilation_cache_dir
    return Path(cache) / DIRECTORY if cache else None


def libtpu_version() -> str | None:
    try:
        return version("libtpu")
    except PackageNotFoundError:
        return None


def _key(lowered: Any, devices: list[Any]) -> str:
    digest = hashlib.sha256(lowered.as_text().encode())
    for part in (
        jax.__version__,
        libtpu_version() or "",
        *(f"{d!r} {d.device_kind}" for d in devices),
        *(f"{name}={os.environ.get(name, '')}" for name in _FLAGS),
    ):
        digest.update(b"\0" + part.encode())
    return digest.hexdigest()


def _store(path: Path, figures: dict[str, Any]) -> None:
    """Written whole or not at all (a file renamed into place): a reader never sees half."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=path.parent, delete=False) as f:
            json.dump(figures, f)
        os.replace(f.name, path)
    except OSError:  # a read-only cache: compile every time, as before
        pass
