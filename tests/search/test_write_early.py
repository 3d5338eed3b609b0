"""The pick verified and written while Ring's reference settings are still being simulated (``EarlyWrite``): only
when no Ring setting can beat it, the same file as the usual write, and nothing left behind when it is not the pick;
a simulation in a forked process returns its timeline only with its schedule."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from meshplan.core.parallel import can_fork
from meshplan.model.topology import Topology
from meshplan.model.workload import resolve
from meshplan.plan.json.io import read_schedule
from meshplan.search.candidate import make_candidate, simulate_candidate
from meshplan.search.pipeline import SearchRequest, run_pipeline
from meshplan.search.write import EarlyWrite

pytestmark = pytest.mark.skipif(not can_fork(), reason="the early write runs in a forked process")


def _spy(monkeypatch) -> list[bool]:
    """Whether each call of ``EarlyWrite.start`` staged the pick."""
    staged, start = [], EarlyWrite.start

    def spy(self, leader, beside):
        start(self, leader, beside)
        staged.append(self.job is not None)
    monkeypatch.setattr(EarlyWrite, "start", spy)
    return staged


def test_the_pick_staged_beside_ring_is_the_file_the_usual_write_gives(tmp_path, monkeypatch):
    topo, w = Topology.load("h100x16", gpus=16), resolve(seq_len="64K")
    staged = _spy(monkeypatch)
    early = run_pipeline(SearchRequest(w, topo, 16, write=1, out_dir=str(tmp_path / "early")))
    assert staged == [True]                                  # USP's time is under every Ring bound here
    monkeypatch.setattr(EarlyWrite, "start", lambda self, leader, beside: None)
    usual = run_pipeline(SearchRequest(w, topo, 16, write=1, out_dir=str(tmp_path / "usual")))
    a, b = Path(early.best.schedule_path), Path(usual.best.schedule_path)
    assert a.name == b.name and a.read_bytes() == b.read_bytes()
    assert [p.name for p in (tmp_path / "early").iterdir()] == [a.name]      # no staging file left


def test_nothing_is_staged_while_a_ring_setting_could_still_win(tmp_path, monkeypatch):
    topo, w = Topology.load("h100x16", gpus=16), resolve(seq_len="64K")
    staged = _spy(monkeypatch)
    report = run_pipeline(SearchRequest(w, topo, 16, algos=("ring",), write=1, out_dir=str(tmp_path)))
    assert staged == [False]
    assert [p.name for p in tmp_path.iterdir()] == [Path(report.best.schedule_path).name]


def test_a_staged_schedule_that_is_not_the_pick_leaves_nothing(tmp_path):
    topo, w = Topology.load("h100x16", gpus=16), resolve(seq_len="64K")
    leader = make_candidate("ring", w, topo, 16, {})
    simulate_candidate(leader, topo, None)
    other = make_candidate("ring", w, topo, 16, {"dkv_hops": "n-1"})
    far = [SimpleNamespace(bound_s=2 * leader.predicted.makespan_s)]
    early = EarlyWrite(topo, topo.memory_bytes, str(tmp_path))
    early.start(leader, [SimpleNamespace(bound_s=leader.predicted.makespan_s)])     # a Ring bound at its time
    assert early.job is None
    early.start(leader, far)
    assert early.job is not None
    assert early.collect(SimpleNamespace(candidates=[other, leader])) is None
    assert list(tmp_path.iterdir()) == []
    early.start(leader, far)
    paths, rejected = early.collect(SimpleNamespace(candidates=[leader, other]))
    assert rejected == [] and list(paths) == [0]
    assert [p.name for p in tmp_path.iterdir()] == [Path(paths[0]).name]
    assert len(read_schedule(paths[0]).ops) == len(leader.schedule.ops)


def test_a_simulation_beside_comes_back_with_its_summary_and_its_timeline_only_with_its_schedule():
    from meshplan.search.beside import simulate_both

    topo, w = Topology.load("h100x16", gpus=16), resolve(seq_len="64K")
    here, there = (make_candidate("ring", w, topo, 16, {}) for _ in range(2))
    simulate_both(here, there, topo, None)                       # not kept: no schedule, no timeline
    assert there.schedule is None and len(there.sim.start) == 0 and there.sim.rep_op is None
    assert (there.sim.reps, there.sim.events, there.sim.pass_makespan) == \
        (here.sim.reps, here.sim.events, here.sim.pass_makespan)
    assert there.predicted.makespan_s == here.predicted.makespan_s
    kept = make_candidate("ring", w, topo, 16, {})
    simulate_both(make_candidate("ring", w, topo, 16, {}), kept, topo, None, keep_below=float("inf"))
    assert kept.schedule is not None and len(kept.sim.start) == len(kept.schedule.ops)


def test_an_interrupt_after_the_pick_was_staged_leaves_nothing(tmp_path, monkeypatch):
    """Ctrl-C (or an error) while the frameworks are timed: the staged pick is removed, not left half-named."""
    import meshplan.search.pipeline as pipeline

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt
    staged = _spy(monkeypatch)
    monkeypatch.setattr(pipeline, "framework_bests", interrupted)
    topo, w = Topology.load("h100x16", gpus=16), resolve(seq_len="64K")
    with pytest.raises(KeyboardInterrupt):
        run_pipeline(SearchRequest(w, topo, 16, write=1, out_dir=str(tmp_path)))
    assert staged == [True]
    assert list(tmp_path.iterdir()) == []
