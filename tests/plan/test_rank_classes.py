"""Rank classes (ranks equal up to relabelling) are exact, and the verifier's hazard check on one rank of each class
reports what the check on every rank reports."""

from __future__ import annotations

import re

import numpy as np
import pytest
from test_verify import build

from meshplan.core.csr import csr_ptr
from meshplan.plan import pass_checks as pc
from meshplan.plan import verify as v
from meshplan.plan.dataflow import build_items, evaluate
from meshplan.plan.hazards import check_hazards
from meshplan.plan.rank_classes import class_partner, rank_classes
from meshplan.plan.schedule import COMPUTE, RECV, SEND


def every_rank(monkeypatch) -> None:
    """The verifier with every rank a class of its own: the hazard check on every rank, as before classes."""
    monkeypatch.setattr(pc, "rank_classes", lambda s: np.arange(s.n_ranks))


def drop_compute_deps(s, rank: int):
    """``s`` with the deps of ``rank``'s compute ops removed: hazards on that rank only."""
    o = s.ops
    owner = np.repeat(np.arange(len(o)), np.diff(o.dep_ptr))
    keep = ~((o.kind[owner] == COMPUTE) & (o.rank[owner] == rank))
    o.deps, o.dep_ptr = o.deps[keep], csr_ptr(np.bincount(owner[keep], minlength=len(o)))
    return s


@pytest.mark.parametrize("name,kw,classes", [("ring", {}, 1), ("ring", {"mask": "full"}, 1), ("pass-q", {}, 1),
                                             ("mesh", {}, 1), ("usp", {}, 4),
                                             ("ring", {"layout": "contiguous"}, 8)])
def test_classes_of_built_schedules(name, kw, classes):
    """Ring, Mesh and pass-Q repeat on every rank under a zigzag layout (each rank holds a mirrored pair of chunks),
    USP's four Ulysses members differ (their head ranges and all-to-all partners), a contiguous causal Ring's ranks
    each skip a different number of blocks."""
    s = build(name, n=8, **kw)
    rep = rank_classes(s)
    assert len(np.unique(rep)) == classes and (rep <= np.arange(8)).all() and (rep[rep] == rep).all()


def test_a_rank_that_differs_is_its_own_class_and_its_hazard_is_reported_whole(monkeypatch):
    """Rank 5's compute ops lose their deps: rank 5 leaves the class, and verify reports exactly what the check on
    every rank reports."""
    s = drop_compute_deps(build("ring", n=8), 5)
    rep = rank_classes(s)
    assert rep[5] == 5 and (np.delete(rep, 5) == 0).all()
    reduced = v.verify(s)
    every_rank(monkeypatch)
    full = v.verify(s)
    assert not reduced.ok and reduced.violations == full.violations and reduced.counts == full.counts
    named = {int(k) for k in re.findall(r"op (\d+)", " ".join(full.violations))}
    assert named and {int(s.ops.rank[k]) for k in named} == {5}


def test_a_free_on_another_rank_breaks_the_class():
    """A tensor freed after another rank's op: its rank references outside itself, a class of its own."""
    s = build("ring", n=4)
    t = s.tensors
    k = np.flatnonzero((t.rank == 2) & (np.diff(t.free_ptr) > 0))[0]
    t.free_after[t.free_ptr[k]] = s.rank_ptr[3]                    # rank 3's first op
    assert rank_classes(s)[2] == 2


def test_alloc_op_none_and_the_op_before_a_rank_differ():
    """A tensor with no alloc op and one allocated by the op just before its rank's first are different forms."""
    s = build("ring", n=4)
    t = s.tensors
    k = np.flatnonzero((t.rank == 2) & (t.alloc_op < 0))[0]
    t.alloc_op[k] = s.rank_ptr[2] - 1                               # rank 1's last op
    assert rank_classes(s)[2] == 2


@pytest.mark.parametrize("name", ["ring", "mesh", "usp", "ulysses"])
def test_reduced_hazards_agree_with_every_rank(name):
    """For each pass, the check on the classes' ranks (and the last) finds a violation iff the check on every rank
    does — on the schedule as built and with one rank's compute deps dropped."""
    for broken in (None, 3):
        s = build(name, n=8)
        if broken is not None:
            drop_compute_deps(s, broken)
        partner = s.match_transfers()[0]
        reps = np.union1d(rank_classes(s), [s.n_ranks - 1])
        assert len(reps) < s.n_ranks or name == "ulysses"          # a reduction, but where every rank differs
        found = []
        for phase in s.passes:
            full = check_hazards(s, build_items(s, phase, partner))
            reduced = check_hazards(s, build_items(s, phase, partner, ranks=reps))
            assert bool(full) == bool(reduced)
            found.append(bool(full))
        assert any(found) == (broken is not None)


@pytest.mark.parametrize("name,kw", [("ring", {}), ("mesh", {}), ("usp", {}), ("pass-q", {}),
                                     ("ring", {"mask": "full"})])
def test_evaluation_on_one_rank_per_class_is_every_ranks(name, kw):
    """Each op's start and end from the classes' evaluation are the full evaluation's, bit for bit, in both passes
    (unit times, and times that differ by place but not by rank); times that differ by rank are refused (None)."""
    s = build(name, n=8, **kw)
    partner = s.match_transfers()[0]
    classes = rank_classes(s)
    n = len(s.ops)
    place = np.arange(n) - s.rank_ptr[s.ops.rank]
    for dur in (np.ones(n), 1.0 + (place % 7) / 8):
        for phase in s.passes:
            got = pc._class_times(s, phase, dur, dur, pc.class_view(s, partner, dur, dur))
            items = build_items(s, phase, partner)
            want = pc._op_times(n, items, evaluate(items, dur, dur), np.arange(n))
            assert got is not None
            np.testing.assert_array_equal(got[0], want[0])
            np.testing.assert_array_equal(got[1], want[1])
            assert (s.ops.rank[got[2]] == classes[s.ops.rank]).all()
    by_rank = 1.0 + s.ops.rank / 8
    assert class_partner(s, classes, partner, by_rank, by_rank) is None


def test_a_deadlock_is_evaluated_on_every_rank():
    """Both ranks of a 2-rank Ring send before they receive, unbatched: one class, but its evaluation does not end,
    so every rank is evaluated and the stuck ops named (rank 0's and rank 1's)."""
    s = build("ring", n=2, passes="fwd")
    o = s.ops
    for r in (0, 1):
        mine = np.flatnonzero((o.rank == r) & ((o.kind == SEND) | (o.kind == RECV)))
        send, recv = mine[o.kind[mine] == SEND][0], mine[o.kind[mine] == RECV][0]
        o.step[send], o.step[recv] = 1, 0
    assert (rank_classes(s) == 0).all()
    one = np.ones(len(o))
    assert pc._class_times(s, 0, one, one, pc.class_view(s, s.match_transfers()[0], one, one)) is None
    stuck = [x for x in v.verify(s).violations if "never completes" in x]
    assert {int(x.split(" on rank ")[1].split()[0]) for x in stuck} == {0, 1}
