"""The imports inside posttrain point one way: no module imports itself back.

Reads every module of the trainer (trainer/posttrain/trainer) and of the operator side
(operator/posttrain) with ``ast`` -- nothing is imported, so no JAX is needed -- and
follows every import of a posttrain module, at module level or inside a function (a lazy
import is still a dependency). Importing ``a.b.c`` also runs ``a/__init__`` and
``a/b/__init__``, so those count too, except the packages the importer itself is in.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = {
    "posttrain": ROOT / "operator" / "posttrain",
    "posttrain.trainer": ROOT / "trainer" / "posttrain" / "trainer",
}


def module_files() -> dict[str, Path]:
    """Dotted module name -> file, for every module of the posttrain packages."""
    out: dict[str, Path] = {}
    for prefix, root in PACKAGES.items():
        for path in sorted(root.rglob("*.py")):
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join([prefix, *parts])] = path
    return out


def _is_package(path: Path) -> bool:
    return path.name == "__init__.py"


def imports_of(name: str, path: Path, known: set[str]) -> set[str]:
    """The posttrain modules that importing ``name`` (at ``path``) runs."""
    tree = ast.parse(path.read_text(), filename=str(path))
    package = name if _is_package(path) else name.rpartition(".")[0]
    targets: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            targets.add(module)
            for alias in node.names:  # `from pkg import submodule`
                if f"{module}.{alias.name}" in known:
                    targets.add(f"{module}.{alias.name}")
    deps: set[str] = set()
    for target in targets:
        parts = target.split(".")
        for i in range(1, len(parts) + 1):
            dep = ".".join(parts[:i])
            if dep in known and dep != name and not name.startswith(dep + "."):
                deps.add(dep)
    return deps


def import_graph() -> dict[str, set[str]]:
    files = module_files()
    known = set(files)
    return {name: imports_of(name, path, known) for name, path in files.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of ``graph`` as [a, b, ..., a], or None."""
    state: dict[str, int] = {}  # 1: on the stack, 2: done
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for dep in sorted(graph.get(node, ())):
            if state.get(dep) == 1:
                return [*stack[stack.index(dep) :], dep]
            if dep not in state and (found := visit(dep)):
                return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := visit(node)):
            return found
    return None


def test_no_import_cycle() -> None:
    graph = import_graph()
    assert "posttrain.trainer.lora" in graph and "posttrain.api" in graph
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_the_api_never_imports_the_trainer() -> None:
    graph = import_graph()
    for name, deps in graph.items():
        if name.startswith("posttrain.api"):
            assert not {d for d in deps if d.startswith("posttrain.trainer")}, name


def test_the_api_imports_neither_the_renderer_nor_the_checks_above_it() -> None:
    """posttrain.api is the schema: validation that needs the renderer or the memory
    estimate lives one floor up, in posttrain.checks."""
    above = ("posttrain.render", "posttrain.capacity", "posttrain.checks", "posttrain.controller",
             "posttrain.cli")  # fmt: skip
    graph = import_graph()
    for name, deps in graph.items():
        if name.startswith("posttrain.api"):
            bad = {d for d in deps if d.startswith(above)}
            assert not bad, f"{name} imports {sorted(bad)}"


@pytest.mark.parametrize(
    ("graph", "cycle"),
    [
        ({"a": {"b"}, "b": set()}, None),
        ({"a": {"b"}, "b": {"a"}}, ["a", "b", "a"]),
        ({"a": {"b"}, "b": {"c"}, "c": {"b"}}, ["b", "c", "b"]),
        ({"a": {"b", "c"}, "b": {"c"}, "c": set()}, None),
    ],
)
def test_find_cycle(graph: dict[str, set[str]], cycle: list[str] | None) -> None:
    assert find_cycle(graph) == cycle


def test_a_submodule_import_runs_its_package(tmp_path: Path) -> None:
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text("from x.pkg.leaf import f\n")
    (tmp_path / "pkg" / "leaf.py").write_text("from x import other\n")
    (tmp_path / "other.py").write_text("def g():\n    from x.pkg import leaf\n")
    known = {"x", "x.pkg", "x.pkg.leaf", "x.other"}
    assert imports_of("x.pkg", tmp_path / "pkg" / "__init__.py", known) == {"x.pkg.leaf"}
    assert imports_of("x.pkg.leaf", tmp_path / "pkg" / "leaf.py", known) == {"x.other"}
    assert imports_of("x.other", tmp_path / "other.py", known) == {"x.pkg", "x.pkg.leaf"}
