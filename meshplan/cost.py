"""Closed-form costs (COSTMODEL.md level L0): compute, merges and uncontended alpha-beta transfers.

All times in seconds, sizes in bytes, rates in bytes/s.

* Attention block: ``t = t_launch + FLOPs / (peak(dtype) · e(s_q, s_kv, pass, mask))`` with ``e`` from
  the device's kernel table (:mod:`meshplan.kernels`); FLOPs = 4·B·h·pairs·D forward, 2.5x backward.
  An op over several blocks runs as one kernel of the op's shape (the rows and columns of its chunks that
  take part: Ulysses runs the whole sequence, USP u·c × u·c, CHARM+ 2c × c, TASP c × c from N − 1
  sub-chunks), with the elementwise factor when that rectangle is not fully permitted (COSTMODEL.md:
  ``e`` is keyed by the kernel's shape, not by FLOPs).
* Combining a result into an accumulator (LSE merge or gradient add) is memory bound:
  ``t = t_launch + bytes_touched / (f · HBM bandwidth)`` with f = the table's ``merge_hbm_fraction``
  (0.8, COSTMODEL.md). A compute op with ``combine`` merge/accumulate pays it for each output:
  3 x the output's bytes (read accumulator, read partial, write accumulator).
* Transfer alone on its route: ``T(S) = alpha_sw + Σ hop latency + S / min(link capacity, per-flow cap)``.

The simulator (L1) adds contention and overlap; these formulas are also what lower bounds are made of.
"""

from __future__ import annotations

import numpy as np

from meshplan.csr import csr_sum
from meshplan.schedule import COMBINES, COMPUTE, KIND, PASS_NAMES, Schedule
from meshplan.topology import Topology


class CostModel:
    """Op durations on one topology for one workload dtype."""

    def __init__(self, topo: Topology) -> None:
        self.topo = topo
        self.kernel = topo.kernel
        self.merge_rate = self.kernel.spec.merge_hbm_fraction * topo.hbm_bytes_per_s

    def block_time_s(self, flops, s_q, s_kv, elementwise, pass_: str, dtype: str) -> np.ndarray:
        """Kernel time of attention ops (vectorised): launch + FLOPs / (peak · efficiency). Zero FLOPs -> 0."""
        flops = np.asarray(flops, dtype=np.float64)
        eff = self.kernel.efficiency(s_q, s_kv, pass_, elementwise)
        t = self.kernel.launch_s + flops / (self.topo.peak_flops(dtype) * eff)
        return np.where(flops > 0, t, 0.0)

    def matrix_block_times(self, m, pass_: str, kernel_chunks: tuple[int, int] = (1, 1)) -> np.ndarray:
        """[N, N] kernel time of every block of a matrix (all query heads), cached on the matrix.

        ``kernel_chunks`` (a, b): the block runs inside a kernel of up to a × b chunks, so its efficiency is
        taken at that shape — the largest it can have, which keeps closed forms lower bounds."""
        key = (self.topo.content_hash, pass_, kernel_chunks)
        cache = m.__dict__.setdefault("_block_time_cache", {})
        if key not in cache:
            a, b = kernel_chunks
            c = m.tokens_per_chunk
            s_q, s_kv = (m.s_q, m.s_kv) if (a, b) == (1, 1) else (a * c, b * c)
            cache[key] = self.block_time_s(m.flops(pass_), s_q, s_kv, m.elementwise, pass_, m.workload.dtype)
        return cache[key]

    def merge_time_s(self, bytes_touched) -> np.ndarray:
        """Memory-bound merge/accumulate time: launch + bytes / (0.8 · HBM bandwidth)."""
        b = np.asarray(bytes_touched, dtype=np.float64)
        return np.where(b > 0, self.kernel.launch_s + b / self.merge_rate, 0.0)

    def op_durations(self, sched: Schedule) -> np.ndarray:
        """[n_ops] seconds for compute, merge and accumulate ops alone on their device; 0 for the rest."""
        o, t = sched.ops, sched.tensors
        dur = np.zeros(len(o))
        dtype = sched.workload.dtype
        for phase in (0, 1):
            sel = np.flatnonzero((o.kind == COMPUTE) & (o.phase == phase))
            if len(sel):
                dur[sel] = self.block_time_s(o.flops[sel], o.s_q[sel], o.s_kv[sel], o.mask[sel] > 0,
                                             PASS_NAMES[phase], dtype)
        combined = (o.kind == COMPUTE) & (o.combine != COMBINES.index("write"))
        out_bytes = csr_sum(o.out_ptr, t.size_bytes[o.outputs].astype(np.float64))
        dur[combined] += 3 * out_bytes[combined] / self.merge_rate
        side = np.flatnonzero((o.kind == KIND["merge"]) | (o.kind == KIND["accumulate"]))
        dur[side] = self.merge_time_s(o.size_bytes[side])
        return dur

