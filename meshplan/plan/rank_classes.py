"""Ranks whose ops and tensors are the same up to relabelling, proved by exact comparison (for the verifier's
per-rank checks: :func:`meshplan.plan.hazards.check_hazards` on one rank of each class).

A rank's *local form*: each of its ops by its place in the rank's program order (op − the rank's first op), with
its kind, stream, pass, step, deps (as places), inputs, outputs and comm tensor (each tensor as its place among the
rank's tensors in id order); each of its tensors, in that order, with its ``alloc_op`` and ``free_after`` ops (as
places). Two ranks of equal local forms have the same items, the same happens-before and the same accesses in the
same order, so a check that reads no more than these finds a violation on one iff on the other.

Ranks of the same counts (ops, tensors, deps, inputs, outputs, frees) are laid side by side as rows — a rank's ops
are contiguous, its tensors made so by one sort — and grouped by equal rows, each column's rows compared whole as
bytes: a rank whose tensors' ``alloc_op`` or ``free_after`` lie on another rank is a class of its own (its ops'
references to other ranks are the verifier's structure and tensor checks', which run first). So the classes are
exact: comparison, no hash. A 1024-rank Mesh schedule: one class, found in ~0.1 s; the main job's 256-rank USP
schedule: 32 (a Ulysses group's members differ, its ring's repeat).

Source: the orbit reduction of the search's quotient builds (:mod:`meshplan.plan.quotient`), here proved on the
schedule's own arrays, as a verifier must.
"""

from __future__ import annotations

import numpy as np

from meshplan.core.csr import csr_take, unique_rows
from meshplan.plan.schedule import RECV, SEND, Schedule


def rank_classes(sched: Schedule) -> np.ndarray:
    """[n_ranks] each rank's representative: the first rank of equal local form (module docstring), or itself.

    For a schedule whose ops' references passed the verifier's structure and tensor checks (deps: earlier ops of
    their rank; inputs, outputs and comm tensors: their rank's tensors): those are not checked again here, the
    tensors' alloc and free ops are. Every rank is its own where its ops are not in rank order (then no rank's ops
    are contiguous) or a tensor's rank is not a rank."""
    o, t, n_ranks = sched.ops, sched.tensors, sched.n_ranks
    rep = np.arange(n_ranks)
    if n_ranks < 2 or not len(o.rank) or (np.diff(o.rank) < 0).any() or \
            (len(t.rank) and (t.rank.min() < 0 or t.rank.max() >= n_ranks)):
        return rep
    rows = _Rows(sched)
    sig = np.stack([np.diff(sched.rank_ptr), rows.t_count, *(np.diff(p[sched.rank_ptr]) for p in
                                                           (o.dep_ptr, o.in_ptr, o.out_ptr)), rows.free_count], axis=1)
    _, group = np.unique(sig, axis=0, return_inverse=True)
    group = group.ravel()
    for g in np.unique(group):
        members = np.flatnonzero(group == g)
        if len(members) > 1:
            _match(*rows.of(members), members, rep)
    return rep


def _match(form: list[np.ndarray], own: np.ndarray, members: np.ndarray, rep: np.ndarray) -> None:
    """Set ``rep`` of ``members`` (ranks of equal counts; ``form`` their local forms' columns as [k, width] rows;
    ``own`` [k] whether each keeps to itself): the first member of each set of equal rows in every column — rows
    compared whole, as bytes (:func:`meshplan.core.csr.unique_rows`), so equal means equal."""
    ids = np.zeros(len(members), dtype=np.int64)
    for rows in form:
        rows = rows.reshape(len(members), -1)
        if (rows == rows[0]).all():             # one row (a schedule that repeats on every rank): no sort
            continue
        _, again = unique_rows(rows)
        _, ids = unique_rows(np.stack([ids, again], axis=1))
    ids = np.where(own, ids, -1 - np.arange(len(members)))       # a rank that does not keep to itself: alone
    _, first, again = np.unique(ids, return_index=True, return_inverse=True)
    rep[members] = members[first[again.ravel()]]


