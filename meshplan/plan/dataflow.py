"""Items (single ops or P2P batches), their precedence, and the uncontended (max-plus) evaluation.

Used by the verifier (a schedule is deadlock-free iff the evaluation completes every item, whatever the
durations: the semantics of :mod:`meshplan.plan.schedule` are monotone), by the closed-form lower bound
(uncontended durations: contention and overlap only make ops longer), and by the simulator (which needs
the same items and precedence). Vectorised in waves: each wave starts every item whose predecessors
have all ended, so a ring of N steps takes O(N) numpy passes over O(N)-sized arrays.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from meshplan.core.csr import csr_ptr
from meshplan.plan.schedule import RECV, SEND, Schedule


@dataclass
class Items:
    """One pass's ops grouped into items, with precedence.

    ``item_of_op`` has an entry for every op of the schedule (−1 outside this pass). Items are numbered
    in (rank, stream, program) order; ``pred``/``succ`` are CSR adjacency (stream predecessor + deps).
    """

    phase: int
    ops: np.ndarray
    item_of_op: np.ndarray
    member_ptr: np.ndarray
    members: np.ndarray
    rank: np.ndarray
    is_comm: np.ndarray
    pred_ptr: np.ndarray
    preds: np.ndarray
    succ_ptr: np.ndarray
    succs: np.ndarray
    partner: np.ndarray          # per op of the schedule: matched op (−1)
    self_dep: np.ndarray         # items with a dep on a member of their own batch (a cycle)
    waves: list | None = None    # the evaluation's index arrays per wave, recorded by its first run

    @property
    def n(self) -> int:
        """Number of items."""
        return len(self.rank)


def batch_joins(o, order: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """For ops ``order`` sorted by (rank, stream, id) — one pass, or several sorted by pass too: (each op follows the
    previous on its (rank, stream, pass), each op joins the previous one's P2P batch: consecutive sends and
    receives of one (rank, stream, pass) with one step ≥ 0, which start and end together)."""
    comm = (o.kind[order] == SEND) | (o.kind[order] == RECV)
    step = o.step[order]
    rank, stream, phase = o.rank[order], o.stream[order], o.phase[order]
    same_seq = np.r_[False, (rank[1:] == rank[:-1]) & (stream[1:] == stream[:-1]) & (phase[1:] == phase[:-1])]
    return same_seq, same_seq & comm & np.r_[False, comm[:-1]] & (step >= 0) & np.r_[False, step[1:] == step[:-1]]


def build_items(sched: Schedule, phase: int, partner: np.ndarray | None = None,
                ranks: np.ndarray | None = None) -> Items:
    """Group the ops of one pass into items and derive their precedence (vectorised).

    ``ranks``: only these ranks' ops (deps never cross ranks, so their items are self-contained).
    """
    o = sched.ops
    if partner is None:
        partner = sched.match_transfers()[0]
    if ranks is None:
        sel = np.flatnonzero(o.phase == phase)
    else:
        spans = [np.arange(sched.rank_ptr[r], sched.rank_ptr[r + 1]) for r in np.asarray(ranks).tolist()]
        sel = np.concatenate(spans) if spans else np.zeros(0, dtype=np.int64)
        sel = sel[o.phase[sel] == phase]
    order = sel[np.lexsort((sel, o.stream[sel], o.rank[sel]))]
    comm = (o.kind[order] == SEND) | (o.kind[order] == RECV)
    same_seq, joins = batch_joins(o, order)
    item_in_order = np.cumsum(~joins) - 1
    n_items = int(item_in_order[-1]) + 1 if len(order) else 0
    item_of_op = np.full(len(o), -1, dtype=np.int64)
    item_of_op[order] = item_in_order
    member_ptr = csr_ptr(np.bincount(item_in_order, minlength=n_items))
    first = member_ptr[:-1]
    rank = o.rank[order][first] if n_items else np.zeros(0, dtype=np.int64)
    is_comm = comm[first] if n_items else np.zeros(0, dtype=bool)
    # stream predecessor: the previous item of the same (rank, stream)
    starts_seq = ~same_seq[first] if n_items else np.zeros(0, dtype=bool)
    sp_dst = np.flatnonzero(~starts_seq)
    src, dst = [sp_dst - 1], [sp_dst]
    # data dependencies of this pass's ops
    counts = np.diff(o.dep_ptr)[sel]
    dep_owner = np.repeat(sel, counts)
    deps = o.deps[np.repeat(o.dep_ptr[sel] - np.cumsum(counts) + counts, counts) + np.arange(counts.sum())]
    keep = o.phase[deps] == phase
    d_src, d_dst = item_of_op[deps[keep]], item_of_op[dep_owner[keep]]
    self_dep = np.unique(d_dst[d_src == d_dst])
    ok = d_src != d_dst
    src.append(d_src[ok])
    dst.append(d_dst[ok])
    src, dst = np.concatenate(src), np.concatenate(dst)
    edge = np.sort(dst * max(n_items, 1) + src)
    edge = edge[np.r_[True, edge[1:] != edge[:-1]]] if len(edge) else edge
    dst, src = np.divmod(edge, max(n_items, 1))
    pred_ptr = csr_ptr(np.bincount(dst, minlength=n_items))
    by_src = np.lexsort((dst, src))
    succ_ptr = csr_ptr(np.bincount(src, minlength=n_items))
    return Items(phase, sel, item_of_op, member_ptr, order, rank, is_comm, pred_ptr, src, succ_ptr,
                 dst[by_src], partner, self_dep)


def _gather(ptr: np.ndarray, values: np.ndarray, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Values of CSR rows ``rows`` concatenated, with the row each came from."""
    counts = ptr[rows + 1] - ptr[rows]
    owner = np.repeat(rows, counts)
    offs = np.repeat(ptr[rows] - np.cumsum(counts) + counts, counts) + np.arange(counts.sum())
    return values[offs], owner


