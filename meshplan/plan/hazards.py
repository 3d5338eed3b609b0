"""Data hazards: every access to a buffer is ordered as the data requires (part of the verifier).

Happens-before inside a rank follows the semantics of :mod:`meshplan.plan.schedule`: an item (op or P2P
batch) happens after its stream predecessor and its deps, transitively. It is computed as a vector clock
per item — for every stream, the last position on that stream that happens before or at the item —
rank-parallel in topological order (items sorted by their last member op id; deps point to earlier ops).

Rules, per tensor, in program order of its accesses (reads: compute/merge/accumulate inputs, sends;
writes: outputs, recvs; ``merge``/``accumulate`` outputs are read and written):

* every read happens after the previous write (RAW), every write after the previous write (WAW) and after
  every read since it (WAR); two accesses in one batch conflict unless both read;
* a tensor allocated by an op is first accessed by that op, or after it;
* a freed tensor's accesses all happen before or at one of its ``free_after`` ops.
"""

from __future__ import annotations

import numpy as np

from meshplan.plan.dataflow import Items
from meshplan.plan.schedule import OP_KINDS, RECV, SEND, Schedule


def vector_clocks(sched: Schedule, items: Items) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(clock [n_items, n_streams], stream of item, position of item on its stream)."""
    o = sched.ops
    n, n_streams = items.n, len(sched.streams.names)
    first = items.members[items.member_ptr[:-1]]
    stream = o.stream[first].astype(np.int64)
    key = items.rank.astype(np.int64) * n_streams + stream
    group_start = np.r_[0, np.flatnonzero(key[1:] != key[:-1]) + 1]
    pos = np.arange(n) - np.repeat(group_start, np.diff(np.r_[group_start, n]))
    last_member = np.maximum.reduceat(items.members, items.member_ptr[:-1]) if n else np.zeros(0, dtype=np.int64)
    order = np.lexsort((last_member, items.rank))
    rank_sorted = items.rank[order]
    rank_start = np.r_[0, np.flatnonzero(rank_sorted[1:] != rank_sorted[:-1]) + 1] if n else np.zeros(0, int)
    k_of = np.arange(n) - np.repeat(rank_start, np.diff(np.r_[rank_start, n]))
    clock = np.full((n, n_streams), -1, dtype=np.int64)
    by_k = np.argsort(k_of, kind="stable")
    bounds = np.searchsorted(k_of[by_k], np.arange(int(k_of.max(initial=-1)) + 2))
    for k in range(len(bounds) - 1):
        cur = order[by_k[bounds[k]:bounds[k + 1]]]
        counts = items.pred_ptr[cur + 1] - items.pred_ptr[cur]
        first = np.cumsum(counts) - counts
        idx = np.repeat(items.pred_ptr[cur] - first, counts) + np.arange(first[-1] + counts[-1])
        acc = np.full((len(cur), n_streams), -1, dtype=np.int64)
        some = counts > 0                       # each item's predecessors' clocks, their maximum (a run each)
        if some.any():
            acc[some] = np.maximum.reduceat(clock[items.preds[idx]], first[some], axis=0)
        acc[np.arange(len(cur)), stream[cur]] = pos[cur]
        clock[cur] = acc
    return clock, stream, pos


def _accesses(sched: Schedule, phase: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(op, tensor, is_write) for every access of the pass, one row per (op, tensor)."""
    o = sched.ops
    ops_in = np.repeat(np.arange(len(o)), np.diff(o.in_ptr))
    ops_out = np.repeat(np.arange(len(o)), np.diff(o.out_ptr))
    in_pass, out_pass = o.phase[ops_in] == phase, o.phase[ops_out] == phase
    comm = np.flatnonzero(((o.kind == SEND) | (o.kind == RECV)) & (o.phase == phase))
    op = np.r_[ops_in[in_pass], ops_out[out_pass], comm]
    tensor = np.r_[o.inputs[in_pass], o.outputs[out_pass], o.tensor[comm]]
    write = np.r_[np.zeros(in_pass.sum(), bool), np.ones(out_pass.sum(), bool), o.kind[comm] == RECV]
    key = tensor * len(o) + op  # one row per (tensor, op), a write if any access writes (sorted first)
    order = np.argsort(2 * key + ~write)
    key, op, tensor, write = key[order], op[order], tensor[order], write[order]
    first = np.r_[True, key[1:] != key[:-1]] if len(key) else np.zeros(0, bool)
    return op[first], tensor[first], write[first]


