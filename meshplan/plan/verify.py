"""The verifier: proves a schedule is complete, matched, deadlock-free and within memory.

Checks (docs/architecture.md invariant 4), each reported as one line per violation (first few of each kind):

* structure: known kinds, comm ops on comm streams with a peer in range, compute-type ops on compute
  streams, one communicator per comm stream; deps on earlier ops of the same rank and pass (so a rank can
  issue its ops in program order);
* tensors: every referenced tensor exists on the op's rank; sizes match the workload;
* transfers: every send has exactly one FIFO-matched recv with equal bytes and dtype;
* contents: what arrives is what was sent (kind, heads, chunks in order; a packed send's parts) and a merge's or
  accumulate's outputs hold exactly its input's chunks (:mod:`meshplan.plan.contents`);
* batch order (what NCCL needs of grouped P2P, ``ncclGroupStart/End``): within a communicator, two peers issue
  the batches in which they exchange in the same order — a transfer in rank a's k-th batch with rank b is
  matched in rank b's k-th batch with rank a — so no group waits on a peer's later group;
* coverage: in every pass, every mask-permitted (query chunk, KV chunk) block is computed exactly once
  for every query head, and no single-block op computes a block without a permitted pair (a cartesian op
  may span empty blocks: its mask skips them);
* rows: every compute op takes exactly the query rows and keys of its blocks that are real tokens and take
  part (a file's ``q_rows``/``kv_cols``): padding is never a query row or a key, and no real one is left out;
* data hazards: every buffer access ordered as the data requires (:mod:`meshplan.plan.hazards`);
* deadlock freedom: the semantics of :mod:`meshplan.plan.schedule` are monotone, so the schedule can run to
  completion iff the uncontended evaluation of :mod:`meshplan.plan.dataflow` completes every item;
* memory: peak live tensor bytes per rank, along that evaluation, within the device memory (when a
  topology is given).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from meshplan.core.parallel import Beside, can_fork, start_beside
from meshplan.model.matrix import AttnMatrix, attn_matrix
from meshplan.plan.contents import check_contents
from meshplan.plan.pass_checks import MAX_PER_KIND, passes_checked
from meshplan.plan.schedule import (
    COMPUTE,
    DTYPES,
    KIND,
    OP_KINDS,
    PASS_NAMES,
    RECV,
    SEND,
    TENSOR_KIND_NAMES,
    Schedule,
    chunk_matrices,
    distinct_chunk_sets,
    expand_blocks,
    tensor_bytes,
)

_COMPUTE_KINDS = np.array([KIND[k] for k in ("compute", "merge", "accumulate", "alloc", "free")])


@dataclass
class Report:
    """The verifier's verdict: ``ok`` when ``violations`` is empty."""

    violations: list[str] = field(default_factory=list)
    peak_memory_bytes: float = 0.0
    counts: dict[str, int] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        """True when the schedule passed every check."""
        return not self.violations

    @property
    def over_memory_only(self) -> bool:
        """True when the one kind of violation is the device's memory (a valid schedule for a larger device)."""
        return set(self.counts) == {"memory"}

    def add(self, kind: str, lines: list[str]) -> None:
        """Record violations of one kind (the first few, with a count of the rest)."""
        if lines:
            self.violations.extend(lines[:MAX_PER_KIND])
            if len(lines) > MAX_PER_KIND:
                self.violations.append(f"... and {len(lines) - MAX_PER_KIND} more {kind} violations")
            self.counts[kind] = self.counts.get(kind, 0) + len(lines)


