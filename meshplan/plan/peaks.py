"""Peak memory of one pass along an execution: the live tensors of each rank, and with each op's workspace.

A tensor lives from its ``alloc_op``'s start (pass start if −1) until every op of ``free_after`` has ended (pass
end if none); a ``transient`` ([n_ops] bytes, :func:`meshplan.cost.memory.op_workspace_bytes`) is held by its op
from its start to its end. A rank's level changes at its events' instants; at equal times frees come before
allocations, so the level peaks at an instant's end, and the peak is the largest level at an instant's end.

Every rank's events sorted by (rank, time) is one float sort of them all (~0.1 s a pass for a 256-rank schedule,
which a search pays for every simulation). A simulation with a symmetry reduction gives every op the start and end
of its representative's op at the same position (``rep_op``); a rank whose tensors then have its representative's
sizes, allocation and free times — as a multiset: a rank may create them in another order (checked) — has its
representative's events at the same instants with only the workspaces' bytes its own, so the representative's
sorted order serves every such rank of its orbit: one sort per representative, and the orbit's levels as one
[ranks, events] cumulative sum. A rank that fails the check is sorted on its own, so the result is the same either
way.
"""

from __future__ import annotations

import numpy as np

from meshplan.plan.schedule import Schedule


def peak_memory(sched: Schedule, phase: int, op_start: np.ndarray, op_end: np.ndarray,
                transient: np.ndarray | None = None) -> np.ndarray:
    """[n_ranks] peak bytes of live tensors of one pass along an execution (op start/end times, s), with each op's
    ``transient`` bytes ([n_ops]) from its start to its end when given (module docstring)."""
    buffers, total = peak_memories(sched, phase, op_start, op_end, transient)
    return buffers if transient is None else total


