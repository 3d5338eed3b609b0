"""Closed-form (L0) timing of a built schedule: the uncontended evaluation and the busiest-link bound.

Every transfer takes its uncontended alpha-beta time, every compute op its duration alone, no overlap
penalty; the schedule's own dependencies and batches are respected (:func:`meshplan.plan.dataflow.evaluate`).
Contention and overlap only lengthen ops and the semantics are monotone, so the result is a lower bound on
the simulated makespan; ``bound_s`` also takes the busiest link's bytes / capacity and each rank's kernels slowed
by the overlap rule while its transfers must be active (:func:`overlap_bound`). Algorithms with small
schedules (Mesh) use this; Ring and pass-Q have an equivalent per-step recurrence that needs no schedule.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from meshplan.cost.cost import CostModel
from meshplan.cost.estimate import contended_evaluation
from meshplan.cost.memory import model_total_bytes, op_workspace_bytes
from meshplan.cost.symmetry import find_reduction, identity
from meshplan.model.topology import Topology
from meshplan.plan.dataflow import build_items, evaluate
from meshplan.plan.peaks import peak_memories
from meshplan.plan.schedule import BUSY_KINDS, COMPUTE, PASS_NAMES, RECV, SEND, Schedule


@dataclass
class PassTiming:
    """Closed-form (L0) timing of one pass.

    ``makespan_s`` is the uncontended makespan, a lower bound; ``bound_s`` the larger of it and the
    busiest link's bytes / capacity. ``compute_s`` and ``comm_s`` are per-rank sums on the critical rank.
    """

    makespan_s: float
    bound_s: float
    compute_s: float
    comm_s: float
    recv_bytes_max: float
    inter_node_bytes_max: float
    flops_total: float
    recv_bytes_total: float
    peak_memory_bytes: float
    peak_memory_total_bytes: float | None = None   # the memory model's peak (None: closed forms without it)
    estimate_s: float | None = None      # best guess of the simulated makespan (default: makespan_s)
    extra: dict[str, float] = field(default_factory=dict)


def pool_bound(topo: Topology, compute_per_rank: np.ndarray) -> float:
    """Ranks sharing a compute pool (CPU ranks on a few cores) need at least Σ compute / pool capacity."""
    cap = topo.pool_capacity
    return float(np.sum(compute_per_rank)) / cap if cap else 0.0


def incidence_part(topo: Topology, src_rank, dst_rank, src_dev, dst_dev, size_bytes=None):
    """One transfer family's incidences for :class:`OverlapTable`: for every link of its node a transfer crosses,
    at each end rank (sender and receiver), the seconds it keeps that link busy per byte of the family (or for its
    own ``size_bytes``), with its κ (the largest ``overlap_kappa`` on its route) —
    :meth:`~meshplan.model.routing.Routing.own_side_incidence`. Links of the other end's node are left out (a
    weaker, still valid, bound: a rank's own links carry every one of its transfers)."""
    if len(src_rank) == 0 or not topo.kappa().any():
        return np.zeros(0, dtype=np.int64), np.zeros(0), np.zeros(0)
    return topo.own_side_incidence(src_rank, dst_rank, src_dev, dst_dev, size_bytes)


class OverlapTable:
    """Transfer families' (rank, link) incidences, for a lower bound from the simulator's overlap rule: while a rank
    has an active transfer (from both ends posted to its last byte, as sender or receiver) its compute runs at rate
    at most 1 − κ, κ the largest ``overlap_kappa`` of the link classes on that transfer's route (Calculon's
    ``processor_usage``). With C the time its compute stream runs and A the time it has a transfer active, its
    compute (rate-1 seconds of kernels, merges and additions) fits in |C| − κ·|C ∩ A|, so the pass lasts at least
    |C ∪ A| ≥ compute + κ·|A|. |A| is at least, for any link L, the bytes of the rank's transfers routed over L /
    L's capacity (they share L), with κ the least of those transfers' (each moment of that union has one of them
    active). Built once per set of families (``parts``: :func:`incidence_part` of each; dense, [ranks x links of a
    node]); :meth:`bound` takes the bytes each family moves."""

    def __init__(self, topo: Topology, n_ranks: int, parts: list) -> None:
        self.n, size = n_ranks, n_ranks * topo.links_per_node
        self.per_node = topo.links_per_node
        self.unit = np.zeros((len(parts), size))
        self.kappa = np.full((len(parts), size), np.inf)
        for f, (keys, secs, kaps) in enumerate(parts):
            self.unit[f] = np.bincount(keys, weights=secs, minlength=size)
            for level in np.unique(kaps)[::-1]:                    # the least κ last: it overwrites
                self.kappa[f][np.bincount(keys[kaps == level], minlength=size) > 0] = level

    def bound(self, compute_s: np.ndarray, bytes_per_part) -> np.ndarray:
        """[n_ranks] compute_s[r] + max over its node's links L of κ(r, L) · busy(r, L): a lower bound on the pass's
        makespan per rank, ``compute_s`` its busy time at rate 1 (or a lower bound of it), ``bytes_per_part`` the
        factor each part's seconds are taken at (its bytes per transfer, or 1 for a part built with its sizes)."""
        out = np.asarray(compute_s, dtype=np.float64).copy()
        b = np.asarray(bytes_per_part, dtype=np.float64)
        on = np.flatnonzero(b > 0)
        if self.unit.shape[1] == 0 or len(on) == 0:
            return out
        busy = b[on] @ self.unit[on]
        least = np.where(self.unit[on] > 0, self.kappa[on], np.inf).min(axis=0)
        slow = np.where(np.isfinite(least), least, 0.0) * busy
        return out + slow.reshape(self.n, self.per_node).max(axis=1)


