"""Closed-form (L0) timing of the ring rotations: the uncontended per-step alpha-beta recurrence.

It evaluates the same semantics as the simulator (batched P2P per step, deps on the previous step's
recv) with every transfer at its route's uncontended rate, ``T = alpha_sw + Σ hop latency + S / bottleneck``,
and no overlap penalty, vectorised over ranks step by step. Contention and overlap only lengthen ops,
and the semantics are monotone, so this is a lower bound on the simulated makespan; with no shared link
and κ = 0 it equals the simulation (tests check both). ``bound_s`` adds the busiest link's bytes /
capacity and the busiest rank's kernels slowed by the overlap rule while its hops are active. Bytes per rank
follow the module docstrings of ``ring`` and ``pass-q``.
"""

from __future__ import annotations

import numpy as np

from meshplan.algorithms.base import PassTiming
from meshplan.cost.bounds import OverlapTable, incidence_part, pool_bound
from meshplan.cost.cost import CostModel
from meshplan.cost.memory import closed_form_peak_bytes
from meshplan.model.topology import Topology
from meshplan.plan.plan import Plan
from meshplan.plan.schedule import tensor_bytes


def size_of(plan: Plan, kind: str, dtype: str) -> float:
    """Bytes of one chunk's tensor of ``kind`` in ``dtype`` (all query heads)."""
    w = plan.workload
    return float(tensor_bytes(w, kind, plan.matrix.chunk_tokens(kind), w.n_heads, dtype))


class Rotation:
    """Per-(rank, step) blocks and costs of a rotation; rank r holds travelling chunk j = (r − s) mod N."""

    def __init__(self, plan: Plan, topo: Topology, rows: bool) -> None:
        self.plan, self.topo, self.n = plan, topo, plan.n_ranks
        self.cost = CostModel(topo)
        n, m = self.n, plan.matrix
        r = np.arange(n)[:, None]
        j = (r - np.arange(n)[None, :]) % n
        self.qi, self.ki = (np.broadcast_to(r, (n, n)), j) if rows else (j, np.broadcast_to(r, (n, n)))
        self.ok = m.permitted[self.qi, self.ki]
        dev = plan.device_of_rank
        self.hop_lat, self.hop_bw = topo.pair_stats(dev[(np.arange(n) - 1) % n], dev)
        self.hop_cross = ~topo.same_node(dev[(np.arange(n) - 1) % n], dev)
        self._overlap: OverlapTable | None = None

    def blocks(self, pass_: str, combine_bytes: float) -> np.ndarray:
        """[n, n] duration of each rank's block at each step (0 where empty), with its combine cost."""
        d = self.cost.matrix_block_times(self.plan.matrix, pass_)[self.qi, self.ki]
        return np.where(self.ok, d + combine_bytes / self.cost.merge_rate, 0.0)

    def hop(self, size: float) -> np.ndarray:
        """[n] uncontended time of a transfer of ``size`` bytes into each rank from its predecessor."""
        return np.where(np.isfinite(self.hop_bw), self.hop_lat + size / self.hop_bw, 0.0)

    def hop_concurrent(self, size: float) -> np.ndarray:
        """[n] time of each rank's hop transfer of ``size`` bytes when every rank's hop runs at once (one ring
        step): latency + size / the flow's max-min fair rate (:func:`meshplan.cost.maxmin.max_min_fair`) over the
        links the N flows share — the single-flow rate on per-port links (NVSwitch), a share of it where the
        flows meet (a host's loopback, a node's NICs)."""
        from meshplan.cost.maxmin import max_min_fair

        dev = self.plan.device_of_rank
        src = dev[(np.arange(self.n) - 1) % self.n]
        routes = [self.topo.route(int(s), int(d)).tolist() for s, d in zip(src, dev)]
        caps = [float(self.topo.link_flow_cap[r].min()) if len(r) else np.inf for r in routes]
        rates = np.asarray(max_min_fair(routes, self.topo.link_capacity.tolist(), caps))
        return np.where(np.isfinite(rates), self.hop_lat + size / rates, 0.0)

    def batch(self, prev_end: np.ndarray, gate: np.ndarray, T: np.ndarray) -> np.ndarray:
        """End of every rank's batch (send to r+1, recv from r−1) that starts after its previous batch and
        after ``gate`` (the rank's last compute: double buffering)."""
        start = np.maximum(prev_end, gate)
        return _batch_end(start, T)

    def link_bound(self, loads: np.ndarray) -> float:
        """max over links of bytes / capacity."""
        return float((loads / self.topo.link_capacity).max(initial=0.0))

    def hop_loads(self, size: float, count: float) -> np.ndarray:
        """Link loads of ``count`` transfers of ``size`` on every hop r−1 -> r."""
        dev = self.plan.device_of_rank
        return self.topo.link_loads(dev[(np.arange(self.n) - 1) % self.n], dev, size * count)

    def overlap_bound(self, compute: np.ndarray, hop_bytes: float) -> float:
        """The busiest rank's kernels slowed by the overlap rule while its hops (``hop_bytes`` each way over the pass)
        are active (:class:`~meshplan.cost.bounds.OverlapTable`)."""
        if self._overlap is None:
            dev, dst = self.plan.device_of_rank, np.arange(self.n)
            src = (dst - 1) % self.n
            self._overlap = OverlapTable(self.topo, self.n, [incidence_part(self.topo, src, dst, dev[src], dev[dst])])
        return float(self._overlap.bound(compute, [hop_bytes]).max(initial=0.0))

    def timing(self, pass_: str, makespan, compute, comm, recv, cross, loads, peak,
               hop_bytes: float = 0.0) -> PassTiming:
        """Assemble a PassTiming (critical rank = the one that ends last); ``hop_bytes``: what each hop moves over
        the pass, for the overlap bound."""
        crit = int(np.argmax(makespan))
        flops = float(self.plan.matrix.flops(pass_).sum())
        return PassTiming(makespan_s=float(makespan[crit]),
                          bound_s=max(float(makespan[crit]), self.link_bound(loads), pool_bound(self.topo, compute),
                                      self.overlap_bound(compute, hop_bytes)),
                          compute_s=float(compute[crit]), comm_s=float(comm[crit]), recv_bytes_max=float(recv.max()),
                          inter_node_bytes_max=float(cross.max()), flops_total=flops,
                          recv_bytes_total=float(recv.sum()), peak_memory_bytes=float(peak),
                          peak_memory_total_bytes=closed_form_peak_bytes(
                              self.topo.memory_model, self.plan, pass_, float(peak),
                              2 * float(recv.max()) / max(self.n - 1, 1)))     # one step's send and receive