def check_hazards(sched: Schedule, items: Items) -> list[str]:
    """Violations of the rules above for one pass (``items`` of that pass)."""
    o = sched.ops
    clock, stream, pos = vector_clocks(sched, items)
    it = items.item_of_op

    def before(a: np.ndarray, b: np.ndarray, allow_same: bool) -> np.ndarray:
        ia, ib = it[a], it[b]
        same = ia == ib
        hb = clock[ib, stream[ia]] >= pos[ia]
        return np.where(same, allow_same | (a == b), hb & ~same)

    op, tensor, write, starts, prev_w, nxt_w = _chains(sched, items)
    out: list[str] = []
    group_first = np.flatnonzero(starts)
    pairs = prev_w >= 0
    ok = before(op[prev_w[pairs]], op[pairs], allow_same=False)
    bad = np.flatnonzero(pairs)[~ok]
    out += [f"op {op[k]} ({OP_KINDS[o.kind[op[k]]]}) may touch tensor {tensor[k]} while op {op[prev_w[k]]} "
            f"still writes it: add a dependency" for k in bad]
    reads = (~write) & (nxt_w >= 0)
    ok = before(op[reads], op[nxt_w[reads]], allow_same=False)
    bad = np.flatnonzero(reads)[~ok]
    out += [f"op {op[nxt_w[k]]} may overwrite tensor {tensor[k]} before op {op[k]} has read it" for k in bad]
    out += _alloc_free(sched, op, tensor, group_first, before)
    return out


def _chains(sched: Schedule, items: Items):
    """Accesses of the pass by ``items``' ops, grouped by tensor in program order: (op, tensor, write, starts — the
    first access of each tensor —, prev_w — the previous write's row, −1 —, nxt_w — the next write's row, −1)."""
    op, tensor, write = _accesses(sched, items.phase)
    mine = items.item_of_op[op] >= 0            # items of some ranks only (their tensors are their own)
    op, tensor, write = op[mine], tensor[mine], write[mine]
    n = len(op)
    idx = np.arange(n)
    starts = np.r_[True, tensor[1:] != tensor[:-1]] if n else np.zeros(0, bool)
    group = np.cumsum(starts) - 1
    last_w = np.maximum.accumulate(np.where(write | starts, idx, 0)) if n else idx
    last_w = np.where(write[last_w] & (group[last_w] == group), last_w, -1) if n else idx
    prev_w = np.where(starts, -1, np.r_[-1, last_w[:-1]]) if n else idx
    return op, tensor, write, starts, prev_w, _next_write(write, starts)


def _next_write(write: np.ndarray, starts: np.ndarray) -> np.ndarray:
    n = len(write)
    idx = np.arange(n)
    rev = np.minimum.accumulate(np.where(write, idx, n)[::-1])[::-1]
    nxt = np.r_[rev[1:], n]
    group_end = np.r_[np.flatnonzero(starts)[1:], n]
    g = np.cumsum(starts) - 1
    return np.where(nxt < group_end[g], nxt, -1)


def _member(keys: np.ndarray, pool: np.ndarray) -> np.ndarray:
    """keys[i] in pool (sort-based; np.isin hashes and is slow on millions of int64)."""
    pool = np.sort(pool)
    pos = np.minimum(np.searchsorted(pool, keys), max(len(pool) - 1, 0))
    return (pool[pos] == keys) if len(pool) else np.zeros(len(keys), dtype=bool)


