"""The frameworks' table: a framework with settings it can run but that were not timed at this size says so; one
whose every setting is refused says why it cannot express the workload."""

from __future__ import annotations

from rich.console import Console

from meshplan.show.search_table import print_frameworks


def _printed(frameworks) -> str:
    console = Console(width=120, record=True)
    print_frameworks(frameworks, console)
    return console.export_text()


def test_untimed_settings_are_not_called_inexpressible():
    row = {"framework": "yunchang", "settings": None, "reason": "no setting evaluated at this size",
           "expresses_best": None, "not_expressible": [],
           "not_evaluated": [{"cli": "ulysses_degree=8", "reason": "not simulated above 256 ranks"}] * 2}
    text = _printed([row])
    assert "not evaluated at this size: 2 settings it can run" in text and "not expressible" not in text
    assert "2 framework settings were not evaluated" in text


def test_refused_settings_say_why():
    row = {"framework": "torchtitan", "settings": None, "reason": "allgather: no all-gather-KV algorithm",
           "expresses_best": None, "not_expressible": [{"cli": "x", "reason": "allgather"}], "not_evaluated": []}
    assert "not expressible: allgather: no all-gather-KV algorithm" in _printed([row])