def _batch_end(start: np.ndarray, T: np.ndarray) -> np.ndarray:
    """[n] end of every rank's batch — send to r+1 and receive from r−1, both taking ``T[r]`` from when both
    ends can start — ``start[r]`` the rank's earliest start (np.roll's shifts, without its per-call overhead:
    thousands of calls a closed form at 1024 ranks)."""
    t_end = start.copy()
    np.maximum(start[1:], start[:-1], out=t_end[1:])
    t_end[0] = max(start[0], start[-1])
    t_end += T
    end = t_end.copy()
    np.maximum(t_end[:-1], t_end[1:], out=end[:-1])
    end[-1] = max(t_end[-1], t_end[0])
    return end


def forward(rot: Rotation, travel_kind: str, combine_bytes) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Forward rotation: (compute-stream end [n], block durations [n, n], batch ends [n, n−1]).

    ``combine_bytes`` (scalar or per step [n]) is what each block's output combine touches.
    """
    d = rot.blocks("fwd", np.broadcast_to(np.asarray(combine_bytes, dtype=np.float64), (rot.n,))[None, :])
    T = rot.hop(size_of(rot.plan, travel_kind, rot.plan.workload.dtype))
    n = rot.n
    ends, cend = np.zeros((n, max(n - 1, 0))), np.zeros(n)
    for s in range(n):
        if s < n - 1:
            ends[:, s] = rot.batch(ends[:, s - 1] if s else 0.0, cend, T)
        start = np.maximum(cend, ends[:, s - 1]) if s else cend
        cend = np.where(rot.ok[:, s], start + d[:, s], cend)
    return cend, d, ends


def backward(rot: Rotation, travel_kind: str, grad_kind: str, grad_dtype: str, hops: str, local_fp32: float,
             static_bytes: float) -> PassTiming:
    """Backward rotation: partial gradients of the travelling chunk ride along (hops ``n`` or ``n-1``)."""
    plan, n = rot.plan, rot.n
    part = size_of(plan, grad_kind, "fp32")
    wire = size_of(plan, grad_kind, grad_dtype)
    travel = size_of(plan, travel_kind, plan.workload.dtype)
    d = rot.blocks("bwd", 3 * (local_fp32 + part))
    acc = float(rot.cost.merge_time_s(2 * part + wire))
    T, Tg = rot.hop(travel), rot.hop(wire)
    t_ends = np.zeros((n, max(n - 1, 0)))
    free, g_prev, last = np.zeros(n), np.zeros(n), np.zeros(n)
    comp_sum, comm_sum = d.sum(axis=1), np.zeros(n)
    for s in range(n):
        have = rot.ok[:, s]
        if s < n - 1:
            t_ends[:, s] = rot.batch(t_ends[:, s - 1] if s else 0.0, last, T)
        start = np.maximum(free, t_ends[:, s - 1]) if s else free
        free = np.where(have, start + d[:, s], free)
        last = np.where(have, free, last)
        if n == 1 or (hops == "n-1" and s == 0):
            continue
        if s >= (2 if hops == "n-1" else 1):
            free = np.where(have, np.maximum(free, g_prev) + acc, free)
            comp_sum += np.where(have, acc, 0.0)
        gstart = np.maximum(g_prev, np.where(have, free, 0.0))
        g_prev = _batch_end(gstart, Tg)
        comm_sum += Tg
    if hops == "n-1" and n > 1:
        free = np.maximum(free, g_prev) + acc
        comp_sum += acc
    end = np.maximum(free, g_prev)
    if n > 1:
        end = np.maximum(end, t_ends.max(axis=1))
    n_grad = n if hops == "n" else n - 1
    hop_t = rot.hop(travel)
    recv = (n - 1) * travel + (n_grad * wire if n > 1 else 0.0) + np.zeros(n)
    cross = np.where(rot.hop_cross, recv, 0.0)
    loads = rot.hop_loads(travel, n - 1) + (rot.hop_loads(wire, n_grad) if n > 1 else 0.0)
    extra = 2 * travel + 2 * part + wire + (part if hops == "n-1" else 0.0)
    peak = static_bytes + local_fp32 + (extra if n > 1 else part)
    return rot.timing("bwd", end, comp_sum, comm_sum + (n - 1) * hop_t, recv, cross, loads, peak,
                      (n - 1) * travel + (n_grad * wire if n > 1 else 0.0))