def verify(sched: Schedule, memory_bytes: float | None = None, op_seconds: np.ndarray | None = None,
           transfer_seconds: np.ndarray | None = None, both_cores: bool = False) -> Report:
    """Run every check. ``op_seconds``/``transfer_seconds`` time the evaluation (default: unit times).
    ``both_cores``: a forked process (:func:`meshplan.core.parallel.start_beside`; from :data:`PHASES_FORK_MIN_OPS`
    ops, both passes), started first, matches the transfers and checks the tensors, the contents, the batch order,
    the forward's coverage and the rows, while this one checks the structure — returning at once where it fails, the
    side stopped —, matches the transfers and checks the rest: the same report; for a caller with nothing else
    running (``meshplan validate`` of a 1024-rank file). Forked before the structure check and the matching (0.15 s
    at 1024 ranks, then beside the side's work), though what this process allocates while the fork lives is copied
    on write (~2x the cost of fresh pages): 0.08 s sooner end to end."""
    rep = Report()
    fork = both_cores and len(sched.passes) == 2 and len(sched.ops) >= PHASES_FORK_MIN_OPS and can_fork()
    side = start_beside(lambda: _side_checks(sched), own_group=True) if fork else None
    try:
        rep.add("structure", _structure(sched))
        if rep.violations:
            return rep  # later checks index with these fields
        partner, _, problems = sched.match_transfers()
        return _verify(sched, rep, partner, problems, memory_bytes, op_seconds, transfer_seconds, side)
    finally:
        if side is not None:
            side.stop()                     # where the report was made without its answer: nothing to stop


def _verify(sched: Schedule, rep: Report, partner: np.ndarray, problems: list[str], memory_bytes: float | None,
            op_seconds: np.ndarray | None, transfer_seconds: np.ndarray | None, side: Beside | None) -> Report:
    """:func:`verify` once the structure holds and the transfers are matched (``partner``, ``problems``); the
    tensors, coverage and rows from ``side`` where given (or None: checked here)."""
    n = len(sched.ops)
    dur = np.ones(n) if op_seconds is None else op_seconds
    tr = np.ones(n) if transfer_seconds is None else transfer_seconds
    found = last_cover = None
    if side is not None and not problems:   # checked before the tensors are known to hold: dropped if they do not
        found = _if_it_runs(lambda: passes_checked(sched, partner, dur, tr, memory_bytes))
        last_cover = _if_it_runs(lambda: _coverage(sched, attn_matrix(sched.workload, sched.n_chunks),
                                                   sched.passes[-1]))
    tensors, contents, order, semantics = (side.result() if side is not None else None) or (None,) * 4
    rep.add("tensor", _tensors(sched) if tensors is None else tensors)
    rep.add("transfer", problems)
    if not rep.violations:
        rep.add("contents", check_contents(sched, partner) if contents is None else contents)
    if semantics is not None and last_cover is not None:      # the side's, with the last pass's coverage here
        semantics = semantics[:-1] + [("coverage", last_cover), semantics[-1]]
    for kind, lines in _semantics(sched) if semantics is None or last_cover is None else semantics:
        rep.add(kind, lines)
    rep.add("pass", _passes(sched))
    if rep.violations:
        return rep
    for adds, peak in passes_checked(sched, partner, dur, tr, memory_bytes) if found is None else found:
        for kind, lines in adds:
            rep.add(kind, lines)
        rep.peak_memory_bytes = max(rep.peak_memory_bytes, peak)
    rep.add("batch order", _batch_order(sched, partner) if order is None else order)
    return rep


def _side_checks(sched: Schedule):
    """The forked side of :func:`verify`, started before the structure check: (the tensors' violations, the
    contents', the batch order's, [(kind, violations)] of the coverage of every pass but the last — which the other
    side checks — and of the rows), each None where it fails to run (the structure or the tensors may not hold: it
    runs again there, where its error, if any, is raised). Its transfers matched here too, beside the other side's
    matching."""
    m = attn_matrix(sched.workload, sched.n_chunks)
    partner = _if_it_runs(lambda: sched.match_transfers()[0])
    return (_if_it_runs(lambda: _tensors(sched)), _if_it_runs(lambda: check_contents(sched, partner)),
            _if_it_runs(lambda: _batch_order(sched, partner)),
            _if_it_runs(lambda: [("coverage", _coverage(sched, m, p)) for p in sched.passes[:-1]] +
                        [("rows", _rows(sched, m))]))


