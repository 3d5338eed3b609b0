"""Peak memory along an execution: the sorted sweep against a brute-force level at every instant, and the
representatives' sort (a simulation reduced by symmetry) against every rank sorted on its own."""

from __future__ import annotations

import copy

import numpy as np
import pytest

from meshplan import algorithms
from meshplan.cost.memory import op_workspace_bytes
from meshplan.cost.simulate import simulate
from meshplan.model.topology import Topology
from meshplan.model.workload import resolve
from meshplan.plan.peaks import peak_memories
from meshplan.search.candidate import make_candidate


def _brute_force(sched, phase, start, end, transient):
    """Per rank, the level at each event's instant: tensors allocated at or before it and freed after it, ops
    started at or before it and ended after it (frees before allocations at equal times)."""
    t, o = sched.tensors, sched.ops
    pass_end = np.nanmax(end[o.phase == phase])
    peaks = np.zeros(sched.n_ranks)
    for r in range(sched.n_ranks):
        mine = [k for k in range(len(t.rank)) if t.rank[k] == r and t.phase[k] == phase]
        lives = []
        for k in mine:
            a = start[t.alloc_op[k]] if t.alloc_op[k] >= 0 else 0.0
            frees = t.free_after[t.free_ptr[k]:t.free_ptr[k + 1]]
            lives.append((a, end[frees].max() if len(frees) else pass_end + 1.0, float(t.size_bytes[k])))
        lives += [(start[i], end[i], transient[i]) for i in np.flatnonzero((o.rank == r) & (o.phase == phase))
                  if transient[i] > 0 and np.isfinite(start[i]) and np.isfinite(end[i])]
        for instant in {x for a, f, _ in lives for x in (a, f)}:
            peaks[r] = max(peaks[r], sum(s for a, f, s in lives if a <= instant < f))
    return peaks


def test_the_sweep_equals_the_level_at_every_instant():
    """A 4-rank Ring's simulated times on a coarse grid (many ties between allocations, frees and workspaces), a
    random workspace on every op."""
    topo = Topology.load("h100x8", gpus=4)
    c = make_candidate("ring", resolve(seq_len="4K", model="llama3-8b", passes="fwd+bwd"), topo, 4, {})
    sched = algorithms.get("ring").schedule(c.plan, topo)
    sim = simulate(sched, topo)
    quantum = np.nanmax(sim.end) / 12
    start, end = np.floor(sim.start / quantum), np.floor(sim.end / quantum)
    n = len(sched.ops)
    transient = np.random.default_rng(3).choice([0.0, 1e6, 3e6], n)
    assert len(np.unique(start)) < n / 4
    for phase in sched.passes:
        buffers, total = peak_memories(sched, phase, start, end, transient)
        np.testing.assert_allclose(total, _brute_force(sched, phase, start, end, transient), rtol=1e-12)
        np.testing.assert_allclose(buffers, _brute_force(sched, phase, start, end, np.zeros(n)), rtol=1e-12)


@pytest.fixture(scope="module")
def simulated():
    """A 64-rank zigzag Ring on 8 nodes, simulated with its node symmetry (8 representatives), and each op's
    workspace (zigzag blocks c x 2c and 2c x c: the same time, different workspaces on ranks of one orbit)."""
    topo = Topology.load("h100x32", gpus=64)
    c = make_candidate("ring", resolve(seq_len="64K", model="llama3-8b", layout="zigzag"), topo, 64, {})
    sched = algorithms.get("ring").schedule(c.plan, topo)
    sim = simulate(sched, topo)
    assert sim.reps == 8 and sim.rep_op is not None
    return sched, sim, op_workspace_bytes(sched, topo.memory_model)


def _both(sched, sim, ws, phase):
    off = sim.pass_offset[phase]
    start, end = sim.start - off, sim.end - off
    return (peak_memories(sched, phase, start, end, ws, sim.rep_op),
            peak_memories(sched, phase, start, end, ws))