def _alloc_free(sched, op, tensor, group_first, before) -> list[str]:
    t, out = sched.tensors, []
    firsts = group_first
    alloc = t.alloc_op[tensor[firsts]]
    has = alloc >= 0
    ok = before(alloc[has], op[firsts][has], allow_same=True)
    out += [f"tensor {tensor[firsts][has][k]} is used by op {op[firsts][has][k]} before op {alloc[has][k]} "
            f"allocates it" for k in np.flatnonzero(~ok)]
    counts = np.diff(t.free_ptr)[tensor]
    n_ops = len(sched.ops)
    free_owner = np.repeat(np.arange(len(t.rank)), np.diff(t.free_ptr))
    listed = _member(tensor * n_ops + op, free_owner * n_ops + t.free_after)   # the access is a free_after op
    counts = np.where(listed, 0, counts)                                         # ... so it needs no pairing
    rows = np.repeat(np.arange(len(op)), counts)
    f_ops = t.free_after[np.repeat(t.free_ptr[tensor], counts) + np.arange(counts.sum())
                         - np.repeat(np.cumsum(counts) - counts, counts)]
    covered = listed.copy()
    some = np.flatnonzero(counts > 0)           # each access's free ops: a run of rows (np.repeat)
    if len(some):
        covered[some] |= np.logical_or.reduceat(before(op[rows], f_ops, allow_same=True),
                                                (np.cumsum(counts) - counts)[some])
    bad = np.flatnonzero((np.diff(t.free_ptr)[tensor] > 0) & ~covered)
    out += [f"tensor {tensor[k]} may be freed before op {op[k]} has finished with it" for k in bad]
    return out



def hazard_orders(sched: Schedule, items: Items) -> tuple[np.ndarray, np.ndarray]:
    """(a, b) op pairs, a before b, that the rules above need and this schedule's happens-before provides: the
    previous write before each access, each read before the next write, the allocating op before the first
    access, and each access before a ``free_after`` op of its tensor. A reordering (:mod:`meshplan.search.ilp.model`)
    must keep these, as deps where the two ops end up on different streams. Pairs within one item are left out
    (a batch's members start together)."""
    clock, stream, pos = vector_clocks(sched, items)
    it = items.item_of_op
    t = sched.tensors
    op, tensor, write, starts, prev_w, nxt_w = _chains(sched, items)
    idx = np.arange(len(op))
    has = prev_w >= 0
    a, b = [op[prev_w[has]]], [op[has]]
    reads = (~write) & (nxt_w >= 0)
    a.append(op[reads])
    b.append(op[nxt_w[reads]])
    firsts = np.flatnonzero(starts)
    alloc = t.alloc_op[tensor[firsts]]
    ok = alloc >= 0
    a.append(alloc[ok])
    b.append(op[firsts][ok])
    counts = np.diff(t.free_ptr)[tensor]
    rows = np.repeat(idx, counts)
    f_ops = t.free_after[np.repeat(t.free_ptr[tensor], counts) + np.arange(counts.sum())
                         - np.repeat(np.cumsum(counts) - counts, counts)]
    x = op[rows]
    in_pass = it[f_ops] >= 0
    x, f_ops, rows = x[in_pass], f_ops[in_pass], rows[in_pass]
    hb = (clock[it[f_ops], stream[it[x]]] >= pos[it[x]]) & (x != f_ops)
    rows, x, f_ops = rows[hb], x[hb], f_ops[hb]
    first = np.r_[True, rows[1:] != rows[:-1]] if len(rows) else np.zeros(0, bool)   # one free op per access
    a.append(x[first])
    b.append(f_ops[first])
    a, b = np.concatenate(a), np.concatenate(b)
    keep = it[a] != it[b]
    return a[keep], b[keep]
