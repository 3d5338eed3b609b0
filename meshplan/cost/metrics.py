"""Metrics of a simulated schedule: the contract's ``predicted`` keys, per pass and in total.

Definitions (docs/formats.md, docs/cost-model.md), all per pass; the critical rank is the one whose last op ends
last:

* ``makespan_s``: the pass's duration; ``compute_s``: time the critical rank's compute stream is busy
  (union of its compute/merge/accumulate intervals); ``exposed_comm_s`` = makespan − compute_s on that
  rank (time its compute waits); ``comm_busy_s``: union of its send/recv intervals;
* ``comm_bytes_per_gpu_max``: max over ranks of bytes received; ``inter_node_bytes_per_gpu_max``: the same
  for transfers whose peer is on another node;
* ``compute_to_comm`` = compute_s / comm_busy_s; ``bytes_per_flop`` = bytes received / FLOPs, over all
  ranks; ``peak_memory_bytes``: max over ranks of live tensor bytes (the buffers); ``peak_memory_total_bytes``:
  max over ranks of buffers + the workspace of the ops running + the runtime's own (:mod:`meshplan.cost.memory`,
  the topology's calibrated coefficients); ``ring_ccr``: given by the caller
  (Ring's Σ compute / Σ communication for this workload and topology, the CHARM+ definition).

A quotient schedule (:mod:`meshplan.plan.quotient`) holds the representatives' ops: its per-rank arrays are theirs
(each stands for its orbit) and its sums over ranks are theirs times the orbit's size.

``total`` sums times over passes (the passes are separated by a barrier) and takes the max of peaks.

In code a prediction is typed: :class:`PassMetrics` per pass (with the per-rank arrays the total folds) inside a
:class:`Prediction`; :meth:`Prediction.json` gives the contract's ``predicted`` object.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import numpy as np

from meshplan.cost.memory import model_total_bytes, op_workspace_bytes
from meshplan.cost.simulate import SimResult
from meshplan.model.topology import Topology
from meshplan.plan.peaks import peak_memories, peak_memories_over
from meshplan.plan.schedule import BUSY_KINDS, COMPUTE, PASS_NAMES, RECV, SEND, Schedule

KEYS = ("makespan_s", "compute_s", "exposed_comm_s", "comm_busy_s", "comm_bytes_per_gpu_max",
        "inter_node_bytes_per_gpu_max", "ring_ccr", "compute_to_comm", "bytes_per_flop", "peak_memory_bytes",
        "peak_memory_total_bytes", "work_imbalance")


def imbalance(flops_by_rank: np.ndarray) -> float | None:
    """Attention work balance: the busiest rank's FLOPs over the mean rank's (1.0: perfectly balanced; a rank
    holding only padding, or a causal split without zigzag, raises it). None without work."""
    mean = float(np.mean(flops_by_rank)) if len(flops_by_rank) else 0.0
    return float(np.max(flops_by_rank)) / mean if mean > 0 else None


def union_length(start: np.ndarray, end: np.ndarray) -> float:
    """Total length covered by intervals [start, end) (seconds)."""
    if len(start) == 0:
        return 0.0
    order = np.argsort(start, kind="stable")
    s, e = start[order], end[order]
    reach = np.maximum.accumulate(e)
    new = np.r_[True, s[1:] > reach[:-1]]
    seg = np.cumsum(new) - 1
    seg_start = s[new]
    seg_end = np.zeros(len(seg_start))
    np.maximum.at(seg_end, seg, reach)
    return float((seg_end - seg_start).sum())


@dataclass(frozen=True)
class PassMetrics:
    """One pass's predicted metrics (or the total over passes); definitions in the module docstring. The per-rank
    arrays ([n_ranks]; a closed form has only its busiest rank's) are what a total folds, not part of the contract."""

    makespan_s: float
    compute_s: float
    exposed_comm_s: float
    comm_busy_s: float
    comm_bytes_per_gpu_max: float
    inter_node_bytes_per_gpu_max: float
    compute_to_comm: float | None
    bytes_per_flop: float | None
    peak_memory_bytes: float
    peak_memory_total_bytes: float
    work_imbalance: float | None
    recv_bytes_by_rank: np.ndarray = field(repr=False, compare=False)
    cross_bytes_by_rank: np.ndarray = field(repr=False, compare=False)
    recv_bytes: float        # bytes received, summed over every rank (bytes_per_flop's numerator)
    flops: float
    flops_by_rank: np.ndarray = field(repr=False, compare=False)

    def json(self, ring_ccr: float | None) -> dict:
        """The contract's keys (:data:`KEYS`), plain floats."""
        out = {k: _plain(getattr(self, k)) for k in KEYS if k != "ring_ccr"}
        return out | {"ring_ccr": ring_ccr}


@dataclass(frozen=True)
class Prediction:
    """A candidate's prediction: :class:`PassMetrics` per pass (``"fwd"``, ``"bwd"``), their ``total`` and Ring's
    CCR for the workload. ``total`` is None for a forward-only method ranked in a fwd+bwd search (it has no
    backward: its flat keys and ``total`` are null in the contract, and it is ranked on its forward)."""

    passes: dict[str, PassMetrics]
    total: PassMetrics | None
    ring_ccr: float | None = None

    @property
    def makespan_s(self) -> float | None:
        """The total makespan (None for a forward-only method in a fwd+bwd search)."""
        return None if self.total is None else self.total.makespan_s

    @property
    def rank_s(self) -> float:
        """What ranks this candidate: its total makespan, or its forward's when it has no backward."""
        return self.passes["fwd"].makespan_s if self.total is None else self.total.makespan_s

    def forward_only(self) -> Prediction:
        """This prediction as a forward-only method's in a fwd+bwd search (``bwd`` and the totals null)."""
        return dataclasses.replace(self, total=None)

    def json(self) -> dict:
        """The contract's ``predicted``: flat keys for a single pass; ``fwd``/``bwd``/``total`` plus flat
        (= total) keys for fwd+bwd."""
        parts = {name: m.json(self.ring_ccr) for name, m in self.passes.items()}
        if self.total is None:
            return {k: None for k in KEYS} | {"fwd": parts["fwd"], "bwd": None, "total": None}
        if len(parts) == 1:
            return next(iter(parts.values()))
        total = self.total.json(self.ring_ccr)
        return {**total, **parts, "total": total}


def _plain(x):
    return x.item() if isinstance(x, (np.floating, np.integer)) else x


def pass_metrics(sched: Schedule, topo: Topology, sim: SimResult, phase: int) -> PassMetrics:
    """The metrics of pass ``phase`` along the simulated execution ``sim`` (module docstring)."""
    o = sched.ops
    sel = o.phase == phase
    off = sim.pass_offset[phase]
    start, end = sim.start - off, sim.end - off
    last = np.full(sched.n_ranks, -np.inf)
    np.maximum.at(last, o.rank[sel], end[sel])
    crit = int(np.argmax(last))
    mine = sel & (o.rank == crit)
    busy = mine & np.isin(o.kind, BUSY_KINDS) & (sim.durations > 0)
    comm = mine & ((o.kind == SEND) | (o.kind == RECV))
    compute_s = union_length(start[busy], end[busy])
    comm_s = union_length(start[comm], end[comm])
    recv = sel & (o.kind == RECV)
    dev = sched.device_of_rank
    by_rank = np.bincount(o.rank[recv], weights=o.size_bytes[recv], minlength=sched.n_ranks)
    cross = recv & ~topo.same_node(dev[o.rank], dev[np.maximum(o.peer, 0)])
    cross_rank = np.bincount(o.rank[cross], weights=o.size_bytes[cross], minlength=sched.n_ranks)
    work = sel & (o.kind == COMPUTE)
    flops_rank = np.bincount(o.rank[work], weights=o.flops[work], minlength=sched.n_ranks)
    scale = 1
    if sched.quotient is not None:        # the representatives' ranks stand for their orbits: every rank's numbers
        reps, scale = sched.quotient.reps, sched.quotient.orbit_size
        by_rank, cross_rank, flops_rank = by_rank[reps], cross_rank[reps], flops_rank[reps]
    flops = float(flops_rank.sum()) * scale
    makespan = sim.pass_makespan[phase]
    # the buffers' peak and the memory model's (with each op's workspace) from one sort of the events
    buffers, with_workspace = _peaks(sched, topo, phase, start, end, sim.rep_op)
    return PassMetrics(
        makespan_s=makespan, compute_s=compute_s, exposed_comm_s=max(makespan - compute_s, 0.0),
        comm_busy_s=comm_s, comm_bytes_per_gpu_max=float(by_rank.max()),
        inter_node_bytes_per_gpu_max=float(cross_rank.max()),
        compute_to_comm=compute_s / comm_s if comm_s > 0 else None,
        bytes_per_flop=float(by_rank.sum()) * scale / flops if flops else None,
        peak_memory_bytes=float(buffers.max()),
        peak_memory_total_bytes=model_total_bytes(topo.memory_model, float(with_workspace.max(initial=0.0))),
        work_imbalance=imbalance(flops_rank), recv_bytes_by_rank=by_rank, cross_bytes_by_rank=cross_rank,
        recv_bytes=float(by_rank.sum()) * scale, flops=flops, flops_by_rank=flops_rank)


def _peaks(sched: Schedule, topo: Topology, phase: int, start: np.ndarray, end: np.ndarray,
           rep_op: np.ndarray | None) -> tuple[np.ndarray, np.ndarray]:
    """:func:`~meshplan.plan.peaks.peak_memories` with each op's workspace; a quotient schedule whose orbits' ranks
    run kernels of other shapes (same times, other workspaces): the largest over each distinct member's shapes
    (:func:`~meshplan.plan.peaks.peak_memories_over`: one sort of the events for all)."""
    spec = topo.memory_model
    q = sched.quotient
    if q is None or q.member_s_q is None:
        return peak_memories(sched, phase, start, end, op_workspace_bytes(sched, spec), rep_op)
    distinct = {}                                  # the members' shapes, once each (a turned ring's: R / G of them)
    for k in range(q.member_s_q.shape[1]):
        s_q, s_kv = q.member_s_q[:, k], q.member_s_kv[:, k]
        distinct.setdefault(s_q.tobytes() + s_kv.tobytes(), (s_q, s_kv))
    buffers, totals = peak_memories_over(sched, phase, start, end, [op_workspace_bytes(sched, spec, s_q, s_kv)
                                                                    for s_q, s_kv in distinct.values()])
    return buffers, np.max(totals, axis=0)


def predicted(sched: Schedule, topo: Topology, sim: SimResult, ring_ccr: float | None) -> Prediction:
    """The prediction of a simulated schedule: :func:`pass_metrics` of every pass, :func:`combine`d."""
    return combine({PASS_NAMES[p]: pass_metrics(sched, topo, sim, p) for p in sched.passes}, ring_ccr)


def combine(parts: dict[str, PassMetrics], ring_ccr: float | None) -> Prediction:
    """A :class:`Prediction` of per-pass metrics: the total sums times over passes and folds the per-rank arrays
    (bytes and FLOPs by rank) before taking maxima; peaks are the larger pass's."""
    ps = list(parts.values())
    if len(ps) == 1:
        return Prediction(parts, ps[0], ring_ccr)
    recv = sum(p.recv_bytes_by_rank for p in ps)
    cross = sum(p.cross_bytes_by_rank for p in ps)
    flops = sum(p.flops for p in ps)
    recv_bytes = sum(p.recv_bytes for p in ps)     # not Σ recv: a closed form's arrays hold its busiest rank only
    by_rank = sum(p.flops_by_rank for p in ps)
    times = {k: sum(getattr(p, k) for p in ps) for k in ("makespan_s", "compute_s", "exposed_comm_s", "comm_busy_s")}
    total = PassMetrics(
        **times, comm_bytes_per_gpu_max=float(np.max(recv)), inter_node_bytes_per_gpu_max=float(np.max(cross)),
        compute_to_comm=times["compute_s"] / times["comm_busy_s"] if times["comm_busy_s"] else None,
        bytes_per_flop=recv_bytes / flops if flops else None,
        peak_memory_bytes=max(p.peak_memory_bytes for p in ps),
        peak_memory_total_bytes=max(p.peak_memory_total_bytes for p in ps),
        work_imbalance=imbalance(by_rank), recv_bytes_by_rank=recv, cross_bytes_by_rank=cross,
        recv_bytes=recv_bytes, flops=flops, flops_by_rank=by_rank)
    return Prediction(parts, total, ring_ccr)
