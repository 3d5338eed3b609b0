"""Closed-form costs (docs/cost-model.md level L0): compute, merges and uncontended alpha-beta transfers.

All times in seconds, sizes in bytes, rates in bytes/s.

* Attention block: ``t = t_launch + FLOPs / (peak(dtype) · e(s_q, s_kv, pass, mask))`` with ``e`` from
  the device's kernel table (:mod:`meshplan.model.kernel_tables`, by kernel shape and head dim D); FLOPs = 4·B·h·pairs·D
  forward, 2.5x backward.
  An op over several blocks runs as one kernel of the op's shape (the rows and columns of its chunks that
  take part: Ulysses runs the whole sequence, USP u·c × u·c, CHARM+ 2c × c, TASP c × c from N − 1
  sub-chunks): one launch, every block's FLOPs at the efficiency of its shape grown by √(a·b) for an op
  over a × b chunks, the elementwise factor on the blocks that need a mask (docs/cost-model.md: ``e`` is keyed
  by the kernel's shape, not by FLOPs). Except where the op's tokens interleave so that its mask has no
  short cover by kernels (a striped op over chunks that are not alternate residues,
  :func:`meshplan.model.blockmask.runs_by_block`): the executor runs such an op block by block, so it is priced
  as its blocks, each at its own shape with its own launch.
* Combining a result into an accumulator (LSE merge or gradient add) is memory bound:
  ``t = t_launch + bytes_touched / (f · HBM bandwidth)`` with f = the table's ``merge_hbm_fraction``
  (0.8, docs/cost-model.md). A compute op with ``combine`` merge/accumulate pays it for each output:
  3 x the output's bytes (read accumulator, read partial, write accumulator).
* The CPU executor's staging (kernel tables with ``stage_inputs``, those ``meshplan calibrate`` writes): each compute op
  first copies its inputs into kernel layout, ``2 · input bytes`` (GQA: K and V expanded too) at the merge rate
  (:meth:`CostModel._staging_s`).
* Transfer alone on its route: ``T(S) = alpha_sw + Σ hop latency + S / min(link capacity, per-flow cap)``.

The simulator (L1) adds contention and overlap; these formulas are also what lower bounds are made of.
"""

from __future__ import annotations

import numpy as np

from meshplan.core.arrays import unique_rows
from meshplan.core.csr import csr_sum
from meshplan.core.units import DTYPE_BYTES
from meshplan.cost.doc_kernels import DocKernels, many_covers, priced_by_cover
from meshplan.model.matrix import attn_matrix
from meshplan.model.topology import Topology
from meshplan.plan.schedule import (
    COMBINES,
    COMPUTE,
    KIND,
    PASS_NAMES,
    TENSOR_KIND_NAMES,
    Schedule,
    distinct_chunk_sets,
    expand_blocks,
)


def _runs_by_block(sched: Schedule, m, ops: np.ndarray) -> np.ndarray:
    """[len(ops)] whether the executor runs each multi-block compute op block by block (only striped layouts
    interleave chunks; one check per distinct pair of chunk sets, :func:`meshplan.model.blockmask.runs_by_block`).
    Causal masks only: a window inside a striped block has no short cover in either order (the executor's dense
    fallback), and a document boundary makes the executor run kernels per document segment, which the model does
    not price yet (it prices the op as one kernel)."""
    w, o = sched.workload, sched.ops
    out = np.zeros(len(ops), dtype=bool)
    if w.layout != "striped" or w.mask.kind != "causal":    # windows and documents cut blocks: dense anyway
        return out
    from meshplan.model.blockmask import PERIODS, runs_by_block, striped_runs_by_block

    ch, n, seen = m.chunks, sched.n_chunks, {}
    # one strided segment per chunk, of stride N and >= PERIODS tokens: chunk i is residue start[i] (closed form)
    plain = (ch.count.shape[1] == 1) and bool((ch.stride == n).all() and (ch.count >= PERIODS).all()
                                               and ch.holds_q.all())

    def segments(chunks, query: bool):
        counts = ch.count * ch.holds_q[None, :] if query else ch.count
        return [(int(a), int(b), int(c)) for i in chunks for a, b, c in zip(ch.start[i], ch.stride[i], counts[i])]

    if plain:    # by the chunks' residues up to a common shift: ops of one shape at once (0.3M ops at 1024 ranks)
        residue = ch.start[:, 0].astype(np.int64)
        n_q, n_kv = np.diff(o.qc_ptr)[ops], np.diff(o.kvc_ptr)[ops]
        for a, b in sorted(set(zip(n_q.tolist(), n_kv.tolist()))):
            sel = np.flatnonzero((n_q == a) & (n_kv == b))
            g = ops[sel]
            rq = residue[o.q_chunks[o.qc_ptr[g][:, None] + np.arange(a)]]             # [ops, a]
            rk = residue[o.kv_chunks[o.kvc_ptr[g][:, None] + np.arange(b)]]           # [ops, b]
            lo = rq.min(axis=1, keepdims=True)
            first, inv = unique_rows(np.hstack([np.sort((rq - lo) % n, axis=1), np.sort((rk - lo) % n, axis=1)]))
            runs = np.array([striped_runs_by_block(tuple(k[:a]), tuple(k[a:])) for k in first.tolist()], dtype=bool)
            out[sel] = runs[inv]
        return out
    for k, op in enumerate(ops):
        qc, kc = o.q_chunks[o.qc_ptr[op]:o.qc_ptr[op + 1]], o.kv_chunks[o.kvc_ptr[op]:o.kvc_ptr[op + 1]]
        key = (tuple(qc), tuple(kc))
        if key not in seen:
            seen[key] = runs_by_block(w.mask, segments(qc, True), segments(kc, False))
        out[k] = seen[key]
    return out


