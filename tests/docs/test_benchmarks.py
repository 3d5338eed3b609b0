"""Every benchmark script imports as a module without running (its work sits under ``if __name__ ==
"__main__"``), so a moved or renamed import breaks a test, not a script nobody ran."""

from __future__ import annotations

import ast
import importlib.util
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"
SCRIPTS = sorted(BENCH.glob("*.py"))


def test_there_are_benchmarks():
    assert len(SCRIPTS) >= 10


@pytest.mark.parametrize("path", SCRIPTS, ids=lambda p: p.name)
def test_a_benchmark_imports_without_running(path, monkeypatch):
    tree = ast.parse(path.read_text())
    top_calls = [n.lineno for n in tree.body if isinstance(n, ast.Expr) and isinstance(n.value, ast.Call)
                 and not ast.unparse(n.value.func).startswith("sys.path.")]      # path set-up is not work
    assert not top_calls, f"{path.name}: calls at module level (lines {top_calls}): move them under __main__"
    monkeypatch.syspath_prepend(str(BENCH))
    monkeypatch.setattr(sys, "argv", [str(path)])
    spec = importlib.util.spec_from_file_location(f"bench_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.__doc__, f"{path.name} says what it measures"