class _Rows:
    """The local form of ranks of equal counts, side by side (:meth:`of`)."""

    def __init__(self, sched: Schedule) -> None:
        o, t = sched.ops, sched.tensors
        self.sched, n_ranks = sched, sched.n_ranks
        self.t_order = np.argsort(t.rank, kind="stable")          # each rank's tensors in id order, rank by rank
        self.t_count = np.bincount(t.rank, minlength=n_ranks)
        self.t_ptr = np.r_[0, np.cumsum(self.t_count)]
        self.local_t = np.empty(len(t.rank), dtype=np.int64)
        self.local_t[self.t_order] = np.arange(len(t.rank)) - np.repeat(self.t_ptr[:-1], self.t_count)
        free_n = np.diff(t.free_ptr)[self.t_order]
        self.free_count = np.bincount(t.rank[self.t_order], weights=free_n, minlength=n_ranks).astype(np.int64)
        self.free_sorted = csr_take(t.free_ptr, t.free_after, self.t_order)[1]    # rank by rank, in t_order
        self.free_ptr_sorted = np.r_[0, np.cumsum(self.free_count)]
        self.comm = (o.kind == SEND) | (o.kind == RECV)

    def of(self, ranks: np.ndarray) -> tuple[list[np.ndarray], np.ndarray]:
        """(the local form of ``ranks`` — of equal counts — as [len(ranks), width] rows, [len(ranks)] whether each
        rank's tensors' alloc and free ops are its own)."""
        s, o, t = self.sched, self.sched.ops, self.sched.tensors
        first = s.rank_ptr[ranks]
        n_ops = s.rank_ptr[ranks[0] + 1] - first[0]

        def side_by_side(values: np.ndarray, ptr: np.ndarray | None = None) -> np.ndarray:
            """[len(ranks), width] each rank's ops' ``values`` (``ptr``: their CSR lists' entries) as a row: a view
            where the ranks are every rank (each rank's run follows the last's)."""
            start = first if ptr is None else ptr[first]
            width = n_ops if ptr is None else ptr[first[0] + n_ops] - start[0]
            if len(ranks) == s.n_ranks:
                return values[start[0]:start[0] + width * len(ranks)].reshape(len(ranks), width)
            return values[start[:, None] + np.arange(width)]

        comm = side_by_side(self.comm)
        form = [side_by_side(o.kind), side_by_side(o.stream), side_by_side(o.phase),
                np.where(comm, side_by_side(o.step), -1),
                np.where(comm, self.local_t[np.where(comm, side_by_side(o.tensor), 0)], -1)]
        for ptr, values, of_tensor in ((o.dep_ptr, o.deps, False), (o.in_ptr, o.inputs, True),
                                       (o.out_ptr, o.outputs, True)):
            form.append(side_by_side(np.diff(ptr)))
            entries = side_by_side(values, ptr)
            form.append(self.local_t[entries] if of_tensor else entries - first[:, None])
        tens = self.t_order[self.t_ptr[ranks][:, None] + np.arange(self.t_count[ranks[0]])]     # [k, tensors]
        alloc = t.alloc_op[tens]
        none = alloc < 0
        alloc = np.where(none, -1, alloc - first[:, None])
        frees = self.free_sorted[self.free_ptr_sorted[ranks][:, None] + np.arange(self.free_count[ranks[0]])]
        frees -= first[:, None]
        own = (none | ((alloc >= 0) & (alloc < n_ops))).all(axis=1) & ((frees >= 0) & (frees < n_ops)).all(axis=1)
        return form + [alloc, np.diff(t.free_ptr)[tens], frees], own


def class_partner(sched: Schedule, classes: np.ndarray, partner: np.ndarray, op_seconds: np.ndarray,
                  transfer_seconds: np.ndarray) -> np.ndarray | None:
    """[n_ops] for each op of a representative rank (``classes``: :func:`rank_classes`), its transfer's partner as
    the op at the partner's place in the representative of the partner's rank (−1: none; other ops −1): the
    evaluation of :mod:`meshplan.plan.dataflow` on the representatives' ops with these partners is the evaluation of
    every rank's, each op's times its representative's at its place. None where that does not follow: two ranks of
    one class whose ops at one place pair with different places or classes, or take different times.

    Why: every rank's equations (an item starts when its predecessors end; a transfer ends when both sides have
    started, plus its time) are its representative's, place by place, and so are the ones their partners' classes
    give them; the least solution — what the evaluation finds, in waves — is then the same at every rank of a
    class, and it solves the representatives' equations; deadlock freedom (every item ends) likewise."""
    o = sched.ops
    place = np.arange(len(o.rank)) - sched.rank_ptr[o.rank]
    twin = sched.rank_ptr[classes[o.rank]] + place                    # the op at the same place in the rep
    has = partner >= 0
    safe = np.where(has, partner, 0)
    mapped = np.where(has, sched.rank_ptr[classes[o.rank[safe]]] + place[safe], -1)
    agree = (mapped == mapped[twin]) & (op_seconds == op_seconds[twin]) & (transfer_seconds == transfer_seconds[twin])
    if not agree.all():
        return None
    return np.where(classes[o.rank] == o.rank, mapped, -1)
