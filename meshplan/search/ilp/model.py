"""Optimal stream orders by CP-SAT (OR-Tools): the schedule as a job shop with shared links, and its proven bound.

The model (docs/cost-model.md, "Scheduling notes"), in integer nanoseconds, one pass after another (a barrier between
them, :mod:`meshplan.plan.schedule` rule 5):

* an interval per item of :func:`meshplan.plan.dataflow.build_items` — a compute, merge, accumulate, alloc or free op
  (its duration alone, :meth:`meshplan.cost.cost.CostModel.op_durations`; zero-time ops take 1 ns so that stream
  order stays defined), or a P2P batch (variable length: it ends after its last transfer);
* a transfer, at its uncontended alpha-beta time (:func:`meshplan.cost.bounds.transfer_seconds`), starts once both
  its send's and its recv's batches are posted and ends before either batch ends; its interval (what links
  carry) is the part after the latency α;
* no-overlap per (rank, stream) — the order on each stream is what the solver chooses — and per rank over its
  compute-like items (one compute resource per rank, as in the simulator);
* cumulative per link whose flows could exceed it: each transfer demands its uncontended rate, the link its
  capacity (a contended flow waits instead of slowing down: the simulator shares by max-min fairness); the
  CPU core pool (``pool_capacity``) is a cumulative over every rank's compute;
* precedence for every data dependency (buffer reuse included: the builders express it as deps), for every
  access order the hazard rules need (:func:`meshplan.plan.hazards.hazard_orders`: the greedy order may provide
  it through stream order alone, so it becomes a dep in the reordered schedule), and FIFO order per (stream,
  peer) for sends and for recvs, so transfers still match the same partners;
* a reservoir per rank over its buffers (allocated when the allocating op starts, freed when the last op of
  ``free_after`` ends), at most what the device's memory leaves beside the rank's resident tensors, or the
  greedy order's level if that is higher (``memory_bytes=0``: the greedy level, so no time is bought with
  memory);
* objective: the makespan of the last pass.

The greedy order is first timed in this model by list scheduling (:mod:`meshplan.search.ilp.hint`) — the
baseline (``greedy_s``), the buffer levels, and a complete feasible hint — then the solver frees the stream
orders for the rest of the limit.

Where every node runs its node-0 counterpart's program (:mod:`meshplan.cost.symmetry`, exact reductions only), only
node 0's ranks are modelled, each flow counted on the node-0 copy of every link it crosses (as the simulator
does), and every rank takes its representative's order.

The solver's order is then written into a copy of the schedule (:func:`apply_order`: ops renumbered per rank by
the solver's start times) and re-simulated by the caller; the simulator's overlap penalty (κ) and fair sharing are
not in this model, so ``objective_s`` and ``bound_s`` are the solver's own. Overlap-free model: a job shop with
shared resources, NP-hard in general (Mesh and CHARM+ blocks need two inputs: an assembly flow shop).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import numpy as np

from meshplan.cost.bounds import transfer_seconds
from meshplan.cost.cost import CostModel
from meshplan.cost.symmetry import find_reduction, identity, link_orbit_rep
from meshplan.model.topology import Topology
from meshplan.plan.dataflow import build_items
from meshplan.plan.hazards import hazard_orders
from meshplan.plan.schedule import RECV, SEND, Schedule
from meshplan.search.ilp.hint import BUSY, SCALE, greedy_solution
from meshplan.search.ilp.order import apply_order, orbit_pairs


@dataclass
class IlpResult:
    """What the solver returned. Times in seconds of the solver's own model (no overlap penalty).

    ``start_s``: [n_ops] start of every op (its item's), None without a solution of the solver's own. ``greedy_s``:
    the greedy order timed in the same model (list scheduling), the solver's starting point; with ``status``
    ``unknown`` it is also ``objective_s`` (the incumbent), against the bound the solver proved, if any."""

    status: str
    objective_s: float | None
    bound_s: float | None
    solve_s: float
    n_intervals: int
    start_s: np.ndarray | None = None
    greedy_s: float | None = None     # the greedy order's makespan in this model (list-scheduled)
    orders: tuple[np.ndarray, np.ndarray] | None = None   # hazard op pairs to keep as deps (apply_order)

    @property
    def gap(self) -> float | None:
        """(objective − bound) / objective, None without a solution."""
        if self.objective_s is None or self.bound_s is None or self.objective_s <= 0:
            return None
        return max(0.0, (self.objective_s - self.bound_s) / self.objective_s)


def _ns(seconds: np.ndarray) -> np.ndarray:
    return np.ceil(np.asarray(seconds, dtype=np.float64) * 1e9).astype(np.int64)


def model_size(sched: Schedule, topo: Topology) -> int:
    """Intervals the model would hold: one per item (an op, or a batch of sends and recvs) and one per transfer,
    of the representative ranks where the schedule is symmetric."""
    partner = sched.match_transfers()[0]
    red, rep_partner = _reduction(sched, topo, CostModel(topo).op_durations(sched), partner)
    items = sum(build_items(sched, p, rep_partner, ranks=red.reps).n for p in sched.passes)
    return items + int(((sched.ops.kind == SEND) & np.isin(sched.ops.rank, red.reps)).sum())


def _reduction(sched: Schedule, topo: Topology, durations_s: np.ndarray, partner: np.ndarray):
    """(the exact symmetry reduction — none with a shared core pool, which spans all ranks —, each op's partner
    mapped to its representative)."""
    red = identity(sched) if topo.pool_capacity is not None else find_reduction(sched, topo, durations_s, partner, 0.0)
    return red, np.where(partner >= 0, red.rep_op[np.maximum(partner, 0)], -1)


class _Model:
    """Builds the CP-SAT model of one schedule (see the module docstring)."""

    def __init__(self, sched: Schedule, topo: Topology, memory: bool) -> None:
        from ortools.sat.python import cp_model

        self.cp = cp_model
        self.m = cp_model.CpModel()
        self.sched, self.topo = sched, topo
        o = sched.ops
        self.partner = sched.match_transfers()[0]
        self.dur = _ns(CostModel(topo).op_durations(sched))
        self.tr = np.maximum(_ns(transfer_seconds(sched, topo, self.partner)), 1)
        src = np.where(o.kind == SEND, o.rank, o.peer)
        dst = np.where(o.kind == SEND, o.peer, o.rank)
        comm = self.partner >= 0
        dev = sched.device_of_rank
        self.lat = np.where(comm, np.floor(topo.pair_stats(dev[np.where(comm, src, 0)],
                                                           dev[np.where(comm, dst, 0)])[0] * 1e9), 0).astype(np.int64)
        # symmetric ranks modelled once (exact reductions only; not with a shared core pool, which spans all ranks)
        self.red, self.rep_partner = _reduction(sched, topo, self.dur / 1e9, self.partner)
        self.reduced = self.red.n_reps < sched.n_ranks
        self.items = {p: build_items(sched, p, self.rep_partner, ranks=self.red.reps) for p in sched.passes}
        self.horizon = int(sum(max(int(self.dur[o.phase == p].sum()), 1) for p in sched.passes)
                           + self.tr[o.kind == SEND].sum() + 1) + 2 * len(o)
        self.start: dict[tuple[int, int], object] = {}
        self.end: dict[tuple[int, int], object] = {}
        self.interval: dict[tuple[int, int], object] = {}
        self.transfers: list[tuple[int, object]] = []   # (send op, interval)
        self.n_intervals = 0
        self.memory = memory
        self.buffers: dict[int, list] = {}
        self.orders: list[tuple[np.ndarray, np.ndarray]] = []   # hazard (a, b) op pairs, per pass
        # what the list-scheduling hint (meshplan.search.ilp.hint) needs
        self.prec: dict[int, dict[str, set]] = {}      # pass -> {"end": b after a ends, "start": b after a starts}
        self.busy: dict[int, dict[int, list]] = {}     # pass -> rank -> its compute-like items
        self.xinfo: list[tuple] = []                   # per transfer: (pass, item a, item b, α ns, ns, x_s, x_e)
        self.link_demand: dict[int, list] = {}         # transfer -> [(link, demand)] where a cumulative binds
        self.pool_cap: int | None = None
        self.pass_end: dict[int, object] = {}
        self.comm_size: dict[tuple[int, int], object] = {}
        self.free_info: list[tuple] = []               # per buffer: (free var, pass, alloc item, free items)

    def build(self):
        """Every constraint; returns the objective variable."""
        m, prev_end = self.m, None
        for p, items in self.items.items():
            pass_end = m.NewIntVar(0, self.horizon, f"end_p{p}")
            self.pass_end[p] = pass_end
            self._items(p, items, prev_end)
            for i in range(items.n):
                m.Add(pass_end >= self.end[p, i])
            self._transfers(p, items)
            self._precedence(p, items)
            self._streams(p, items)
            if self.memory:
                self._buffers(p, items)
            prev_end = pass_end
        self._links()
        self._pool()
        m.Minimize(prev_end)
        return prev_end

    def _items(self, p: int, items, barrier) -> None:
        """The pass's item intervals, after ``barrier`` (the previous pass's end)."""
        m, o = self.m, self.sched.ops
        for i in range(items.n):
            members = items.members[items.member_ptr[i]:items.member_ptr[i + 1]]
            s = m.NewIntVar(0, self.horizon, f"s{p}_{i}")
            if items.is_comm[i]:
                e = m.NewIntVar(0, self.horizon, f"e{p}_{i}")
                size = m.NewIntVar(1, self.horizon, f"d{p}_{i}")
                self.comm_size[p, i] = size
                iv = m.NewIntervalVar(s, size, e, f"b{p}_{i}")
            else:
                d = max(int(self.dur[members[0]]), 1) if o.kind[members[0]] in BUSY else 1
                e = m.NewIntVar(0, self.horizon, f"e{p}_{i}")
                iv = m.NewIntervalVar(s, d, e, f"o{p}_{i}")
            if barrier is not None:
                m.Add(s >= barrier)
            self.start[p, i], self.end[p, i], self.interval[p, i] = s, e, iv
            self.n_intervals += 1

    def _transfers(self, p: int, items) -> None:
        m, o = self.m, self.sched.ops
        sends = items.ops[o.kind[items.ops] == SEND]
        for s in sends.tolist():
            r = int(self.rep_partner[s])
            a, b = int(items.item_of_op[s]), int(items.item_of_op[r])
            x_s = m.NewIntVar(0, self.horizon, f"xs{s}")
            x_e = m.NewIntVar(0, self.horizon, f"xe{s}")
            lat = min(int(self.lat[s]), int(self.tr[s]) - 1)
            m.Add(x_e == x_s + int(self.tr[s]))
            iv = m.NewIntervalVar(x_s + lat, int(self.tr[s]) - lat, x_e, f"x{s}")  # links carry the bytes after α
            for item in (a, b):
                m.Add(x_s >= self.start[p, item])
                m.Add(self.end[p, item] >= x_e)
            self.transfers.append((s, iv))
            self.xinfo.append((p, a, b, lat, int(self.tr[s]), x_s, x_e))
            self.n_intervals += 1

    def _precedence(self, p: int, items) -> None:
        """Data deps (not the stream predecessor: that order is the solver's) and FIFO order per channel."""
        m, o = self.m, self.sched.ops
        ops = items.ops
        counts = np.diff(o.dep_ptr)[ops]
        owner = np.repeat(ops, counts)
        deps = o.deps[np.repeat(o.dep_ptr[ops] - np.cumsum(counts) + counts, counts) + np.arange(counts.sum())]
        keep = o.phase[deps] == p
        src, dst = items.item_of_op[deps[keep]], items.item_of_op[owner[keep]]
        pairs = {(int(a), int(b)) for a, b in zip(src.tolist(), dst.tolist()) if a != b}
        comm = ops[(o.kind[ops] == SEND) | (o.kind[ops] == RECV)]
        key = np.stack([o.rank[comm], o.stream[comm], o.kind[comm], o.peer[comm]], axis=1)
        order = np.lexsort((comm, key[:, 3], key[:, 2], key[:, 1], key[:, 0]))
        comm, key = comm[order], key[order]
        same = np.r_[False, (key[1:] == key[:-1]).all(axis=1)]
        for k in np.flatnonzero(same).tolist():
            a, b = int(items.item_of_op[comm[k - 1]]), int(items.item_of_op[comm[k]])
            if a != b:
                m.Add(self.start[p, b] >= self.start[p, a])
                self.prec.setdefault(p, {"end": set(), "start": set()})["start"].add((a, b))
        h_a, h_b = hazard_orders(self.sched, items)
        self.orders.append((h_a, h_b))
        pairs |= {(int(a), int(b)) for a, b in zip(items.item_of_op[h_a].tolist(), items.item_of_op[h_b].tolist())}
        for a, b in pairs:
            m.Add(self.start[p, b] >= self.end[p, a])
        self.prec.setdefault(p, {"end": set(), "start": set()})["end"].update(pairs)

    def _streams(self, p: int, items) -> None:
        """No-overlap per stream and per rank's compute; the greedy stream order recorded for the hint."""
        m, o = self.m, self.sched.ops
        first = items.members[items.member_ptr[:-1]]
        groups: dict[tuple, list] = {}
        busy: dict[int, list] = {}
        for i, op in enumerate(first.tolist()):
            groups.setdefault((int(o.rank[op]), int(o.stream[op])), []).append(i)
            if o.kind[op] in BUSY:
                busy.setdefault(int(o.rank[op]), []).append((int(o.stream[op]), self.interval[p, i], i))
        for seq in groups.values():     # items are numbered in (rank, stream, program) order
            if len(seq) > 1:
                m.AddNoOverlap([self.interval[p, i] for i in seq])
                self.prec.setdefault(p, {"end": set(), "start": set()})["end"].update(zip(seq, seq[1:]))
        for r, entries in busy.items():
            if len({s for s, _, _ in entries}) > 1:
                m.AddNoOverlap([iv for _, iv, _ in entries])
            self.busy.setdefault(p, {})[r] = [i for _, _, i in entries]

    def _buffers(self, p: int, items) -> None:
        """Per rank, its buffers allocated by an op of this pass and freed after ops of it: (size in KiB, alloc
        item's start, a variable for the end of the last op they are freed after)."""
        m, t, o = self.m, self.sched.tensors, self.sched.ops
        sel = np.flatnonzero((t.alloc_op >= 0) & (np.diff(t.free_ptr) > 0) & np.isin(t.rank, self.red.reps))
        sel = sel[o.phase[t.alloc_op[sel]] == p]
        for tid in sel.tolist():
            frees = t.free_after[t.free_ptr[tid]:t.free_ptr[tid + 1]]
            frees = frees[o.phase[frees] == p]
            if not len(frees):
                continue
            a = int(items.item_of_op[t.alloc_op[tid]])
            free = m.NewIntVar(0, self.horizon, f"free{tid}")
            f_items = np.unique(items.item_of_op[frees]).tolist()
            m.AddMaxEquality(free, [self.end[p, int(i)] for i in f_items])
            self.free_info.append((free, p, a, f_items))
            m.Add(free >= self.start[p, a])
            size = max(1, int(math.ceil(t.size_bytes[tid] / 1024)))
            self.buffers.setdefault(int(t.rank[tid]), []).append((size, self.start[p, a], free))

    def add_reservoirs(self, value, memory_bytes: float | None) -> None:
        """Each rank's buffers at most at the larger of the level they reach under ``value`` (a solution's variable
        values: the greedy order's) and what ``memory_bytes`` per device leaves beside the rank's resident
        tensors (those alive from the start of a pass); none where all its buffers fit at once."""
        t = self.sched.tensors
        for rank, bufs in self.buffers.items():
            events = sorted([(value(a), size) for size, a, _ in bufs] + [(value(f), -size) for size, _, f in bufs],
                            key=lambda e: (e[0], e[1]))
            cap = int(np.cumsum([d for _, d in events]).max(initial=0))
            if memory_bytes is not None:
                resident = float(t.size_bytes[(t.rank == rank) & (t.alloc_op < 0)].sum())
                cap = max(cap, int((memory_bytes - resident) // 1024))
            if sum(size for size, _, _ in bufs) <= cap:
                continue
            # a reservoir of +size at allocation and -size at the free, written as a cumulative over each
            # buffer's lifetime (CP-SAT propagates cumulatives far better: a reservoir stalled it at 350 ops)
            lives = [self.m.NewIntervalVar(a, self.m.NewIntVar(0, self.horizon, ""), f, "") for _, a, f in bufs]
            self.m.AddCumulative(lives, [size for size, _, _ in bufs], max(cap, 1))

    def _links(self) -> None:
        """Cumulative per link on which the transfers' uncontended rates could add up past its capacity."""
        if not self.transfers:
            return
        o, topo, dev = self.sched.ops, self.topo, self.sched.device_of_rank
        sends = np.asarray([s for s, _ in self.transfers])
        src, dst = dev[o.rank[sends]], dev[o.peer[sends]]
        _, bw = topo.pair_stats(src, dst)
        per_link: dict[int, list] = {}
        for k, (a, b) in enumerate(zip(src.tolist(), dst.tolist())):
            route = topo.route(a, b)
            links = link_orbit_rep(topo, route) if self.reduced else route   # each flow on node 0's copies
            for link, times in zip(*np.unique(links, return_counts=True)):
                per_link.setdefault(int(link), []).append((k, int(times)))
        for link, entries in per_link.items():
            cap = float(topo.link_capacity[link])
            ks = [k for k, _ in entries]
            rate = np.minimum(bw[ks], cap) * np.asarray([w for _, w in entries])
            if rate.sum() <= cap * (1 + 1e-9):
                continue
            demand = np.minimum(np.ceil(rate / cap * SCALE), SCALE).astype(int).tolist()
            self.m.AddCumulative([self.transfers[k][1] for k in ks], demand, SCALE)
            for k, d in zip(ks, demand):
                self.link_demand.setdefault(k, []).append((link, d))

    def _pool(self) -> None:
        """CPU ranks sharing ``pool_capacity`` cores: a cumulative over every rank's compute."""
        pool = self.topo.pool_capacity
        if pool is None:
            return
        o = self.sched.ops
        ivs = [self.interval[p, i] for p, items in self.items.items() for i in range(items.n)
               if not items.is_comm[i] and o.kind[items.members[items.member_ptr[i]]] in BUSY]
        if len(ivs) > 1:
            self.pool_cap = max(SCALE, int(round(pool * SCALE)))
            self.m.AddCumulative(ivs, [SCALE] * len(ivs), self.pool_cap)


def solve(sched: Schedule, topo: Topology, *, time_limit_s: float = 10.0, workers: int = 0, seed: int = 0,
          memory: bool = True, memory_bytes: float | None = None) -> IlpResult:
    """Solve the schedule model of ``sched`` on ``topo`` (module docstring).

    Args:
        time_limit_s: the solver's wall-clock limit (building the model and its hint come on top: ``solve_s`` has
            both); at it, the best order found and the proven bound are returned.
        workers: CP-SAT search workers (0: one per core).
        memory: bound each rank's buffers (a reservoir) by the larger of the greedy order's level and what
            ``memory_bytes`` per device (default: the topology's) leaves beside its resident tensors
            (``memory_bytes=0``: never above the greedy order's level).
    Returns:
        :class:`IlpResult`; ``status`` is always set (``unknown``: no solution within the limit).
    Raises:
        ValueError: ``time_limit_s`` not positive.
    """
    if not time_limit_s > 0:
        raise ValueError("time_limit_s must be positive")
    t0 = time.perf_counter()
    model = _Model(sched, topo, memory)
    objective = model.build()
    cp, m = model.cp, model.m
    problem = m.Validate()
    if problem:
        raise RuntimeError(f"internal error: invalid CP-SAT model: {problem}")
    # the greedy order, timed in this model by list scheduling: the baseline, the buffer levels, a complete hint
    value, greedy_ns = greedy_solution(model)
    greedy_s = greedy_ns / 1e9
    model.add_reservoirs(lambda v: value[v], topo.memory_bytes if memory_bytes is None else memory_bytes)
    for var, x in value.items():
        m.AddHint(var, int(x))
    # phase 2: free stream orders, from there
    solver = _solver(cp, time_limit_s, workers, seed)     # the solver's own limit; building the model comes on top
    code = solver.Solve(m)
    if code == cp.MODEL_INVALID:
        raise RuntimeError(f"internal error: invalid CP-SAT model: {m.Validate()}")
    status = {cp.OPTIMAL: "optimal", cp.FEASIBLE: "feasible", cp.INFEASIBLE: "infeasible"}.get(code, "unknown")
    solve_s = time.perf_counter() - t0
    if status == "unknown":
        # no solution of its own (with several workers CP-SAT may not get to the hint in time): the greedy
        # hint is the incumbent, in the same model, against whatever bound the solver proved
        bound = float(solver.BestObjectiveBound()) / 1e9
        return IlpResult(status, greedy_s, min(bound, greedy_s) if bound > 0 else None, solve_s, model.n_intervals,
                         greedy_s=greedy_s)
    if status != "optimal" and status != "feasible":
        return IlpResult(status, None, None, solve_s, model.n_intervals, greedy_s=greedy_s)
    start = np.full(len(sched.ops), -1, dtype=np.int64)
    for p, items in model.items.items():
        item_start = np.asarray([solver.Value(model.start[p, i]) for i in range(items.n)], dtype=np.int64)
        start[items.ops] = item_start[items.item_of_op[items.ops]]
    start = start[model.red.rep_op]          # every rank takes its representative's order, position by position
    bound = min(float(solver.BestObjectiveBound()), float(solver.Value(objective)))
    orders = tuple(np.concatenate(x) for x in zip(*model.orders)) if model.orders else None
    if orders is not None and model.reduced:
        orders = orbit_pairs(sched, model.red.rep_op, *orders)
    return IlpResult(status, solver.Value(objective) / 1e9, bound / 1e9, solve_s, model.n_intervals, start / 1e9,
                     greedy_s, orders)


def _solver(cp, seconds: float, workers: int, seed: int):
    solver = cp.CpSolver()
    solver.parameters.max_time_in_seconds = float(seconds)
    solver.parameters.num_workers = int(workers)
    solver.parameters.random_seed = int(seed)
    return solver


__all__ = ["IlpResult", "apply_order", "model_size", "solve"]