#: block times at other kernel growths kept per matrix (N² floats each: 8 MB at 1024 ranks; Mesh's tiles ask for
#: ~150 of them, a few at a time)
GROWN_KEPT = 4


class CostModel:
    """Op durations on one topology for one workload dtype."""

    def __init__(self, topo: Topology) -> None:
        self.topo = topo
        self.kernel = topo.kernel
        self.merge_rate = self.kernel.spec.merge_hbm_fraction * topo.hbm_bytes_per_s

    def block_time_s(self, flops, s_q, s_kv, elementwise, pass_: str, dtype: str,
                     head_dim: int | None = None) -> np.ndarray:
        """Kernel time of attention ops (vectorised): launch + FLOPs / (peak · efficiency). Zero FLOPs -> 0."""
        flops = np.asarray(flops, dtype=np.float64)
        eff = self.kernel.efficiency(s_q, s_kv, pass_, elementwise, head_dim, dtype=dtype)
        t = self.kernel.launch_s + flops / (self.topo.peak_flops(dtype) * eff)
        return np.where(flops > 0, t, 0.0)

    def matrix_block_times(self, m, pass_: str, kernel_chunks: tuple[int, int] = (1, 1),
                           envelope: bool = False) -> np.ndarray:
        """[N, N] kernel time of every block of a matrix (all query heads), cached on the matrix.

        ``kernel_chunks`` (a, b): the block runs inside an op of up to a × b chunks, so its efficiency is
        taken at its shape grown by √(a·b) (as :meth:`op_durations` does) — the largest it can have; with
        ``envelope`` at the kernel table's monotone envelope there (the best of that shape and every smaller
        one), which keeps closed forms lower bounds whatever op the block runs in. Under a ``docs`` mask a block
        alone is priced as its document segments (:mod:`meshplan.cost.doc_kernels`; a window on per-call kernels as
        its strips), and the envelope of per-call kernel tables is the table's best efficiency anywhere (a segment
        runs at its own, smaller shape)."""
        key = (self.topo.content_hash, pass_, kernel_chunks, envelope)
        cache = m.__dict__.setdefault("_block_time_cache", {})
        if key in cache:
            cache[key] = cache.pop(key)                 # most recently used last
        docs = priced_by_cover(m.workload, self.kernel.spec)
        if key not in cache and docs and not envelope and kernel_chunks == (1, 1):
            fixed, scaled = DocKernels(self, m).block_parts(pass_)
            cache[key] = np.where(m.pairs > 0, (fixed + scaled).reshape(m.pairs.shape), 0.0)
        if key not in cache:
            # a block matrix holds a handful of kernel shapes: interpolate those, then gather (N² lookups at
            # 1024 ranks cost 0.2 s each; this, 20 ms). The shapes' codes and the FLOPs are kept on the matrix
            # (Mesh's tiles ask for tens of (a, b) growths of one matrix)
            code = shape_classes(m)[2]
            flops, launch = _flops_and_launch(m, pass_, self.kernel.launch_s)
            cache[key] = launch + flops / (self.topo.peak_flops(m.workload.dtype)
                                           * self.class_efficiency(m, pass_, kernel_chunks, envelope))[code]
            grown = [k for k in cache if k[2] != (1, 1)]
            for old in grown[:max(len(grown) - GROWN_KEPT, 0)]:     # least recently used first
                del cache[old]
        return cache[key]

    def class_efficiency(self, m, pass_: str, kernel_chunks: tuple[int, int] = (1, 1),
                         envelope: bool = False) -> np.ndarray:
        """[K] the kernel efficiency of each block class of a matrix (:func:`shape_classes`: its participating rows
        and columns, masked or not), at the shape grown by √(a·b) for ``kernel_chunks`` (a, b), with ``envelope`` at
        the table's monotone envelope — what :meth:`matrix_block_times` gathers per block. Not for a ``docs`` mask
        priced by its segments without the envelope (those blocks are priced one by one)."""
        grow = np.sqrt(kernel_chunks[0] * kernel_chunks[1])
        vq, vk, _ = shape_classes(m)
        grid = self.kernel.efficiency(vq[:, None, None] * grow, vk[None, :, None] * grow, pass_,
                                      np.array([False, True])[None, None, :], m.workload.head_dim, envelope,
                                      dtype=m.workload.dtype).ravel()
        if envelope and self.kernel.spec.segments == "per_call" and priced_by_cover(m.workload, self.kernel.spec):
            # kernels per document segment (or window strip) run at their own (smaller) shapes, any of them up
            # to the table's best: the best efficiency anywhere keeps the bound a bound
            big = float(self.kernel.spec.tokens[-1])
            grid = np.full(grid.shape, float(self.kernel.efficiency(big, big, pass_, False, m.workload.head_dim,
                                                                    True, dtype=m.workload.dtype)))
        return grid

    def merge_time_s(self, bytes_touched) -> np.ndarray:
        """Memory-bound merge/accumulate time: launch + bytes / (0.8 · HBM bandwidth)."""
        b = np.asarray(bytes_touched, dtype=np.float64)
        return np.where(b > 0, self.kernel.launch_s + b / self.merge_rate, 0.0)

    def _one_kernel(self, sched: Schedule, ops: np.ndarray, pass_: str) -> np.ndarray:
        """Ops over several blocks: one launch; each block's FLOPs at the efficiency of the kernel the op runs
        — the block's shape grown by √(a·b) for an op over a × b chunks (exact for square ops: Ulysses, USP,
        TASP; the same area for CHARM+'s 2c × c; symmetric in (s_q, s_kv), which the symmetry reduction
        needs) — with the elementwise factor only on the blocks that need a mask."""
        m = attn_matrix(sched.workload, sched.n_chunks)
        o = sched.ops
        runs = _runs_by_block(sched, m, ops)
        # ops alike but for their rank (the same chunks, head count and kernel) cost the same, summed in the same
        # order: each priced once (a Ulysses group's u ranks, u x u blocks an op: 2M blocks at 256 ranks, u = 32)
        _, chunk_set = distinct_chunk_sets(o, ops)
        width = (o.h1 - o.h0)[ops].astype(np.int64)
        _, first, alike = np.unique((chunk_set * 2 + runs) * (sched.workload.n_heads + 1) + width, return_index=True,
                                    return_inverse=True)
        ops, alike = ops[first], alike.ravel()
        op_of, qi, kj = expand_blocks(o, ops)
        heads = (o.h1 - o.h0)[op_of] / sched.workload.n_heads
        by_block = np.zeros(len(o), dtype=bool)
        by_block[ops] = runs[first]
        grow = np.where(by_block[op_of], 1.0, np.sqrt(np.diff(o.qc_ptr) * np.diff(o.kvc_ptr))[op_of])
        eff = self.kernel.efficiency(m.s_q[qi, kj] * grow, m.s_kv[qi, kj] * grow, pass_, m.elementwise[qi, kj],
                                     sched.workload.head_dim, dtype=sched.workload.dtype)
        flops = m.flops(pass_)[qi, kj]
        t = flops * heads / (self.topo.peak_flops(sched.workload.dtype) * eff)
        total = np.bincount(op_of, weights=t, minlength=len(o))          # summed in order, as np.add.at would
        launches = np.bincount(op_of, weights=flops > 0, minlength=len(o))
        return (self.kernel.launch_s * np.where(by_block[ops], launches[ops], 1.0) + total[ops])[alike]

    def _doc_compute(self, sched: Schedule, dur: np.ndarray) -> None:
        """Compute ops under a ``docs`` mask, per document segment, or a window on per-call kernels, per strip
        (:mod:`meshplan.cost.doc_kernels`)."""
        o, doc = sched.ops, DocKernels(self, attn_matrix(sched.workload, sched.n_chunks))
        n, heads = sched.n_chunks, (o.h1 - o.h0) / sched.workload.n_heads
        blocks = np.diff(o.qc_ptr) * np.diff(o.kvc_ptr)
        for phase in (0, 1):
            pass_ = PASS_NAMES[phase]
            one = np.flatnonzero((o.kind == COMPUTE) & (o.phase == phase) & (blocks == 1))
            if len(one):
                fixed, scaled = doc.block_parts(pass_)
                b = o.q_chunks[o.qc_ptr[one]] * n + o.kv_chunks[o.kvc_ptr[one]]
                dur[one] = np.where(o.flops[one] > 0, fixed[b] + scaled[b] * heads[one], 0.0)
            multi = np.flatnonzero((o.kind == COMPUTE) & (o.phase == phase) & (blocks > 1))
            if not doc.per_call and many_covers(sched, multi):
                # too many distinct chunk sets to build each cover (Mesh's tiles at scale): the op's blocks'
                # segments in one varlen call, an upper bound on the tiles of its cover
                dur[multi] = np.where(o.flops[multi] > 0, doc.varlen_ops(sched, multi, pass_), 0.0)
                continue
            for op in multi:
                qc = tuple(int(x) for x in o.q_chunks[o.qc_ptr[op]:o.qc_ptr[op + 1]])
                kc = tuple(int(x) for x in o.kv_chunks[o.kvc_ptr[op]:o.kvc_ptr[op + 1]])
                fixed, scaled = doc.op_parts(qc, kc, int(o.s_q[op]), int(o.s_kv[op]), pass_)
                dur[op] = fixed + scaled * heads[op] if o.flops[op] > 0 else 0.0

    @staticmethod
    def _bwd_without_out(sched: Schedule) -> np.ndarray:
        """Backward compute ops none of whose inputs is an ``out`` tensor (their Q side carries D, not O)."""
        o = sched.ops
        op_of_input = np.repeat(np.arange(len(o)), np.diff(o.in_ptr))
        has_out = np.zeros(len(o), dtype=bool)
        np.logical_or.at(has_out, op_of_input, sched.tensors.kind[o.inputs] == TENSOR_KIND_NAMES.index("out"))
        return np.flatnonzero((o.kind == COMPUTE) & (o.phase == 1) & ~has_out)

    def _staging_s(self, sched: Schedule, without_out: np.ndarray) -> np.ndarray:
        """[n_ops] seconds the executor spends copying each compute op's inputs into kernel layout before its
        kernels (``kernel.stage_inputs``; :meth:`meshplan.executor.ops.OpRunner.compute`): every part it reads —
        forward Q, K, V; backward Q, O (not where the Q side carries D), dO, K, V — read and written once as a
        contiguous [B, h, T, D] copy, and with GQA each of K and V read again and written at the query heads;
        memory bound, at the merge rate. 0 for ops without FLOPs and for the rest. ``without_out``: the backward ops
        whose Q side carries D (:meth:`_bwd_without_out`)."""
        o, w = sched.ops, sched.workload
        per_token_head = w.batch * w.head_dim * DTYPE_BYTES[w.dtype]      # bytes of one token of one head
        heads = (o.h1 - o.h0).astype(np.float64)
        kv_heads = heads / w.gqa_group
        q_parts = np.where(o.phase == 0, 1.0, 3.0)
        q_parts[without_out] = 2.0                          # the Q side carries D, not O: Q and dO
        kv_touched = 2.0 * kv_heads + ((kv_heads + heads) if w.gqa_group > 1 else 0.0)     # per K or V part
        touched = per_token_head * (2.0 * q_parts * o.s_q * heads + 2.0 * o.s_kv * kv_touched)
        return np.where((o.kind == COMPUTE) & (o.flops > 0), touched / self.merge_rate, 0.0)

    def op_durations(self, sched: Schedule) -> np.ndarray:
        """[n_ops] seconds for compute, merge and accumulate ops alone on their device; 0 for the rest. Kept on the
        schedule per topology content, kernel table and merge rate (``Schedule.memo``; 0.47 s for a 0.9M-op
        schedule); each call gets a copy."""
        key = ("op_durations", self.topo.content_hash, self.kernel, self.merge_rate)
        if key not in sched.memo:
            sched.memo[key] = self._op_durations(sched)
        return sched.memo[key].copy()

    def durations_of(self, sched) -> np.ndarray:
        """[n_ops] :meth:`op_durations` of anything shaped as a Schedule (its ``ops`` and ``tensors`` columns,
        ``workload``, ``n_chunks``), not kept: a quotient build prices each builder call's ops of every rank
        (:class:`meshplan.plan.quotient.QuotientCheck`)."""
        return self._op_durations(sched)

    def _op_durations(self, sched: Schedule) -> np.ndarray:
        o, t = sched.ops, sched.tensors
        dur = np.zeros(len(o))
        dtype = sched.workload.dtype
        blocks = np.diff(o.qc_ptr) * np.diff(o.kvc_ptr)
        by_cover = priced_by_cover(sched.workload, self.kernel.spec)
        for phase in () if by_cover else (0, 1):        # priced by cover: every compute op priced there below
            sel = np.flatnonzero((o.kind == COMPUTE) & (o.phase == phase) & (blocks <= 1))
            if len(sel):
                dur[sel] = self.block_time_s(o.flops[sel], o.s_q[sel], o.s_kv[sel], o.mask[sel] > 0,
                                             PASS_NAMES[phase], dtype, sched.workload.head_dim)
            multi = np.flatnonzero((o.kind == COMPUTE) & (o.phase == phase) & (blocks > 1))
            if len(multi):
                dur[multi] = self._one_kernel(sched, multi, PASS_NAMES[phase])
        if by_cover:                                    # document segments, window strips on CPU:
            self._doc_compute(sched, dur)               # priced as the kernels run them
        delta = self.kernel.bwd_delta(dtype)
        stage = self.kernel.spec.stage_inputs
        without_out = self._bwd_without_out(sched) if delta != 1.0 or stage else None
        if delta != 1.0:
            dur[without_out] *= delta
        if stage:
            dur += self._staging_s(sched, without_out)
        combined = (o.kind == COMPUTE) & (o.combine != COMBINES.index("write"))
        out_bytes = csr_sum(o.out_ptr, t.size_bytes[o.outputs].astype(np.float64))
        merging = o.combine[combined] == COMBINES.index("merge")          # O in the workload dtype, merged in fp32
        factor = np.where(merging, self.kernel.merge_factor(dtype), 1.0)
        dur[combined] += factor * 3 * out_bytes[combined] / self.merge_rate
        side = np.flatnonzero((o.kind == KIND["merge"]) | (o.kind == KIND["accumulate"]))
        dur[side] = self.merge_time_s(o.size_bytes[side])
        return dur



