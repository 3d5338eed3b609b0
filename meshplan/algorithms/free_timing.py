"""Pieces of the schedule-free closed forms: lower bounds from a plan alone, for methods whose schedule costs too
much to build at large N (:class:`~meshplan.algorithms.base.BuiltTiming` with ``schedule_free``; USP and LoongTrain
in :mod:`meshplan.algorithms.usp_timing`, StarTrail in :mod:`meshplan.algorithms.startrail_timing`, the CHARM+ family
in :mod:`meshplan.algorithms.charm.timing`).

A method lists its transfers as families (:class:`Transfers`: who sends to whom, with the bytes each moves and how
many times) and a dependency chain per rank; :func:`pass_timing` makes the PassTiming: makespan = the chain (a lower
bound: every term is a wait the schedule must have), bound = the larger of it, the busiest link's bytes / capacity
(every transfer on its route, a node's network aggregate included), a compute pool's and each rank's kernels slowed
by the overlap rule while its transfers are active (:class:`~meshplan.cost.bounds.OverlapTable`). The kernels come
from the plan's block owners at the kernel table's monotone envelope (:func:`owner_compute`), so they never exceed
what the built schedule's ops cost.
"""

from __future__ import annotations

import numpy as np

from meshplan.algorithms.base import PassTiming
from meshplan.cost.block_classes import rank_kernel_s
from meshplan.cost.bounds import OverlapTable, incidence_part, pool_bound
from meshplan.cost.cost import CostModel
from meshplan.cost.memory import closed_form_peak_bytes
from meshplan.model.topology import Topology
from meshplan.plan.plan import Plan


class Transfers:
    """One family of transfers: rank ``src[k]`` sends to ``dst[k]``, and what each costs alone on its route."""

    def __init__(self, plan: Plan, topo: Topology, src: np.ndarray, dst: np.ndarray) -> None:
        dev = plan.device_of_rank
        src, dst = np.asarray(src, dtype=np.int64), np.asarray(dst, dtype=np.int64)
        self.src, self.dst, self.n, self.capacity = src, dst, plan.n_ranks, topo.link_capacity
        self.lat, self.bw = topo.pair_stats(dev[src], dev[dst])
        self.cross = ~topo.same_node(dev[src], dev[dst])
        self.loads_per_byte = topo.link_loads(dev[src], dev[dst], 1.0) if len(src) else 0.0
        self.incidence = incidence_part(topo, src, dst, dev[src], dev[dst])    # for the overlap bound

    def alone(self, nbytes: float) -> np.ndarray:
        """[k] each transfer's time alone on its route with ``nbytes``."""
        return np.where(np.isfinite(self.bw), self.lat + nbytes / self.bw, 0.0)

    def slowest_in(self, nbytes: float) -> np.ndarray:
        """[n] the slowest transfer of ``nbytes`` into each rank, each alone on its route (0: none)."""
        out = np.zeros(self.n)
        np.maximum.at(out, self.dst, self.alone(nbytes))
        return out

    def link_seconds(self, nbytes: float) -> float:
        """The busiest link's time when every transfer moves ``nbytes``: its bytes / its capacity (0: none)."""
        if not len(self.src):
            return 0.0
        return float((self.loads_per_byte * nbytes / self.capacity).max(initial=0.0))

    def into(self, values: np.ndarray | float) -> np.ndarray:
        """[n] ``values`` per transfer summed on its receiving rank."""
        return np.bincount(self.dst, weights=np.broadcast_to(values, self.dst.shape), minlength=self.n)


#: a family moved in one pass: (transfers, bytes of each transfer, how many times each moves them)
Moved = tuple[Transfers, float, int]


def pass_timing(plan: Plan, topo: Topology, pass_: str, compute: np.ndarray, chain: np.ndarray, moved: list[Moved],
                buffers_bytes: float, wire_bytes: float, op_chunks: int = 1) -> PassTiming:
    """The PassTiming of one pass from its kernels per rank ``compute`` [n], the dependency chain per rank ``chain``
    [n] (a lower bound of when the rank's last op ends), the families ``moved``, and the memory estimate's buffer
    peak, bytes in flight and op span (:func:`~meshplan.cost.memory.closed_form_peak_bytes`)."""
    n = plan.n_ranks
    loads = sum((f.loads_per_byte * (b * k) for f, b, k in moved), np.zeros(topo.n_links))
    recv = sum((f.into(b * k) for f, b, k in moved), np.zeros(n))
    cross = sum((f.into(np.where(f.cross, b * k, 0.0)) for f, b, k in moved), np.zeros(n))
    comm = sum((f.into(f.alone(b) * k) for f, b, k in moved), np.zeros(n))
    link = float((loads / topo.link_capacity).max(initial=0.0))
    makespan = float(chain.max(initial=0.0))
    crit = int(np.argmax(chain))
    overlap = OverlapTable(topo, n, [f.incidence for f, _, _ in moved]).bound(compute, [b * k for _, b, k in moved])
    return PassTiming(
        makespan_s=makespan, bound_s=max(makespan, link, pool_bound(topo, compute), float(overlap.max(initial=0.0))),
        compute_s=float(compute[crit]), comm_s=float(comm[crit]), recv_bytes_max=float(recv.max()),
        inter_node_bytes_max=float(cross.max()), flops_total=float(plan.matrix.flops(pass_).sum()),
        recv_bytes_total=float(recv.sum()), peak_memory_bytes=buffers_bytes,
        peak_memory_total_bytes=closed_form_peak_bytes(topo.memory_model, plan, pass_, buffers_bytes, wire_bytes,
                                                       op_chunks))


def op_overhead_s(topo: Topology, plan: Plan, pass_: str, acc_bytes: float) -> float:
    """What an attention op costs beside its blocks' kernel terms: a launch, and the combine of its result into
    fp32 accumulators of ``acc_bytes`` — 3 x those bytes at the merge rate (the forward's LSE merge at the kernel
    table's merge factor), as :meth:`meshplan.cost.cost.CostModel.op_durations` prices it."""
    cost = CostModel(topo)
    factor = cost.kernel.merge_factor(plan.workload.dtype) if pass_ == "fwd" else 1.0
    return cost.kernel.launch_s + factor * 3 * acc_bytes / cost.merge_rate


def owner_compute(plan: Plan, topo: Topology, pass_: str,
                  kernel_chunks: tuple[int, int]) -> tuple[np.ndarray, np.ndarray]:
    """([n] each rank's kernel time over the blocks the plan gives it, launches left out, [n] the least number of
    ops it runs them in): every block's FLOPs at the kernel table's monotone envelope for an op of up to
    ``kernel_chunks`` (q chunks, KV chunks) — a block in a smaller op only runs slower — and at least one op per
    ``a · b`` of its blocks."""
    total, _, count = rank_kernel_s(CostModel(topo), plan.matrix, plan.owner, plan.n_ranks, pass_, kernel_chunks)
    per = kernel_chunks[0] * kernel_chunks[1]
    return total, -(-count // per)
