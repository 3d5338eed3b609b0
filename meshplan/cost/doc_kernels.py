"""Compute ops under a document mask, priced as the kernels run them: per document segment, in tiles.

docs/cost-model.md, "Documents". A compute op over packed documents runs one kernel segment per (query piece,
key piece) of one document (:mod:`meshplan.model.doc_segments`), and the kernel table's ``segments`` says how:

* ``varlen`` (FlashAttention's varlen path on GPUs): one launch per kind of segment (causal, full) for the op; each
  segment computes every tq × tk tile it touches (:func:`~meshplan.model.doc_segments.tile_count`, the table's
  ``tile_fwd`` / ``tile_bwd``), a partial tile at a full tile's cost, at the efficiency of the op's kernel shape
  (the tiles of all segments fill the device together), plus ``segment_us`` per segment:
  ``t = launches · t_launch + segments · t_segment + 4·B·h·D·Σ tiles·tq·tk / (peak · e(op shape))`` (×2.5 bwd);
* ``per_call`` (torch's CPU flash kernel, what the CPU executor runs): every kernel of the segment cover is its own
  call at its own shape, ``t = Σ (t_launch + t_segment + FLOPs / (peak · e(rows, keys)))``, plus the LSE merge of
  the partial results where two kernels share rows; and, as the executor does
  (:func:`~meshplan.model.blockmask.kernel_cover`), the dense masked kernel instead where the cover's work plus
  :data:`~meshplan.model.blockmask.PIECE_OVERHEAD_PAIRS` per kernel exceeds the dense block's.

An op over one block is priced from its block's segments (closed forms over all documents at once); an op over
several chunks from the cover of its tokens in position order, as the executor builds it (one per distinct
pair of chunk sets). A sliding window on per-call kernels is priced the same way, from each block's cover (its
strips of W rows, :func:`~meshplan.model.blockmask.pieces`): :func:`priced_by_cover` says which workloads come
here; the others (full, causal, windows on GPUs, where FlashAttention's window skips tiles) never do, and their
prices do not move.
"""

from __future__ import annotations

import numpy as np

from meshplan.model.blockmask import (
    MAX_PIECES,
    PIECE_OVERHEAD_PAIRS,
    KeyRanges,
    block_pieces,
    by_block_budget,
    chunk_switches,
    kernel_cover,
    pieces,
    prefer_by_block,
    rectangles,
    rows_overlap,
    worth_blocks,
)
from meshplan.model.doc_segments import Segments, block_segments, block_tiles, tile_count, tiles_at
from meshplan.model.matrix import BWD_FLOP_FACTOR, attn_matrix
from meshplan.plan.schedule import Schedule

MAX_COVERS = 64       # distinct chunk sets whose covers are built; beyond, ops are priced from their blocks


def _chunk_tokens(m, chunk: int, query: bool) -> np.ndarray:
    """Chunk ``chunk``'s query (or real key) positions, ascending, built from its segments at once; cached."""
    cache = m.__dict__.setdefault("_chunk_token_cache", {})
    if (chunk, query) not in cache:
        ch, w = m.chunks, m.workload
        count = ch.count[chunk]
        at = np.arange(count.sum()) - np.repeat(np.cumsum(count) - count, count)
        pos = np.repeat(ch.start[chunk], count) + at * np.repeat(ch.stride[chunk], count)
        cache[(chunk, query)] = np.sort(pos[w.is_query(pos) if query else w.is_real(pos)])
    return cache[(chunk, query)]


def priced_by_cover(w, kernel_spec) -> bool:
    """Whether workload ``w``'s compute ops are priced from the kernels of their covers here: packed documents on
    every kernel table, a sliding window on per-call tables (the CPU executor runs its strips as kernels)."""
    return w.mask.kind == "docs" or (w.mask.kind == "window" and kernel_spec.segments == "per_call")