def _if_it_runs(check):
    """``check()``, or None where it raises: a check run before the checks it relies on are known to hold."""
    try:
        return check()
    except Exception:           # noqa: BLE001 - run again in turn where those hold: its error raised there
        return None


def _semantics(sched: Schedule) -> list[tuple[str, list[str]]]:
    """[(kind, violations)] of the coverage of each pass and the rows."""
    matrix = attn_matrix(sched.workload, sched.n_chunks)
    return [("coverage", _coverage(sched, matrix, phase)) for phase in sched.passes] + \
        [("rows", _rows(sched, matrix))]


#: :func:`verify` with ``both_cores`` checks the two passes in two processes from this many ops
PHASES_FORK_MIN_OPS = 200_000


def _structure(s: Schedule) -> list[str]:
    o, out = s.ops, []
    n = len(o)
    if len(set(s.streams.communicator[i] for i, k in enumerate(s.streams.kinds) if k == "comm")) != \
            sum(k == "comm" for k in s.streams.kinds):
        out.append("two comm streams share a communicator; give each its own")
    bad_kind = np.flatnonzero((o.kind < 0) | (o.kind >= len(OP_KINDS)))
    out += [f"op {i}: unknown kind" for i in bad_kind]
    stream_kind = np.asarray([k == "comm" for k in s.streams.kinds])[o.stream]
    comm = (o.kind == SEND) | (o.kind == RECV)
    out += [f"op {i}: {OP_KINDS[o.kind[i]]} on compute stream {s.streams.names[o.stream[i]]!r}"
            for i in np.flatnonzero(comm & ~stream_kind)]
    out += [f"op {i}: {OP_KINDS[o.kind[i]]} on comm stream {s.streams.names[o.stream[i]]!r}"
            for i in np.flatnonzero(np.isin(o.kind, _COMPUTE_KINDS) & stream_kind)]
    bad_peer = comm & ((o.peer < 0) | (o.peer >= s.n_ranks) | (o.peer == o.rank))
    out += [f"op {i} on rank {o.rank[i]}: peer {o.peer[i]} is not another rank" for i in np.flatnonzero(bad_peer)]
    owner = np.repeat(np.arange(n), np.diff(o.dep_ptr))
    d = o.deps
    bad = (d < 0) | (d >= n)
    dc = np.clip(d, 0, max(n - 1, 0))
    bad |= (o.rank[dc] != o.rank[owner]) | (dc >= owner) | (o.phase[dc] != o.phase[owner])
    out += [f"op {owner[k]} on rank {o.rank[owner[k]]}: dep {d[k]} is not an earlier op of the same rank and pass"
            for k in np.flatnonzero(bad)]
    return out