def shape_classes(m) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """A matrix's block classes: (distinct participating query rows [Vq], distinct key columns [Vk], [N, N] each
    block's class, (row index · Vk + column index) · 2 + masked, in 0..K−1 with K = 2·Vq·Vk); kept on the matrix."""
    got = m.__dict__.get("_shape_codes")
    if got is None:
        vq, cq = _codes(m.s_q)
        vk, ck = _codes(m.s_kv)
        got = m.__dict__["_shape_codes"] = (vq, vk, (cq * len(vk) + ck) * 2 + m.elementwise.astype(np.int64))
    return got


def _flops_and_launch(m, pass_: str, launch_s: float) -> tuple[np.ndarray, np.ndarray]:
    """([N, N] FLOPs of each block in ``pass_``, [N, N] ``launch_s`` where a block has FLOPs, else 0), kept on the
    matrix."""
    cache = m.__dict__.setdefault("_flops_launch", {})
    if (pass_, launch_s) not in cache:
        flops = m.flops(pass_)
        cache[(pass_, launch_s)] = (flops, np.where(flops > 0, launch_s, 0.0))
    return cache[(pass_, launch_s)]


def _codes(a: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(the distinct values of a non-negative integer array, each element's index into them); O(n) through a
    lookup table for values below 2²², else ``np.unique``."""
    flat = np.asarray(a).ravel()
    top = int(flat.max(initial=0))
    if flat.dtype.kind in "iu" and top < 1 << 22:
        present = np.zeros(top + 1, dtype=bool)
        present[flat] = True
        values = np.flatnonzero(present)
        lut = np.zeros(top + 1, dtype=np.int64)
        lut[values] = np.arange(len(values))
        return values, lut[flat].reshape(np.shape(a))
    values, inverse = np.unique(flat, return_inverse=True)
    return values, inverse.reshape(np.shape(a))
