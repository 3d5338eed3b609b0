"""The numbers of README.md and docs/ are generated from benchmarks/results/ (benchmarks/readme.py): they cannot
drift."""

from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _readme_module():
    spec = importlib.util.spec_from_file_location("readme_gen", ROOT / "benchmarks" / "readme.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_generated_blocks_equal_what_the_results_give():
    mod = _readme_module()
    names = [m.group("name") for p in mod.pages() for m in mod.BLOCK.finditer(p.read_text())]
    assert sorted(names) == sorted(mod.BLOCKS), "every generated block appears once in README.md and docs/"
    for path, (text, rendered) in mod.render_pages().items():
        assert rendered == text, f"{path.relative_to(ROOT)} is stale: run `python benchmarks/readme.py`"


def test_a_changed_result_changes_its_page(monkeypatch):
    mod = _readme_module()
    speed = mod.load("planner_speed")
    assert speed, "benchmarks/results/planner_speed.json is committed"
    monkeypatch.setattr(mod, "load", lambda name: speed | {"help_s": 9.87} if name == "planner_speed"
                        else mod.json.loads((mod.RESULTS / f"{name}.json").read_text())
                        if (mod.RESULTS / f"{name}.json").exists() else {})
    (text, rendered), = [v for p, v in mod.render_pages().items() if p.name == "speed.md"]
    assert "| `meshplan --help` | 9.87 s |" in rendered and rendered != text