def _tensors(s: Schedule) -> list[str]:
    o, t, out = s.ops, s.tensors, []
    nt = len(t)
    refs = [(np.repeat(np.arange(len(o)), np.diff(o.in_ptr)), o.inputs, "input"),
            (np.repeat(np.arange(len(o)), np.diff(o.out_ptr)), o.outputs, "output")]
    comm = np.flatnonzero((o.kind == SEND) | (o.kind == RECV))
    refs.append((comm, o.tensor[comm], "tensor"))
    for owner, tid, what in refs:
        bad = (tid < 0) | (tid >= nt)
        out += [f"op {owner[k]}: {what} {tid[k]} does not exist" for k in np.flatnonzero(bad)]
        ok = ~bad
        wrong = np.flatnonzero(ok & (t.rank[np.clip(tid, 0, max(nt - 1, 0))] != o.rank[owner]))
        out += [f"op {owner[k]} on rank {o.rank[owner[k]]}: {what} {tid[k]} lives on rank {t.rank[tid[k]]}"
                for k in wrong]
    if out:
        return out          # the size checks below index tensors by these references
    tokens = _tensor_tokens(s)
    uniq, inv = _unique_rows(t.kind, tokens, t.h1 - t.h0, t.dtype)
    expect = np.array([tensor_bytes(s.workload, TENSOR_KIND_NAMES[k], m, h, DTYPES[dt]) for k, m, h, dt in uniq],
                      dtype=np.int64)
    bad = np.flatnonzero(expect[inv.ravel()] != t.size_bytes)
    out += [f"tensor {i} ({TENSOR_KIND_NAMES[t.kind[i]]}): {t.size_bytes[i]} bytes, the workload needs "
            f"{expect[inv.ravel()[i]]}" for i in bad]
    wire = o.size_bytes[comm]
    tt = o.tensor[comm]
    moved = tokens[tt]                                  # a packed send moves all its parts' tokens
    packed = np.diff(o.in_ptr)[comm] > 0
    if packed.any():
        part_of = np.repeat(np.arange(len(o)), np.diff(o.in_ptr))
        moved[packed] = np.bincount(part_of, weights=tokens[o.inputs], minlength=len(o))[comm[packed]]
    wu, winv = _unique_rows(t.kind[tt], moved, (t.h1 - t.h0)[tt], o.dtype[comm])
    wexp = np.array([tensor_bytes(s.workload, TENSOR_KIND_NAMES[k], m, h, DTYPES[dt]) for k, m, h, dt in wu],
                    dtype=np.int64)
    bad = np.flatnonzero(wexp[winv.ravel()] != wire) if len(comm) else []
    out += [f"op {comm[k]}: moves {wire[k]} bytes, its tensor is {wexp[winv.ravel()[k]]} bytes on the wire"
            for k in bad]
    return out


def _unique_rows(kind, tokens, heads, dtype) -> tuple[np.ndarray, np.ndarray]:
    """(the distinct (kind, tokens, heads, dtype) rows [k, 4], each input row's index among them): one sort of
    packed int64 keys (kind and dtype < 2^6, heads < 2^12, tokens < 2^39), not ``np.unique(axis=0)``'s."""
    kind, tokens, heads, dtype = (np.asarray(x, dtype=np.int64) for x in (kind, tokens, heads, dtype))
    key = (((kind << 6 | dtype) << 12 | heads) << 39) | tokens
    uniq, inv = np.unique(key, return_inverse=True)
    rows = np.stack([uniq >> 57, uniq & ((1 << 39) - 1), (uniq >> 39) & 4095, (uniq >> 51) & 63], axis=1)
    return rows, inv


def _tensor_tokens(s: Schedule) -> np.ndarray:
    """Tokens each tensor holds: all its chunks' tokens for KV kinds, their query tokens for the rest."""
    from meshplan.model.matrix import KV_KINDS
    t, ch = s.tensors, attn_matrix(s.workload, s.n_chunks).chunks
    owner = np.repeat(np.arange(len(t.rank)), np.diff(t.chunk_ptr))
    n = len(t.rank)
    kv = np.bincount(owner, weights=ch.tokens[t.chunks], minlength=n)
    q = np.bincount(owner, weights=ch.q_tokens[t.chunks], minlength=n)
    is_kv = np.isin(t.kind, [TENSOR_KIND_NAMES.index(k) for k in KV_KINDS])
    return np.where(is_kv, kv, q).astype(np.int64)


