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

from meshplan.core.csr import csr_take
from meshplan.plan.dataflow import Items
from meshplan.plan.schedule import OP_KINDS, RECV, SEND, Schedule


def vector_clocks(sched: Schedule, items: Items) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(clock [n_items, n_streams], stream of item, position of item on its stream). Positions are below the number
    of items: all three are int32 where they fit (half the bytes the loop below gathers and reduces, and the hazard
    checks gather per access)."""
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
    width = np.int32 if n < 2**31 else np.int64
    clock = np.full((n, n_streams), -1, dtype=width)
    by_k = np.argsort(k_of, kind="stable")
    bounds = np.searchsorted(k_of[by_k], np.arange(int(k_of.max(initial=-1)) + 2))
    for k in range(len(bounds) - 1):
        cur = order[by_k[bounds[k]:bounds[k + 1]]]
        counts = items.pred_ptr[cur + 1] - items.pred_ptr[cur]
        first = np.cumsum(counts) - counts
        idx = np.repeat(items.pred_ptr[cur] - first, counts) + np.arange(first[-1] + counts[-1])
        acc = np.full((len(cur), n_streams), -1, dtype=width)
        some = counts > 0                       # each item's predecessors' clocks, their maximum (a run each)
        if some.any():
            acc[some] = np.maximum.reduceat(clock[items.preds[idx]], first[some], axis=0)
        acc[np.arange(len(cur)), stream[cur]] = pos[cur]
        clock[cur] = acc
    return clock, stream.astype(width), pos.astype(width)


def _accesses(sched: Schedule, ops: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(op, tensor, is_write) for every access of the ops ``ops`` (one pass's), one row per (op, tensor),
    sorted by (tensor, op); a row is a write if any access of the op to the tensor writes.

    Each access is packed whole into one int64 key, (tensor, op, not a write) with the op in ``bits`` bits, so that
    one sort of the keys' values (no argsort, no gathers by its order) orders them with the write of a (tensor, op)
    first; accesses with equal keys are equal. The keys are built in place: arrays of millions of rows, each new
    one paid in page faults too."""
    o = sched.ops
    bits = max(len(o), 1).bit_length()
    parts = []
    for ptr, values, reads in ((o.in_ptr, o.inputs, 1), (o.out_ptr, o.outputs, 0)):
        mine_ptr, mine = csr_take(ptr, values, ops)        # a copy: _pack works in place
        parts.append(_pack(mine, np.repeat(ops, np.diff(mine_ptr)), bits, reads))
    comm = ops[(o.kind[ops] == SEND) | (o.kind[ops] == RECV)]
    parts.append(_pack(o.tensor[comm], comm, bits, o.kind[comm] != RECV))
    packed = np.concatenate(parts)
    packed.sort()
    key = packed >> 1
    first = np.ones(len(key), dtype=bool)
    np.not_equal(key[1:], key[:-1], out=first[1:])
    key, write = key[first], (packed[first] & 1) == 0
    op = key & ((1 << bits) - 1)
    key >>= bits
    return op, key, write


def _pack(tensor: np.ndarray, op: np.ndarray, bits: int, reads) -> np.ndarray:
    """((tensor << bits | op) << 1) | reads as int64, in place on one new array (``tensor`` is a fresh copy)."""
    key = tensor.astype(np.int64, copy=False)
    key <<= bits
    key |= op
    key <<= 1
    key |= reads
    return key


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
    rows = _Rows(clock, stream, pos, it[op])
    out: list[str] = []
    group_first = np.flatnonzero(starts)
    bad = np.flatnonzero((prev_w >= 0) & ~rows.after_previous(prev_w))
    out += [f"op {op[k]} ({OP_KINDS[o.kind[op[k]]]}) may touch tensor {tensor[k]} while op {op[prev_w[k]]} "
            f"still writes it: add a dependency" for k in bad]
    reads = np.flatnonzero((~write) & (nxt_w >= 0))
    bad = reads[~rows.before(reads, nxt_w[reads])]
    out += [f"op {op[nxt_w[k]]} may overwrite tensor {tensor[k]} before op {op[k]} has read it" for k in bad]
    out += _alloc(sched, op, tensor, group_first, before)
    out += _free(sched, op, tensor, starts, it, rows)
    return out


