"""Imports point one way (docs/architecture.md, "Packages and layers"): a package imports only packages of a lower
rank, the
executor only the contract layers, and no two modules import each other, directly or around a loop.

Every ``import`` counts, function-level ones included. Pure ``ast`` over the source: nothing is imported.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import networkx as nx
import pytest

PKG = Path(__file__).resolve().parents[2] / "meshplan"
RANK = {"core": 0, "model": 1, "plan": 2, "cost": 3, "algorithms": 4, "search": 5, "truth": 6, "show": 7,
        "topo_import": 7, "executor": 8, "cli": 9}
EDGE = {"executor": {"core", "model", "plan"}}          # torch lives here; it is handed a schedule, it never plans


def _module_name(path: Path, pkg: Path) -> str:
    parts = list(path.relative_to(pkg.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _modules(pkg: Path) -> dict[str, Path]:
    return {_module_name(p, pkg): p for p in pkg.rglob("*.py")}


def _imports(path: Path, modules: dict[str, Path]):
    """(imported module, line) for every import of the package in ``path``: ``from a.b import c`` names the
    module ``a.b.c`` when that is a module, else ``a.b``."""
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for alias in node.names:
                full = f"{node.module}.{alias.name}"
                yield (full if full in modules else node.module), node.lineno
        elif isinstance(node, ast.Import):
            yield from ((alias.name, node.lineno) for alias in node.names)


def _layer(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 2 or (len(parts) == 2 and parts[1] in RANK) else None


def wrong_way(pkg: Path = PKG) -> list[str]:
    """Every import that points up the layers (or out of the executor's contract layers)."""
    modules, wrong = _modules(pkg), []
    for name, path in modules.items():
        here = _layer(name)
        if here is None:
            continue                                     # meshplan/__init__.py, __main__.py: the facade
        for module, line in _imports(path, modules):
            there = _layer(module) if module.startswith(f"{pkg.name}.") else None
            if there is None or there == here:
                continue
            ok = there in EDGE[here] if here in EDGE else there in RANK and RANK[there] < RANK[here]
            if not ok:
                wrong.append(f"{name}:{line} imports {module} ({here} -> {there})")
    return sorted(wrong)


def cycles(pkg: Path = PKG) -> list[list[str]]:
    """Module-level import cycles (every strongly connected component of more than one module)."""
    modules = _modules(pkg)
    graph = nx.DiGraph()
    for name, path in modules.items():
        graph.add_node(name)
        for module, _ in _imports(path, modules):
            while module and module not in modules:
                module = module.rpartition(".")[0]
            if module and module != name and module != pkg.name:
                graph.add_edge(name, module)
    return sorted(sorted(c) for c in nx.strongly_connected_components(graph) if len(c) > 1)


def test_imports_point_one_way():
    assert not wrong_way(), "\n".join(wrong_way())


def test_no_import_cycles():
    assert not cycles(), "\n".join(" <-> ".join(c) for c in cycles())


def test_the_package_top_holds_only_packages():
    loose = sorted(p.name for p in PKG.glob("*.py") if p.name not in {"__init__.py", "__main__.py"})
    assert not loose, f"modules at meshplan/'s top: {loose}"
    assert set(RANK) <= {p.name for p in PKG.iterdir() if (p / "__init__.py").exists()}


def test_the_rule_catches_a_wrong_tree(tmp_path):
    """The checks can fail: a toy package where core imports cost, the executor imports search, and two cost
    modules import each other (one at function level)."""
    pkg = tmp_path / "meshplan"
    for folder, files in {"core": {"units.py": "from meshplan.cost.a import x\n"},
                          "cost": {"a.py": "from meshplan.cost import b\nx = 1\n",
                                   "b.py": "def f():\n    from meshplan.cost.a import x\n"},
                          "search": {"s.py": ""},
                          "executor": {"run.py": "import meshplan.search.s\n"}}.items():
        (pkg / folder).mkdir(parents=True)
        (pkg / folder / "__init__.py").write_text("")
        for name, text in files.items():
            (pkg / folder / name).write_text(text)
    (pkg / "__init__.py").write_text("")
    assert wrong_way(pkg) == ["meshplan.core.units:1 imports meshplan.cost.a (core -> cost)",
                              "meshplan.executor.run:1 imports meshplan.search.s (executor -> search)"]
    assert cycles(pkg) == [["meshplan.cost.a", "meshplan.cost.b"]]


@pytest.mark.parametrize("package", sorted(RANK))
def test_every_package_says_what_it_holds(package):
    assert ast.get_docstring(ast.parse((PKG / package / "__init__.py").read_text())), f"meshplan/{package}"


def test_the_facade_names_real_library_calls_and_loads_nothing_until_asked():
    import importlib

    import meshplan

    for name, module in meshplan._FACADE.items():
        assert getattr(meshplan, name) is getattr(importlib.import_module(module), name)
    probe = "import sys, meshplan; print(sorted(m for m in sys.modules if m.startswith(('numpy', 'meshplan.'))))"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