def _batch_order(s: Schedule, partner: np.ndarray) -> list[str]:
    """Every matched transfer sits in the same ordinal batch on both peers (among the batches of its rank, pass
    and stream that exchange with the other peer). Batches: consecutive sends/recvs of a stream with one step."""
    o = s.ops
    comm = np.flatnonzero((o.kind == SEND) | (o.kind == RECV))
    if not len(comm):
        return []
    where = (o.rank[comm].astype(np.int64) * 2 + o.phase[comm]) * len(s.streams.names) + o.stream[comm]
    order = np.lexsort((comm, where))
    ops, key, step = comm[order], where[order], o.step[comm[order]]
    new_unit = np.r_[True, (key[1:] != key[:-1]) | (step[1:] != step[:-1]) | (step[1:] < 0)]
    unit = np.empty(len(o), dtype=np.int64)
    unit[ops] = np.cumsum(new_unit)
    peer_key = where * s.n_ranks + o.peer[comm]
    order = np.lexsort((comm, peer_key))
    ops, pk = comm[order], peer_key[order]
    first = np.r_[True, pk[1:] != pk[:-1]]
    new = first | np.r_[True, unit[ops][1:] != unit[ops][:-1]]
    count = np.cumsum(new)
    ordinal = np.empty(len(o), dtype=np.int64)
    ordinal[ops] = count - np.maximum.accumulate(np.where(first, count, 0))     # 0, 1, ... per (rank, stream, peer)
    sends = comm[(o.kind[comm] == SEND) & (partner[comm] >= 0)]
    bad = sends[ordinal[sends] != ordinal[partner[sends]]]
    return [f"{PASS_NAMES[o.phase[a]]}: op {a} is in rank {o.rank[a]}'s batch #{ordinal[a] + 1} with rank {o.peer[a]} "
            f"on stream {s.streams.names[o.stream[a]]!r}, its match op {partner[a]} in rank {o.peer[a]}'s batch "
            f"#{ordinal[partner[a]] + 1}: NCCL needs both peers to issue their batches in one order" for a in bad]


def _coverage(s: Schedule, m: AttnMatrix, phase: int, runs: bool = False) -> list[str]:
    """Every permitted block exactly once per head; no single-block op on a block without a permitted pair.

    Where every op computes every head (no Ulysses split), its ops are its runs of heads (``runs`` False): two ops
    over one chunk set then compute its blocks twice, which the block check finds — and where it finds anything,
    the check runs again with the runs merged (:func:`_head_runs`), whose lines name such ops."""
    o, H, N = s.ops, s.workload.n_heads, s.n_chunks
    ops = np.flatnonzero((o.kind == COMPUTE) & (o.phase == phase))
    name = ("fwd", "bwd")[phase]
    if runs or not ((o.h0[ops] == 0) & (o.h1[ops] == H)).all():
        out, seg_op, seg_h0, seg_h1 = _head_runs(o, ops, name)
    else:                                   # every op all heads: each its own run
        out, seg_op, seg_h0, seg_h1 = [], ops, np.zeros(len(ops), np.int64), np.full(len(ops), H, np.int64)
    op_of, qi, ki = expand_blocks(o, seg_op)
    run = np.repeat(np.arange(len(seg_op)), np.diff(o.qc_ptr)[seg_op] * np.diff(o.kvc_ptr)[seg_op])
    h0, h1 = seg_h0[run], seg_h1[run]
    empty = ~m.permitted[qi, ki]
    single = (np.diff(o.qc_ptr)[op_of] == 1) & (np.diff(o.kvc_ptr)[op_of] == 1)
    out += [f"{name}: op {op_of[k]} computes block ({qi[k]}, {ki[k]}), which has no permitted pair"
            for k in np.flatnonzero(empty & single)]
    # a cartesian op may span empty blocks (its kernel's mask skips them, as one causal flash call over a
    # whole sequence does); they are not work and are not counted
    keep = ~empty
    op_of, qi, ki = op_of[keep], qi[keep], ki[keep]
    h0, h1 = h0[keep], h1[keep]
    block = qi * N + ki
    order = _stable_order(block * (H + 1) + h0)                              # by block, then first head
    b, a0, a1, ow = block[order], h0[order], h1[order], op_of[order]
    first = np.r_[True, b[1:] != b[:-1]] if len(b) else np.zeros(0, dtype=bool)
    last = np.r_[b[1:] != b[:-1], True] if len(b) else np.zeros(0, dtype=bool)
    prev_h1 = np.r_[0, a1[:-1]]
    gap = np.where(first, a0 != 0, a0 != prev_h1)
    what = lambda k: "overlap" if a0[k] < prev_h1[k] and not first[k] else "gap"  # noqa: E731
    out += [f"{name}: block ({b[k] // N}, {b[k] % N}) heads {what(k)} at head {a0[k]} (op {ow[k]}): computed twice "
            f"or missing" for k in np.flatnonzero(gap)]
    out += [f"{name}: block ({b[k] // N}, {b[k] % N}) covers heads up to {a1[k]} of {H} (op {ow[k]})"
            for k in np.flatnonzero(last & (a1 != H))]
    covered = np.zeros(N * N, dtype=bool)
    covered[block] = True
    missing = np.flatnonzero(m.permitted.ravel() & ~covered)
    out += [f"{name}: block ({i // N}, {i % N}) is never computed" for i in missing]
    return _coverage(s, m, phase, runs=True) if out and seg_op is ops else out