def many_covers(sched: Schedule, ops: np.ndarray) -> bool:
    """Whether ``ops`` span more than :data:`MAX_COVERS` distinct (query chunks, KV chunks) sets (each set's cover
    is built once, O(tokens) numpy and O(segments) Python). A prefix of the ops usually settles it."""
    from meshplan.plan.schedule import distinct_chunk_sets

    if len(ops) <= MAX_COVERS:
        return False
    return any(len(distinct_chunk_sets(sched.ops, part)[0]) > MAX_COVERS for part in (ops[:4 * MAX_COVERS], ops))


class DocKernels:
    """Kernel times of compute ops over the blocks of matrix ``m`` under its ``docs`` mask, on cost model ``cm``."""

    def __init__(self, cm, m) -> None:
        self.cm, self.kernel, self.m = cm, cm.kernel, m
        self.w = m.workload
        self.per_call = self.kernel.spec.segments == "per_call"
        self.segment_s = self.kernel.spec.segment_us * 1e-6
        self.peak = cm.topo.peak_flops(self.w.dtype)

    def pair_flops(self, pass_: str) -> float:
        """FLOPs of one (query, key) pair over every query head."""
        f = 4.0 * self.w.batch * self.w.n_heads * self.w.head_dim
        return f * BWD_FLOP_FACTOR if pass_ == "bwd" else f

    # ---------------------------------------------------------------------------- one block per op
    def block_parts(self, pass_: str) -> tuple[np.ndarray, np.ndarray]:
        """([n·n] seconds that do not scale with heads, [n·n] seconds at all query heads) per block, cached on
        the matrix per topology and pass."""
        key = (self.cm.topo.content_hash, pass_)
        cache = self.m.__dict__.setdefault("_doc_block_cache", {})
        if key not in cache:
            cache[key] = self._blocks(pass_)
        return cache[key]

    def _blocks(self, pass_: str) -> tuple[np.ndarray, np.ndarray]:
        if not self.per_call:
            return self._varlen_blocks(pass_)
        if self.w.mask.kind != "docs":
            return self._cover_blocks(pass_)
        n = self.m.n
        fixed, scaled = np.zeros(n * n), np.zeros(n * n)
        kernels, proxy, stair, rect = (np.zeros(n * n, dtype=np.int64) for _ in range(4))
        for seg in block_segments(self.m):
            f, s = self._segment_times(seg, pass_, self.m.s_q.ravel()[seg.block], self.m.s_kv.ravel()[seg.block])
            np.add.at(fixed, seg.block, f)
            np.add.at(scaled, seg.block, s)
            k = seg.kernels
            np.add.at(kernels, seg.block, k)
            np.add.at(proxy, seg.block, seg.pairs + PIECE_OVERHEAD_PAIRS * k)
            np.add.at(stair, seg.block, ~seg.rect)
            np.add.at(rect, seg.block, seg.rect)
        if pass_ == "fwd":              # kernels sharing rows (a staircase's rectangle and square) merge by LSE
            scaled += self._merge_s(self.m.s_q.ravel()) * (kernels > np.maximum(rect + stair, 1))
        dense = (kernels > MAX_PIECES) & (proxy > (self.m.s_q * self.m.s_kv).ravel())
        if dense.any():                 # the executor runs the dense masked kernel there: today's price
            m = self.m
            t = self.cm.block_time_s(m.flops(pass_), m.s_q, m.s_kv, m.elementwise, pass_, self.w.dtype,
                                     self.w.head_dim).ravel()
            fixed[dense], scaled[dense] = self.kernel.launch_s, np.maximum(t[dense] - self.kernel.launch_s, 0)
        return fixed, scaled

    def _cover_blocks(self, pass_: str) -> tuple[np.ndarray, np.ndarray]:
        """Per-call kernels per block from each block's own cover (a sliding window: its strips), blocks with the
        same query and key offsets priced once."""
        m, n = self.m, self.m.n
        fixed, scaled = np.zeros(n * n), np.zeros(n * n)
        seen: dict[tuple, tuple[float, float]] = {}
        for b in np.flatnonzero(m.pairs.ravel() > 0):
            i, j = divmod(int(b), n)
            q, k = _chunk_tokens(m, i, True), _chunk_tokens(m, j, False)
            shape = ((q - k[0]).tobytes(), (k - k[0]).tobytes())
            if shape not in seen:      # a window depends on the offsets q - k only: the block's geometry
                seen[shape] = self._op((i,), (j,), int(m.s_q[i, j]), int(m.s_kv[i, j]), pass_)
            fixed[b], scaled[b] = seen[shape]
        return fixed, scaled

    def _varlen_blocks(self, pass_: str) -> tuple[np.ndarray, np.ndarray]:
        """Varlen kernels per block from the tile sums (:func:`~meshplan.model.doc_segments.block_tiles`): full
        segments at the block shape's unmasked efficiency, staircases at its masked one."""
        w, m = self.w, self.m
        bt = block_tiles(m, *self.kernel.tile(pass_))
        e_full, e_masked = (self.kernel.efficiency(m.s_q, m.s_kv, pass_, masked, w.head_dim, dtype=w.dtype)
                            for masked in (False, True))
        scaled = self.pair_flops(pass_) / self.peak * (bt.rect_work / e_full + bt.stair_work / e_masked)
        fixed = self.segment_s * (bt.rect + bt.stair) + self.kernel.launch_s * ((bt.rect > 0) + (bt.stair > 0))
        return fixed.ravel(), scaled.ravel()

    def varlen_ops(self, sched: Schedule, ops: np.ndarray, pass_: str) -> np.ndarray:
        """Seconds of varlen ops over several chunks: one call over the segments of all their blocks (each block's
        segments kept apart: an upper bound on the tiles of the executor's cover, which may join a document's
        pieces from adjacent chunks), every tile at the efficiency of the op's shape."""
        from meshplan.plan.schedule import distinct_chunk_sets, expand_blocks

        o, w = sched.ops, self.w
        reps, again = distinct_chunk_sets(o, ops)           # ops alike but for heads or rank: summed once
        op_of, qi, kj = expand_blocks(o, reps)
        bt = tiles_at(self.m, *self.kernel.tile(pass_), qi, kj)
        rect_work, stair_work, rect, stair = (np.bincount(op_of, weights=arr, minlength=len(o))[reps][again]
                                              for arr in (bt.rect_work, bt.stair_work, bt.rect, bt.stair))
        e_full, e_masked = (self.kernel.efficiency(o.s_q[ops], o.s_kv[ops], pass_, masked, w.head_dim, dtype=w.dtype)
                            for masked in (False, True))
        heads = (o.h1 - o.h0)[ops] / w.n_heads
        scaled = self.pair_flops(pass_) / self.peak * (rect_work / e_full + stair_work / e_masked) * heads
        return scaled + self.segment_s * (rect + stair) + self.kernel.launch_s * ((rect > 0) + (stair > 0))

    def _segment_times(self, seg: Segments, pass_: str, op_q, op_kv) -> tuple[np.ndarray, np.ndarray]:
        """Per segment: (seconds independent of heads, seconds at all heads). ``op_q``/``op_kv``: the shape of the
        kernel call each segment belongs to (varlen: its efficiency)."""
        w = self.w
        if self.per_call:
            work = seg.pairs
            rect = seg.rect
            e = self.kernel.efficiency(seg.nq, seg.nk, pass_, ~rect, w.head_dim, dtype=w.dtype)
            # a staircase with a rectangle part runs as two kernels: both launches
            return (self.kernel.launch_s + self.segment_s) * seg.kernels, work * self.pair_flops(pass_) / \
                (self.peak * e)
        tq, tk = self.kernel.tile(pass_)
        work = tile_count(seg.nq, seg.nk, seg.c, tq, tk) * (tq * tk)
        e = self.kernel.efficiency(op_q, op_kv, pass_, ~seg.rect, w.head_dim, dtype=w.dtype)
        return np.full(len(work), self.segment_s), work * self.pair_flops(pass_) / (self.peak * e)

    def _merge_s(self, rows) -> np.ndarray:
        """A partial result's LSE merge into the op's accumulator: 3 x (O fp32 + LSE) of its rows, all heads."""
        w = self.w
        return 3.0 * w.batch * w.n_heads * np.asarray(rows) * (4 * w.head_dim + 4) / self.cm.merge_rate

    # ---------------------------------------------------------------------------- ops over several chunks
    def op_parts(self, q_chunks: tuple[int, ...], kv_chunks: tuple[int, ...], op_q: int, op_kv: int,
                 pass_: str) -> tuple[float, float]:
        """(fixed seconds, seconds at all heads) of an op over several chunks, from the executor's cover."""
        key = (self.cm.topo.content_hash, pass_, q_chunks, kv_chunks)
        cache = self.m.__dict__.setdefault("_doc_op_cache", {})
        if key not in cache:
            cache[key] = self._op(q_chunks, kv_chunks, op_q, op_kv, pass_)
        return cache[key]

    def _op(self, q_chunks, kv_chunks, op_q, op_kv, pass_) -> tuple[float, float]:
        plan = op_cover(self.m, q_chunks, kv_chunks, unlimited=not self.per_call)
        if plan is None:                # the dense masked kernel over the op (per-call kernels only)
            t = float(self.cm.block_time_s(self.m.pairs[np.ix_(q_chunks, kv_chunks)].sum() * self.pair_flops(pass_),
                                           op_q, op_kv, True, pass_, self.w.dtype, self.w.head_dim))
            return self.kernel.launch_s, max(t - self.kernel.launch_s, 0.0)
        if not plan:
            return 0.0, 0.0
        arr = np.array([(p.r1 - p.r0, p.c1 - p.c0, p.causal) for p in plan], dtype=np.int64)
        rows, cols, causal = arr[:, 0], arr[:, 1], arr[:, 2].astype(bool)
        seg = Segments(np.zeros(len(arr), dtype=np.int64), rows, cols, np.where(causal, 0, cols))
        fixed, scaled = self._segment_times(seg, pass_, np.full(len(arr), op_q), np.full(len(arr), op_kv))
        f, s = float(fixed.sum()), float(scaled.sum())
        if self.per_call:
            if pass_ == "fwd" and rows_overlap(plan):
                s += float(self._merge_s(rows).sum())
        else:
            f += self.kernel.launch_s * (int(causal.any()) + int((~causal).any()))
        return f, s