class _Rows:
    """Happens-before between accesses (rows of :func:`_chains`), from their ops' items' clocks: item a happens
    before item b iff ``clock[b, stream of a] >= position of a`` (the flat index into ``clock`` built without
    2-D fancy indexing)."""

    def __init__(self, clock: np.ndarray, stream: np.ndarray, pos: np.ndarray, item: np.ndarray) -> None:
        self.clock, self.width, self.item = clock.ravel(), clock.shape[1], item
        self.stream, self.pos = stream[item], pos[item]         # [n rows] each access's stream and position

    def before(self, ra: np.ndarray, rb: np.ndarray) -> np.ndarray:
        """[len(ra)] row ``ra`` happens before row ``rb``, in another item (two accesses of one item are unordered;
        the rows of one tensor's chain are distinct ops, so two of them are never one op)."""
        ia, ib = self.item[ra], self.item[rb]
        return (self.clock[ib * self.width + self.stream[ra]] >= self.pos[ra]) & (ia != ib)

    def after_previous(self, prev: np.ndarray) -> np.ndarray:
        """[n rows] :meth:`before` (``prev``, every row), for a ``prev`` [n rows] of earlier rows: no index arrays of
        the rows with one (most have); a row with −1 there gets a meaningless answer (row −1 is read), to be masked."""
        ia = self.item[prev]
        return (self.clock[self.item * self.width + self.stream[prev]] >= self.pos[prev]) & (ia != self.item)


def _chains(sched: Schedule, items: Items):
    """Accesses of the pass by ``items``' ops, grouped by tensor in program order: (op, tensor, write, starts — the
    first access of each tensor —, prev_w — the previous write's row, −1 —, nxt_w — the next write's row, −1)."""
    op, tensor, write = _accesses(sched, items.ops)    # items of some ranks only: their own tensors
    starts = np.ones(len(op), dtype=bool)
    np.not_equal(tensor[1:], tensor[:-1], out=starts[1:])
    return (op, tensor, write, starts) + _writes_around(write, starts)


def _writes_around(write: np.ndarray, starts: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """([n] the row of the previous write of each row's group, −1; [n] the row of the next one, −1), for rows in
    groups that begin at ``starts``. Row indices as int32 where they fit (half the bytes to write and page in)."""
    n = len(write)
    idx = np.arange(n, dtype=np.int32 if n < 2**31 - 1 else np.int64)
    group_start = np.maximum.accumulate(np.where(starts, idx, 0)) if n else idx
    prev = np.empty_like(idx)                   # the last write before the row
    prev[:1] = -1
    np.maximum.accumulate(np.where(write[:-1], idx[:-1], -1), out=prev[1:])
    prev[prev < group_start] = -1
    nxt = np.empty_like(idx)                    # the first write after the row, and the next group's start
    nxt[-1:] = n
    np.minimum.accumulate(np.where(write[1:], idx[1:], n)[::-1], out=nxt[-2::-1])
    group_end = np.empty_like(idx)
    group_end[-1:] = n
    np.minimum.accumulate(np.where(starts[1:], idx[1:], n)[::-1], out=group_end[-2::-1])
    nxt[nxt >= group_end] = -1
    return prev, nxt


def _alloc(sched, op, tensor, group_first, before) -> list[str]:
    """A tensor allocated by an op is first accessed by that op, or after it (its allocating op may lie outside
    the pass's items: ``before`` reads item −1 then, as it always has)."""
    t = sched.tensors
    firsts = group_first
    alloc = t.alloc_op[tensor[firsts]]
    has = alloc >= 0
    ok = before(alloc[has], op[firsts][has], allow_same=True)
    return [f"tensor {tensor[firsts][has][k]} is used by op {op[firsts][has][k]} before op {alloc[has][k]} "
            f"allocates it" for k in np.flatnonzero(~ok)]


def _free(sched, op, tensor, starts, it, rows: _Rows) -> list[str]:
    """A freed tensor's accesses all happen before or at one of its ``free_after`` ops.

    Access a (item i, stream s, position p) happens before or at free op f iff ``clock[item of f, s] >= p``: an
    item's clock holds its own position on its stream, so this holds too where f is a's op or in a's batch. "Before
    or at one of them" is then ``max over f of clock[item of f, s] >= p``: one [streams] maximum per tensor of its
    free ops' clocks, read once per access — not one test per (access, free op) pair. (A free op outside the pass's
    items reads item −1's clock, as the test per pair did.)"""
    t = sched.tensors
    group = np.cumsum(starts, dtype=np.int64 if len(starts) * rows.width >= 2**31 else np.int32)
    group -= 1
    tg = tensor[starts]                                          # each accessed tensor, in row order
    counts = np.diff(t.free_ptr)[tg]
    some = np.flatnonzero(counts > 0)
    latest = np.full((len(tg), rows.width), -1, dtype=rows.clock.dtype)
    if len(some):
        f_ops = t.free_after[np.repeat(t.free_ptr[tg] - np.cumsum(counts) + counts, counts) + np.arange(counts.sum())]
        clocks = rows.clock.reshape(-1, rows.width)[it[f_ops]]
        latest[some] = np.maximum.reduceat(clocks, (np.cumsum(counts) - counts)[some], axis=0)  # runs tile f_ops
    covered = latest.ravel()[group * rows.width + rows.stream] >= rows.pos
    return [f"tensor {tensor[k]} may be freed before op {op[k]} has finished with it"
            for k in np.flatnonzero((counts[group] > 0) & ~covered)]


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