def _stable_order(key: np.ndarray) -> np.ndarray:
    """``np.argsort(key, kind="stable")`` of int ``key``: each key packed with its index into one int64, key · n +
    index, whose values are sorted (distinct values: any sort; 2x faster than a stable argsort of a million) and the
    indices read back (floor remainder, right for negative keys too); the argsort where the packed keys could
    overflow."""
    n = len(key)
    if n == 0 or (int(np.abs(key).max()) + 1) * n >= 2**62:
        return np.argsort(key, kind="stable")
    packed = key.astype(np.int64) * n + np.arange(n)
    packed.sort()
    return packed % n


def _head_runs(o, ops: np.ndarray, name: str) -> tuple[list[str], np.ndarray, np.ndarray, np.ndarray]:
    """Ops over the same chunk sets merged by heads, so the block check sees each set once per run of heads (a
    Ulysses group's u ops over one set become one run): (overlaps found among them, each run's first op, its
    first head, its end head). Adjacent head ranges join; an overlap is a violation; a gap starts a new run (the
    block check then finds it)."""
    _, group = distinct_chunk_sets(o, ops)
    order = np.lexsort((o.h0[ops], group))
    g, op_sorted = group[order], ops[order]
    a0, a1 = o.h0[op_sorted].astype(np.int64), o.h1[op_sorted].astype(np.int64)
    first = np.r_[True, g[1:] != g[:-1]] if len(g) else np.zeros(0, dtype=bool)
    prev_end = np.r_[0, a1[:-1]]
    overlap = ~first & (a0 < prev_end)
    out = [f"{name}: op {op_sorted[k]} computes heads from {a0[k]} that op {op_sorted[k - 1]} computes over the same "
           f"chunks (computed twice)" for k in np.flatnonzero(overlap)]
    seg_first = np.flatnonzero(first | (a0 != prev_end))                  # runs are contiguous in this order
    seg_h1 = np.maximum.reduceat(a1, seg_first) if len(seg_first) else np.zeros(0, dtype=np.int64)
    return out, op_sorted[seg_first], a0[seg_first], seg_h1


def _rows(s: Schedule, m: AttnMatrix) -> list[str]:
    """Every compute op's row and key counts (``s_q``, ``s_kv``: its q_rows and kv_cols) are its blocks' real
    tokens that take part (:meth:`AttnMatrix.op_rows_cols`), so padding is never computed as a query or a key."""
    o, out = s.ops, []
    ops = np.flatnonzero(o.kind == COMPUTE)
    for run, qi, kj in chunk_matrices(o, ops):
        sel = ops[run]
        rows, cols = m.op_rows_cols(qi, kj)
        bad = np.flatnonzero((o.s_q[sel] != rows) | (o.s_kv[sel] != cols))
        out += [f"{PASS_NAMES[o.phase[sel[k]]]}: op {sel[k]} takes {o.s_q[sel[k]]} query rows and {o.s_kv[sel[k]]} "
                f"keys, its blocks have {rows[k]} and {cols[k]} real tokens that take part (padding computed, or "
                "tokens left out)" for k in bad]
    return out


def _passes(s: Schedule) -> list[str]:
    want = {"fwd": [0], "bwd": [1], "fwd+bwd": [0, 1]}[s.workload.passes]
    if s.passes != want:
        have = "+".join(("fwd", "bwd")[p] for p in s.passes) or "nothing"
        return [f"the workload asks for {s.workload.passes} but the schedule holds {have}"]
    return []