def op_cover(m, q_chunks, kv_chunks, unlimited: bool = False):
    """The kernels the executor runs for an op over ``q_chunks`` × ``kv_chunks`` of matrix ``m``: its tokens in
    position order covered by :func:`~meshplan.model.blockmask.kernel_cover`, else (interleaved chunks) block by
    block; None where it runs one dense masked kernel. ``unlimited``: a block takes any number of kernels (the
    CUDA varlen path, which never runs a dense mask). Cached on the matrix."""
    cache = m.__dict__.setdefault("_op_cover_cache", {})
    key = (tuple(q_chunks), tuple(kv_chunks), unlimited)
    if key not in cache:
        cache[key] = _op_cover(m, q_chunks, kv_chunks, unlimited)
    return cache[key]


def _op_cover(m, q_chunks, kv_chunks, unlimited: bool):
    """:func:`op_cover` uncached: the executor's choice (``OpRunner.compute``) between its tokens in position order
    and block by block (:func:`~meshplan.model.blockmask.prefer_by_block`, on the CPU covers), then that order's
    cover — on the CUDA path with no limit on its kernels (:func:`meshplan.executor.cuda_kernels.cuda_cover`)."""
    w = m.workload
    qs = [_chunk_tokens(m, c, True) for c in q_chunks]
    ks = [_chunk_tokens(m, c, False) for c in kv_chunks]
    q, k = np.sort(np.concatenate(qs)), np.sort(np.concatenate(ks))
    ranges = KeyRanges(*w.mask.key_ranges(q, k), len(k))
    in_order = kernel_cover(ranges)
    if in_order is not None and w.mask.kind == "docs" and len(q_chunks) * len(kv_chunks) > 1 \
            and _segment_counts(m)[np.ix_(q_chunks, kv_chunks)].sum() >= len(in_order):
        return in_order             # by block takes a kernel per document segment at least: never fewer
    by_block = None
    owners = [np.repeat(np.arange(len(xs)), [len(x) for x in xs])[np.argsort(np.concatenate(xs), kind="stable")]
              for xs in (qs, ks)]
    if worth_blocks(in_order, len(q_chunks) * len(kv_chunks), chunk_switches(*owners)):
        by_block = block_pieces(rectangles(w.mask, qs, ks), by_block_budget(in_order))
    blocks = prefer_by_block(in_order, by_block)
    if not unlimited:
        return by_block if blocks else in_order
    if blocks:                      # every rectangle had a cover: the same pieces an unlimited cover takes
        return by_block
    return in_order if in_order is not None else pieces(ranges, budget=1 << 62)