def test_the_representatives_sort_equals_every_rank_sorted(simulated):
    sched, sim, ws = simulated
    for phase in sched.passes:
        (b1, t1), (b2, t2) = _both(sched, sim, ws, phase)
        np.testing.assert_array_equal(b1, b2)
        np.testing.assert_array_equal(t1, t2)
    assert (ws != ws[sim.rep_op]).any()             # the workspaces do differ within orbits


def test_a_rank_unlike_its_representative_is_sorted_on_its_own(simulated):
    """One rank's tensor grows; another's first op with a workspace ends with the pass instead of with its
    representative's: both are sorted on their own (their peaks rise) and the result still equals every rank
    sorted."""
    sched, sim, ws = simulated
    sched = copy.deepcopy(sched)
    sim = copy.deepcopy(sim)
    t, o = sched.tensors, sched.ops
    bwd = 1
    grown = int(np.flatnonzero((t.rank == 9) & (t.phase == bwd))[0])
    t.size_bytes[grown] *= 50
    late = int(np.flatnonzero((o.rank == 17) & (o.phase == bwd) & (ws > 0))[0])
    sim.end[late] = np.nanmax(sim.end)
    (b1, t1), (b2, t2) = _both(sched, sim, ws, bwd)
    np.testing.assert_array_equal(b1, b2)
    np.testing.assert_array_equal(t1, t2)
    (_, before), _ = _both(*simulated, bwd)
    assert t2[9] > before[9] and t2[17] > before[17]


def test_members_whose_tensors_come_in_another_order_share_the_representatives_sort():
    """USP with Ulysses groups across nodes (degree 16 rings on consecutive ranks): a rank creates its own head
    range's tensors first, so its tensor list is its representative's in another order — compared as a multiset of
    (allocation, free, bytes), every member shares the representative's sort, and the peaks equal every rank's."""
    import meshplan.plan.peaks as peaks

    topo = Topology.load("h100x32", gpus=64)
    c = make_candidate("usp", resolve(seq_len="64K", model="llama3-8b", layout="zigzag"), topo, 64,
                       {"ulysses_degree": 16, "rank_order": "ring-first"})
    sched = algorithms.get("usp").schedule(c.plan, topo)
    sim = simulate(sched, topo)
    ws = op_workspace_bytes(sched, topo.memory_model)
    assert sim.reps == 8 and sim.rep_op is not None
    sorted_alone = []
    real = peaks._sorted_peaks
    peaks._sorted_peaks = lambda rank, *a: sorted_alone.append(len(np.unique(rank))) or real(rank, *a)
    try:
        for phase in sched.passes:
            (b1, t1), (b2, t2) = _both(sched, sim, ws, phase)
            np.testing.assert_array_equal(b1, b2)
            np.testing.assert_array_equal(t1, t2)
    finally:
        peaks._sorted_peaks = real
    assert sorted_alone == [64, 64]              # only the every-rank reference sorted ranks on their own


def test_peaks_over_several_workspaces_equal_each_one_alone(simulated):
    """``peak_memories_over`` (one sort for a quotient schedule's members' workspaces) gives what
    ``peak_memories`` gives for each workspace alone, and the tensors' peak, on every pass — workspaces held by
    different ops (some zero where another is not) included."""
    from meshplan.plan.peaks import peak_memories_over

    sched, sim, base = simulated
    rng = np.random.default_rng(0)
    spaces = [base, np.where(rng.random(len(base)) < 0.5, base * 2, 0.0), np.zeros(len(base))]
    for phase in sched.passes:
        off = sim.pass_offset[phase]
        start, end = sim.start - off, sim.end - off
        buffers, totals = peak_memories_over(sched, phase, start, end, spaces)
        for w, total in zip(spaces, totals):
            alone_buffers, alone_total = peak_memories(sched, phase, start, end, w)
            np.testing.assert_array_equal(buffers, alone_buffers)
            np.testing.assert_array_equal(total, alone_total)
        assert (totals[1] != totals[0]).any()          # the workspaces differ: a test that could fail