def peak_memories(sched: Schedule, phase: int, op_start: np.ndarray, op_end: np.ndarray,
                  transient: np.ndarray | None = None,
                  rep_op: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """([n_ranks] peak bytes of the tensors alone, [n_ranks] peak with ``transient`` too; the two are equal without
    it) of pass ``phase``.

    Args:
        op_start, op_end: [n_ops] seconds (NaN: not run; such an op holds no workspace).
        transient: [n_ops] bytes each op holds while it runs, or None.
        rep_op: [n_ops] the op at the same position of its rank's representative, whose start and end this op's
            equal (:attr:`meshplan.cost.symmetry.Reduction.rep_op`, as a simulation reduced by symmetry leaves
            them); None: no reduction. Only the speed depends on it.
    """
    ev = _TensorEvents(sched, phase, op_start, op_end)
    o = sched.ops
    ops = np.zeros(0, dtype=np.int64)
    if transient is not None:
        ops = np.flatnonzero((o.phase == phase) & (transient > 0) & np.isfinite(op_start) & np.isfinite(op_end))
    w = np.zeros(len(o)) if transient is None else transient
    alone = np.ones(sched.n_ranks, dtype=bool)
    buffers, total = np.zeros(sched.n_ranks), np.zeros(sched.n_ranks)
    if rep_op is not None:
        alone = _orbit_peaks(sched, phase, ev, ops, op_start, op_end, w, rep_op, buffers, total)
    if alone.any():
        b, t = _rank_sorted_peaks(sched, ev, np.flatnonzero(alone[ev.rank]), ops[alone[o.rank[ops]]], op_start,
                                  op_end, [w])
        buffers[alone], total[alone] = b[alone], t[alone]
    return buffers, (buffers if transient is None else total)


def peak_memories_over(sched: Schedule, phase: int, op_start: np.ndarray, op_end: np.ndarray,
                       transients: list[np.ndarray]) -> tuple[np.ndarray, list[np.ndarray]]:
    """([n_ranks] peak bytes of the tensors alone, for each of ``transients`` [n_ranks] the peak with it) of pass
    ``phase``: :func:`peak_memories` of each transient (no reduction), from one sort of the events — the ops that
    hold some transient's bytes give every one its events, zero where it holds none (a level read again at an
    instant with no change: the same maxima)."""
    ev = _TensorEvents(sched, phase, op_start, op_end)
    o = sched.ops
    holds = np.zeros(len(o), dtype=bool)
    for w in transients:
        holds |= w > 0
    ops = np.flatnonzero((o.phase == phase) & holds & np.isfinite(op_start) & np.isfinite(op_end))
    peaks = _rank_sorted_peaks(sched, ev, slice(None), ops, op_start, op_end, transients)
    return peaks[0], peaks[1:]


def _rank_sorted_peaks(sched: Schedule, ev: _TensorEvents, tensors, ops: np.ndarray, op_start: np.ndarray,
                       op_end: np.ndarray, transients: list[np.ndarray]) -> list[np.ndarray]:
    """[the tensors' peak, then the peak with each of ``transients``] ([n_ranks] bytes each) of the events of
    ``ev``'s ``tensors`` (indices or a slice) and of ``ops`` (each holding a transient's bytes from start to end),
    from one sort (:func:`_sorted_peaks`)."""
    o = sched.ops
    rank = np.r_[ev.rank[tensors], ev.rank[tensors], o.rank[ops], o.rank[ops]]
    time = np.r_[ev.alloc[tensors], ev.free[tensors], op_start[ops], op_end[ops]]
    sizes = ev.size[tensors]
    held = np.r_[sizes, -sizes]
    deltas = [np.r_[held, np.zeros(2 * len(ops))]] + [np.r_[held, w[ops], -w[ops]] for w in transients]
    return _sorted_peaks(rank, time, deltas, sched.n_ranks)


class _TensorEvents:
    """The tensors of one pass: rank, bytes, allocation and free times (s)."""

    def __init__(self, sched: Schedule, phase: int, op_start: np.ndarray, op_end: np.ndarray) -> None:
        t, o = sched.tensors, sched.ops
        sel = np.flatnonzero(t.phase == phase)
        in_pass = o.phase == phase
        pass_end = np.nanmax(op_end[in_pass]) if in_pass.any() else 0.0
        self.alloc = np.where(t.alloc_op[sel] >= 0, op_start[np.maximum(t.alloc_op[sel], 0)], 0.0)
        self.free = np.full(len(sel), pass_end + 1.0)
        has_free = np.diff(t.free_ptr)[sel] > 0
        if has_free.any():      # the last of each tensor's free_after ops: one reduction over the non-empty CSR rows
            rows = np.flatnonzero(np.diff(t.free_ptr) > 0)        # (contiguous: together they tile free_after)
            last = np.full(len(t.rank), -np.inf)
            last[rows] = np.maximum.reduceat(op_end[t.free_after], t.free_ptr[rows])
            self.free[has_free] = last[sel][has_free]
        self.rank = t.rank[sel].astype(np.int64)
        self.size = t.size_bytes[sel].astype(np.float64)


def _sorted_peaks(rank: np.ndarray, time: np.ndarray, deltas: list[np.ndarray], n_ranks: int) -> list[np.ndarray]:
    """[n_ranks] peak level of each of ``deltas`` (bytes per event) over events (``rank``, ``time``), from one sort.

    By rank, then time: a sort by time, then a stable (radix) sort by rank. Events at one instant of one rank are
    taken together (the level is read at the instant's end), so their order within it does not matter: the time
    sort need not be stable (quicksort: 2.5x faster). A rank's level at a position is the running sum there less
    the running sum before the rank's first event; the subtraction is monotone, so it is applied to the maxima."""
    peaks = [np.zeros(n_ranks) for _ in deltas]
    if len(rank) == 0:
        return peaks
    by_time = np.argsort(time)
    order = by_time[np.argsort(rank[by_time].astype(np.int16 if n_ranks < 2**15 else np.int64), kind="stable")]
    r_sorted, t_sorted = rank[order], time[order]
    new_rank = np.r_[True, r_sorted[1:] != r_sorted[:-1]]
    ends = np.flatnonzero(np.r_[new_rank[1:] | (t_sorted[1:] != t_sorted[:-1]), True])   # each instant's last
    firsts = np.flatnonzero(new_rank)
    rank_of = r_sorted[firsts]
    group_start = np.searchsorted(ends, firsts)                 # each rank's first instant end
    for peak, delta in zip(peaks, deltas):
        cum = np.cumsum(delta[order])
        before = np.r_[0.0, cum[firsts[1:] - 1]]
        peak[rank_of] = np.maximum(np.maximum.reduceat(cum[ends], group_start) - before, 0.0)
    return peaks


def _orbit_peaks(sched: Schedule, phase: int, ev: _TensorEvents, ops: np.ndarray, op_start: np.ndarray,
                 op_end: np.ndarray, w: np.ndarray, rep_op: np.ndarray, buffers: np.ndarray,
                 total: np.ndarray) -> np.ndarray:
    """Fill ``buffers`` and ``total`` for every rank whose ops' times and tensors follow its representative's (module
    docstring), each representative's events sorted once; returns the mask of the ranks left to sort on their own."""
    o, n, ptr = sched.ops, sched.n_ranks, sched.rank_ptr
    rank_ids = np.arange(n)
    rep = rank_ids.copy()
    has_ops = np.diff(ptr) > 0
    rep[has_ops] = o.rank[rep_op[ptr[:-1][has_ops]]]
    same = (rep != rank_ids) & (rep[rep] == rep)
    mine = np.flatnonzero(o.phase == phase)                     # the times the reduction promises, checked
    moved = ~(_equal(op_start[rep_op[mine]], op_start[mine]) & _equal(op_end[rep_op[mine]], op_end[mine]))
    same[o.rank[mine[moved]]] = False
    t_order = np.argsort(ev.rank, kind="stable")                # each rank's tensors, in table order
    t_ptr = np.r_[0, np.cumsum(np.bincount(ev.rank, minlength=n))]
    count = np.diff(t_ptr)
    same &= count == count[rep]
    if len(t_order):
        # each rank's tensors as a multiset of (allocation, free, bytes): in that order, the k-th of a member against
        # the k-th of its representative (a member may create the same tensors in another order: a Ulysses rank's
        # own head range first)
        by_event = np.lexsort((ev.size, ev.free, ev.alloc, ev.rank))
        t_local = np.empty(len(by_event), dtype=np.int64)
        t_local[by_event] = np.arange(len(by_event)) - t_ptr[ev.rank[by_event]]
        twin = by_event[np.minimum(t_ptr[rep[ev.rank]] + t_local, len(by_event) - 1)]
        bad = ~((ev.size == ev.size[twin]) & (ev.alloc == ev.alloc[twin]) & (ev.free == ev.free[twin]))
        same[ev.rank[bad]] = False
    alone = np.ones(n, dtype=bool)
    on_rep = np.zeros(len(o), dtype=bool)          # a representative's op whose workspace some member holds
    on_rep[rep_op[ops]] = True
    for q in np.unique(rep[same]):
        members = np.r_[q, np.flatnonzero(same & (rep == q))]
        tq = t_order[t_ptr[q]:t_ptr[q + 1]]
        oq = ptr[q] + np.flatnonzero(on_rep[ptr[q]:ptr[q + 1]])
        time = np.r_[ev.alloc[tq], ev.free[tq], op_start[oq], op_end[oq]]
        if len(time):
            order = np.argsort(time)
            t_sorted = time[order]
            ends = np.flatnonzero(np.r_[t_sorted[1:] != t_sorted[:-1], True])   # each instant's last event
            held = np.r_[ev.size[tq], -ev.size[tq]]
            at = (oq - ptr[q])[None, :] + ptr[members][:, None]               # [members, ops]: the same op
            rows = np.concatenate([np.r_[held, np.zeros(2 * len(oq))][None, :],      # row 0: the tensors alone
                                   np.c_[np.broadcast_to(held, (len(members), len(held))), w[at], -w[at]]])
            peak = np.maximum(np.cumsum(rows[:, order], axis=1)[:, ends].max(axis=1), 0.0)
            buffers[members], total[members] = peak[0], peak[1:]
        alone[members] = False
    return alone


def _equal(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Elementwise a == b, NaN equal to NaN."""
    return (a == b) | (np.isnan(a) & np.isnan(b))