def _segment_counts(m) -> np.ndarray:
    """[n, n] document segments with permitted pairs per block (each a kernel at least, whatever the cover);
    cached on the matrix."""
    cache = m.__dict__
    if "_segment_count_cache" not in cache:
        counts = sum((np.bincount(seg.block, minlength=m.n * m.n) for seg in block_segments(m)),
                     np.zeros(m.n * m.n, dtype=np.int64))
        cache["_segment_count_cache"] = counts.reshape(m.n, m.n)
    return cache["_segment_count_cache"]


def document_stats(sched: Schedule, topo) -> dict:
    """What the documents cost a schedule's forward: ``count`` documents, ``segments`` the most kernel segments one
    rank runs, ``tile_waste`` the tiles its kernels compute (at the topology's forward tile, each segment rounded
    up) over the permitted pairs (1 = no waste; the heads of each op weigh alike)."""
    from meshplan.plan.schedule import COMPUTE

    w, o = sched.workload, sched.ops
    m = attn_matrix(w, sched.n_chunks)
    tq, tk = topo.kernel.tile("fwd")
    n = sched.n_chunks
    bt = block_tiles(m, tq, tk)
    work, segs = (bt.rect_work + bt.stair_work).ravel(), (bt.rect + bt.stair).ravel()
    heads = (o.h1 - o.h0) / w.n_heads
    fwd = (o.kind == COMPUTE) & (o.phase == 0)
    blocks = np.diff(o.qc_ptr) * np.diff(o.kvc_ptr)
    one = np.flatnonzero(fwd & (blocks == 1))
    b = o.q_chunks[o.qc_ptr[one]] * n + o.kv_chunks[o.kvc_ptr[one]]
    computed = float((work[b] * heads[one]).sum())
    pairs = float((m.pairs.ravel()[b] * heads[one]).sum())
    per_rank = np.bincount(o.rank[one], weights=segs[b], minlength=sched.n_ranks).astype(np.float64)
    multi = np.flatnonzero(fwd & (blocks > 1))
    if topo.kernel.spec.segments != "per_call" and many_covers(sched, multi):
        from meshplan.plan.schedule import expand_blocks

        op_of, qi, kj = expand_blocks(o, multi)
        b = qi * n + kj
        computed += float((work[b] * heads[op_of]).sum())
        pairs += float((m.pairs.ravel()[b] * heads[op_of]).sum())
        per_rank += np.bincount(o.rank[op_of], weights=segs[b], minlength=sched.n_ranks)
        multi = multi[:0]
    for op in multi:
        qc = tuple(int(x) for x in o.q_chunks[o.qc_ptr[op]:o.qc_ptr[op + 1]])
        kc = tuple(int(x) for x in o.kv_chunks[o.kvc_ptr[op]:o.kvc_ptr[op + 1]])
        plan = op_cover(m, qc, kc, unlimited=topo.kernel.spec.segments != "per_call") or []
        arr = np.array([(p.r1 - p.r0, p.c1 - p.c0, p.causal) for p in plan], dtype=np.int64).reshape(-1, 3)
        computed += float((tile_count(arr[:, 0], arr[:, 1], np.where(arr[:, 2] > 0, 0, arr[:, 1]), tq, tk)
                           * tq * tk).sum()) * heads[op]
        pairs += float(m.pairs[np.ix_(qc, kc)].sum()) * heads[op]
        per_rank[o.rank[op]] += len(plan)
    return {"count": len(w.mask.doc_lens), "segments": int(per_rank.max(initial=0)),
            "tile_waste": computed / pairs if pairs else None}