def overlap_bound(topo: Topology, n_ranks: int, compute_s: np.ndarray, src_rank, dst_rank, src_dev, dst_dev,
                  size_bytes) -> np.ndarray:
    """[n_ranks] :class:`OverlapTable`'s bound for one set of transfers, each with its own bytes (0 extra where
    κ is 0: CPU ranks, a topology without an overlap cost)."""
    part = incidence_part(topo, src_rank, dst_rank, src_dev, dst_dev, size_bytes)
    return OverlapTable(topo, n_ranks, [part]).bound(compute_s, [1.0])


def transfer_seconds(sched: Schedule, topo: Topology, partner: np.ndarray) -> np.ndarray:
    """[n_ops] uncontended time of the transfer each send/recv takes part in (0 for other ops)."""
    o, dev = sched.ops, sched.device_of_rank
    comm = partner >= 0
    src = np.where(o.kind == SEND, o.rank, o.peer)
    dst = np.where(o.kind == SEND, o.peer, o.rank)
    lat, bw = topo.pair_stats(dev[np.where(comm, src, 0)], dev[np.where(comm, dst, 0)])
    return np.where(comm, lat + o.size_bytes / bw, 0.0)


def schedule_timing(sched: Schedule, topo: Topology, contended: bool = False) -> dict[str, PassTiming]:
    """PassTiming of every pass of a built schedule; ``contended``: also ``estimate_s``, the contended closed
    form of :mod:`meshplan.cost.estimate` (every rank evaluated, no symmetry reduction)."""
    o, dev = sched.ops, sched.device_of_rank
    partner = sched.match_transfers()[0]
    dur = CostModel(topo).op_durations(sched)
    tr = transfer_seconds(sched, topo, partner)
    workspace = op_workspace_bytes(sched, topo.memory_model)
    # evaluate one node's ranks when the rest are alike (the contended form needs every rank's flows)
    red = identity(sched) if contended else find_reduction(sched, topo, dur, partner, 0.0)
    rep_partner = np.where(partner >= 0, red.rep_op[np.maximum(partner, 0)], -1)
    out = {}
    for phase in sched.passes:
        items = build_items(sched, phase, rep_partner, ranks=red.reps)
        ev = evaluate(items, dur, tr)
        estimate = None
        if contended and ev.complete:
            late = contended_evaluation(sched, topo, items, dur, tr, ev).end
            estimate = float(np.nanmax(late)) if len(late) else 0.0
        sel = np.flatnonzero(o.phase == phase)
        rep_item = items.item_of_op[red.rep_op[sel]]
        start, end = np.full(len(o), np.nan), np.full(len(o), np.nan)
        start[sel], end[sel] = ev.start[rep_item], ev.end[rep_item]
        last = np.full(sched.n_ranks, -np.inf)
        np.maximum.at(last, o.rank[sel], end[sel])
        crit = int(np.argmax(last))
        in_pass = o.phase == phase
        recv = in_pass & (o.kind == RECV)
        by_rank = np.bincount(o.rank[recv], weights=o.size_bytes[recv], minlength=sched.n_ranks)
        cross = recv & ~topo.same_node(dev[o.rank], dev[np.maximum(o.peer, 0)])
        cross_rank = np.bincount(o.rank[cross], weights=o.size_bytes[cross], minlength=sched.n_ranks)
        sends = np.flatnonzero(in_pass & (o.kind == SEND))
        loads = topo.link_loads(dev[o.rank[sends]], dev[o.peer[sends]], o.size_bytes[sends])
        makespan = float(np.nanmax(ev.end)) if len(ev.end) else 0.0
        busy = in_pass & np.isin(o.kind, BUSY_KINDS)
        busy_s = np.bincount(o.rank[busy], weights=dur[busy], minlength=sched.n_ranks)
        pooled = pool_bound(topo, busy_s)
        overlap = overlap_bound(topo, sched.n_ranks, busy_s, o.rank[sends], o.peer[sends], dev[o.rank[sends]],
                                dev[o.peer[sends]], o.size_bytes[sends])
        if not ev.complete:
            raise RuntimeError("the schedule deadlocks (run meshplan validate)")
        mine = in_pass & (o.rank == crit)
        buffers, with_workspace = peak_memories(sched, phase, start, end, workspace,
                                                 red.rep_op if red.n_reps < sched.n_ranks else None)
        out[PASS_NAMES[phase]] = PassTiming(
            makespan_s=makespan,
            bound_s=max(makespan, pooled, float((loads / topo.link_capacity).max(initial=0.0)),
                        float(overlap.max(initial=0.0))),
            compute_s=float(dur[mine & busy].sum()), comm_s=float(tr[mine & (o.kind == RECV)].sum()),
            recv_bytes_max=float(by_rank.max()), inter_node_bytes_max=float(cross_rank.max()),
            flops_total=float(o.flops[in_pass & (o.kind == COMPUTE)].sum()), recv_bytes_total=float(by_rank.sum()),
            peak_memory_bytes=float(buffers.max()),
            peak_memory_total_bytes=model_total_bytes(topo.memory_model, float(with_workspace.max(initial=0.0))),
            estimate_s=estimate)
    return out
