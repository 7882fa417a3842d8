"""A program compiled for compile-only TPU devices keeps its figures on disk
(``compile_figures``): the same program compiled again reads them (memory and flops equal
to the compiler's, no compile), its out-of-memory refusal too; another program, a
damaged entry, or no cache directory compiles. Needs libtpu (the tpu-compile extra)."""

from __future__ import annotations

import importlib.util
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest

from posttrain import catalog
from posttrain.trainer import compile_figures, step_memory, tpu_compile

pytestmark = [
    pytest.mark.trainer,
    pytest.mark.skipif(
        importlib.util.find_spec("libtpu") is None, reason="libtpu (the TPU compiler) not installed"
    ),
]


@pytest.fixture(scope="module")
def mesh():
    return step_memory.mesh_of(1, 1, tpu_compile.tpu_devices(catalog.resolve("v5e-1")))


def lowered(mesh, n: int):
    """x @ x.T for an [n, 1024] float32 x on the mesh's one chip: its temporaries grow
    as n squared (n = 70,000 needs more than a v5e chip's HBM)."""
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec())
    x = jax.ShapeDtypeStruct((n, 1024), jnp.float32, sharding=sharding)
    with jax.set_mesh(mesh):
        return jax.jit(lambda x: jnp.sort(x @ x.T, axis=0)[0]).lower(x)


def test_the_same_program_reads_its_figures(mesh, tmp_path, monkeypatch):
    monkeypatch.setattr(compile_figures, "_cache_root", lambda: tmp_path)
    first = compile_figures.compile(lowered(mesh, 4096), mesh)
    assert not isinstance(first, compile_figures.Figures)
    assert len(list(tmp_path.glob("*.json"))) == 1

    again = compile_figures.compile(lowered(mesh, 4096), mesh)
    assert isinstance(again, compile_figures.Figures)
    assert step_memory.memory_of(again) == step_memory.memory_of(first)
    assert again.memory["temp"] >= 4096 * 4096 * 4  # the product's own bytes, at least
    assert again.cost_analysis()["flops"] == first.cost_analysis()["flops"] > 0

    other = compile_figures.compile(lowered(mesh, 2048), mesh)  # another program: compiled
    assert not isinstance(other, compile_figures.Figures)
    assert step_memory.memory_of(other)["temp"] < again.memory["temp"]
    assert len(list(tmp_path.glob("*.json"))) == 2


def test_a_refusal_is_kept_and_a_damaged_entry_compiles_again(mesh, tmp_path, monkeypatch):
    monkeypatch.setattr(compile_figures, "_cache_root", lambda: tmp_path)
    with pytest.raises(Exception) as first:
        compile_figures.compile(lowered(mesh, 70_000), mesh)
    assert tpu_compile.out_of_memory(str(first.value)) is not None, first.value
    with pytest.raises(compile_figures.StoredRefusal) as again:
        compile_figures.compile(lowered(mesh, 70_000), mesh)
    assert str(again.value) == str(first.value)

    (entry,) = tmp_path.glob("*.json")
    entry.write_text('{"memory": {"argument": 1')  # cut short
    with pytest.raises(Exception) as compiled:
        compile_figures.compile(lowered(mesh, 70_000), mesh)
    assert not isinstance(compiled.value, compile_figures.StoredRefusal)
    assert tpu_compile.out_of_memory(str(compiled.value)) is not None


def test_without_a_cache_every_compile_compiles(mesh, monkeypatch):
    monkeypatch.setattr(compile_figures, "_cache_root", lambda: None)
    for _ in range(2):
        assert not isinstance(compile_figures.compile(lowered(mesh, 512), mesh),
                              compile_figures.Figures)  # fmt: skip


KEPT_OUT = """
import pathlib, sys
import jax, jax.numpy as jnp
cache = pathlib.Path(sys.argv[1])
jax.config.update("jax_compilation_cache_dir", str(cache / "jax"))
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
from posttrain import catalog
from posttrain.trainer import compile_figures, step_memory, tpu_compile
mesh = step_memory.mesh_of(1, 1, tpu_compile.tpu_devices(catalog.resolve("v5e-1")))
x = jax.ShapeDtypeStruct((512, 1024), jnp.float32,
                         sharding=jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec()))

def compile_only_product(x):
    return x @ x.T

def on_this_cpu(y):
    return y + 1

with jax.set_mesh(mesh):
    compile_figures.compile(jax.jit(compile_only_product).lower(x), mesh)
jax.jit(on_this_cpu)(jnp.ones(3)).block_until_ready()  # the cache is on: this one goes in
"""


def test_a_compile_only_program_stays_out_of_jaxs_cache(tmp_path):
    """JAX's persistent cache would keep the compile-only executable, which nothing can
    load back, and warn each time it failed to: only its figures are kept."""
    run = subprocess.run([sys.executable, "-c", KEPT_OUT, str(tmp_path)],
                         capture_output=True, text=True, timeout=300)  # fmt: skip
    assert run.returncode == 0, run.stderr
    entries = [p.name for p in (tmp_path / "jax").iterdir()]
    assert not [e for e in entries if "compile_only_product" in e], entries
    assert [e for e in entries if "on_this_cpu" in e], entries
    assert len(list((tmp_path / "jax" / "tpu-figures").glob("*.json"))) == 1