@dataclass
class Evaluation:
    """Start/end of every item (NaN where it never starts or ends) and whether all completed."""

    start: np.ndarray
    end: np.ndarray
    complete: bool
    waves: int


def evaluate(items: Items, duration: np.ndarray, transfer_s: np.ndarray) -> Evaluation:
    """Uncontended evaluation of one pass under the Schedule semantics (max-plus, vectorised in waves).

    Which items start in which wave, and which transfers pair up there, depend on the precedence only, not on
    the durations: the first evaluation of ``items`` records each wave's index arrays and later ones (the
    contended estimate evaluates a pass three times) replay them — the same operations in the same order, a
    third of the numpy calls.

    Args:
        duration: [n_ops] seconds of non-comm ops.
        transfer_s: [n_ops] seconds of the transfer each send/recv takes part in (equal for both sides).
    """
    if items.waves is not None:
        return _replay(items, duration, transfer_s)
    n = items.n
    remaining = np.diff(items.pred_ptr).astype(np.int64)
    ready_at = np.zeros(n)
    start, end = np.full(n, np.nan), np.full(n, np.nan)
    started = np.zeros(n, dtype=bool)
    pending = np.diff(items.member_ptr).astype(np.int64)
    t_end = np.zeros(n)
    frontier, waves = np.flatnonzero(remaining == 0), 0
    record = []
    while len(frontier):
        waves += 1
        start[frontier] = ready_at[frontier]
        was_started = started.copy()
        started[frontier] = True
        comm = frontier[items.is_comm[frontier]]
        plain = frontier[~items.is_comm[frontier]]
        ops = owner = np.zeros(0, dtype=np.int64)
        if len(plain):
            ops, owner = _gather(items.member_ptr, items.members, plain)
            np.maximum.at(t_end, owner, start[owner] + duration[ops])
            pending[plain] = 0
        late, pairs = _pair_up(items, comm, was_started, started, start, pending, t_end, transfer_s)
        done = frontier[pending[frontier] == 0]                      # sorted and unique, as frontier is
        if len(late):
            done = np.union1d(done, late[pending[late] == 0])
        end[done] = t_end[done]
        succ, s_owner = _gather(items.succ_ptr, items.succs, done)
        np.maximum.at(ready_at, succ, end[s_owner])
        record.append((frontier, ops, owner, pairs, done, succ, s_owner))
        np.subtract.at(remaining, succ, 1)
        frontier = np.unique(succ[remaining[succ] == 0])
        frontier = frontier[~started[frontier]]
    items.waves = record
    return Evaluation(start, end, bool(np.isfinite(end).all()), waves)


def _replay(items: Items, duration: np.ndarray, transfer_s: np.ndarray) -> Evaluation:
    """:func:`evaluate` by the waves its first run recorded on ``items``."""
    n = items.n
    ready_at, t_end = np.zeros(n), np.zeros(n)
    start, end = np.full(n, np.nan), np.full(n, np.nan)
    for frontier, ops, owner, pairs, done, succ, s_owner in items.waves:
        start[frontier] = ready_at[frontier]
        if len(ops):
            np.maximum.at(t_end, owner, start[owner] + duration[ops])
        if pairs is not None:
            b_ops, b_owner, b_peer, e_ops, e_owner, e_items = pairs
            np.maximum.at(t_end, b_owner, np.maximum(start[b_owner], start[b_peer]) + transfer_s[b_ops])
            if len(e_items):
                np.maximum.at(t_end, e_items, np.maximum(start[e_owner], start[e_items]) + transfer_s[e_ops])
        end[done] = t_end[done]
        np.maximum.at(ready_at, succ, end[s_owner])
    return Evaluation(start, end, bool(np.isfinite(end).all()), len(items.waves))


def _pair_up(items, comm, was_started, started, start, pending, t_end, transfer_s):
    """Time the transfers whose both sides have now started; returns (earlier-started items touched, the index
    arrays of the timing for a replay, None without transfers)."""
    if len(comm) == 0:
        return np.zeros(0, dtype=np.int64), None
    ops, owner = _gather(items.member_ptr, items.members, comm)
    p_item = items.item_of_op[items.partner[ops]]
    valid = items.partner[ops] >= 0
    both = valid & started[np.where(valid, p_item, 0)]
    t = np.maximum(start[owner[both]], start[p_item[both]]) + transfer_s[ops[both]]
    np.subtract.at(pending, owner[both], 1)
    np.maximum.at(t_end, owner[both], t)
    earlier = both & was_started[np.where(valid, p_item, 0)]
    e_items = p_item[earlier]
    t_early = np.maximum(start[owner[earlier]], start[e_items]) + transfer_s[ops[earlier]]
    np.subtract.at(pending, e_items, 1)
    np.maximum.at(t_end, e_items, t_early)
    return np.unique(e_items), (ops[both], owner[both], p_item[both], ops[earlier], owner[earlier], e_items)
