"""The branch and bound's leader verified and written while the search goes on (``EarlyWrite``): the same file as the
usual write, a staging overtaken by a faster leader stopped, and nothing left behind when it is not the pick; a
simulation in a forked process returns its timeline only with its schedule."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from meshplan.core.parallel import can_fork
from meshplan.model.topology import Topology
from meshplan.model.workload import resolve
from meshplan.plan.json.io import read_schedule
from meshplan.search.candidate import label, make_candidate, simulate_candidate
from meshplan.search.pipeline import SearchRequest, run_pipeline
from meshplan.search.write import EarlyWrite

pytestmark = pytest.mark.skipif(not can_fork(), reason="the early write runs in a forked process")


def _spy(monkeypatch) -> list[tuple[str, str]]:
    """(label, model level when staged) of the leaders ``EarlyWrite.lead`` staged, in order."""
    staged, lead = [], EarlyWrite.lead

    def spy(self, leader):
        lead(self, leader)
        if self.job is not None and self.leader is leader:
            staged.append((label(leader), leader.model_level))
    monkeypatch.setattr(EarlyWrite, "lead", spy)
    return staged


def test_the_staged_pick_is_the_file_the_usual_write_gives(tmp_path, monkeypatch):
    topo, w = Topology.load("h100x16", gpus=16), resolve(seq_len="64K")
    staged = _spy(monkeypatch)
    early = run_pipeline(SearchRequest(w, topo, 16, write=1, out_dir=str(tmp_path / "early")))
    assert staged and staged[-1][0] == label(early.best)     # staged while the search went on ...
    assert staged[0][1] == "closed-form"                     # ... the likely pick from its build, before simulated
    monkeypatch.setattr(EarlyWrite, "lead", lambda self, leader: None)
    usual = run_pipeline(SearchRequest(w, topo, 16, write=1, out_dir=str(tmp_path / "usual")))
    a, b = Path(early.best.schedule_path), Path(usual.best.schedule_path)
    assert a.name == b.name and a.read_bytes() == b.read_bytes()
    assert [p.name for p in (tmp_path / "early").iterdir()] == [a.name]      # no staging file left


def test_a_staging_overtaken_by_a_faster_leader_is_stopped_and_leaves_nothing(tmp_path):
    topo, w = Topology.load("h100x16", gpus=16), resolve(seq_len="64K")
    first, second = (make_candidate("ring", w, topo, 16, {"dkv_hops": h}) for h in ("n", "n-1"))
    for c in (first, second):
        simulate_candidate(c, topo, None)
    early = EarlyWrite(topo, str(tmp_path))
    early.lead(first)
    job = early.job
    early.lead(first)                                        # the same leader: left to go on
    assert early.job is job
    early.lead(second)                                       # overtaken: the first's staging stopped
    assert early.job is not job and job._proc.exitcode is not None
    paths, rejected = early.collect(SimpleNamespace(candidates=[second, first]))
    assert rejected == [] and [p.name for p in tmp_path.iterdir()] == [Path(paths[0]).name]
    assert read_schedule(paths[0]).knobs["dkv_hops"] == "n-1"              # the second leader's schedule


def test_a_staged_schedule_that_is_not_the_pick_leaves_nothing(tmp_path):
    topo, w = Topology.load("h100x16", gpus=16), resolve(seq_len="64K")
    leader = make_candidate("ring", w, topo, 16, {})
    simulate_candidate(leader, topo, None)
    other = make_candidate("ring", w, topo, 16, {"dkv_hops": "n-1"})
    early = EarlyWrite(topo, str(tmp_path))
    early.lead(other)                                        # not simulated: nothing to stage
    assert early.job is None
    early.lead(leader)
    assert early.job is not None
    assert early.collect(SimpleNamespace(candidates=[other, leader])) is None
    assert list(tmp_path.iterdir()) == []
    early.lead(leader)
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
    """Ctrl-C (or an error) while the frameworks are timed: the staged pick is removed, not left half-named, and so
    are the directories made for it (an --out that did not exist is not left behind empty)."""
    import meshplan.search.pipeline as pipeline

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt
    staged = _spy(monkeypatch)
    monkeypatch.setattr(pipeline, "framework_bests", interrupted)
    topo, w = Topology.load("h100x16", gpus=16), resolve(seq_len="64K")
    with pytest.raises(KeyboardInterrupt):
        run_pipeline(SearchRequest(w, topo, 16, write=1, out_dir=str(tmp_path / "new" / "out")))
    assert staged
    assert list(tmp_path.iterdir()) == []


def test_the_staging_runs_in_the_background(tmp_path, monkeypatch):
    """The staging is started at the lowest CPU priority (:func:`meshplan.core.parallel.start_beside`'s
    ``background``): the search and the frameworks, which the run waits for first, are not slowed by it."""
    import meshplan.core.parallel as parallel

    started, start = [], parallel.start_beside
    monkeypatch.setattr(parallel, "start_beside", lambda side, **kw: started.append(kw) or start(side, **kw))
    topo, w = Topology.load("h100x16", gpus=16), resolve(seq_len="64K")
    leader = make_candidate("ring", w, topo, 16, {})
    simulate_candidate(leader, topo, None)
    early = EarlyWrite(topo, str(tmp_path))
    early.lead(leader)
    early.collect(SimpleNamespace(candidates=[leader]))
    assert started == [{"own_group": True, "background": True}]
