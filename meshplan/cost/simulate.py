"""Flow-level event simulation (docs/cost-model.md level L1) with max-min fair sharing.

Every transfer is a flow on its route: first its latency (alpha_sw + hop latencies), then its bytes,
sharing every link by max-min fairness (progressive filling) with per-flow caps, recomputed only on the
affected component of flows and links whenever a flow starts or ends. Compute ops run on their rank's
compute resource (capacity 1) or on a shared pool (CPU ranks sharing cores) shared the same way.
Overlap is not free: while a rank has an active transfer its compute proceeds at rate (1 − κ), κ the
largest of ``overlap_kappa`` over the link classes of its active transfers (Calculon's
``processor_usage``); and while a rank at either end of a flow computes, the flow's cap is scaled by
(1 − κ_t), κ_t the largest ``transfer_kappa`` on its route (CPU ranks copy bytes with the cores they compute
on; 0 on GPUs). On a shared pool a transfer is also CPU work: a flow whose route has a ``transfer_cpu_us_per_MB``
cost c is a user of the pool as well as of its links, taking c core-seconds per byte from the cores the ranks
compute on (docs/cost-model.md, "CPU ranks"); such a flow is solved in core-seconds (amount = bytes · c, its
links' weights 1/c), so max-min shares the pool between kernels and copies in one unit. Simultaneous events
are processed as one batch. Passes are timed separately
(the bwd pass starts after a barrier, :mod:`meshplan.plan.schedule` rule 5).

The semantics are those of :mod:`meshplan.plan.schedule`; items (ops and P2P batches) come from
:mod:`meshplan.plan.dataflow`; the symmetry reduction from :mod:`meshplan.cost.symmetry`.
"""

from __future__ import annotations

import heapq
import time
from dataclasses import dataclass

import numpy as np

from meshplan.cost.cost import CostModel
from meshplan.cost.maxmin import fair_rates
from meshplan.cost.symmetry import DURATION_TOLERANCE, Reduction, find_reduction, identity, link_orbit_rep
from meshplan.model.topology import Topology
from meshplan.plan.dataflow import build_items
from meshplan.plan.schedule import KIND, SEND, Schedule

_EPS = 1e-12


@dataclass
class SimResult:
    """Start and end (s) of every op (bwd ops offset by the fwd makespan), makespan per pass."""

    start: np.ndarray
    end: np.ndarray
    pass_makespan: dict[int, float]
    pass_offset: dict[int, float]
    reps: int
    events: int
    wall_s: float
    durations: np.ndarray
    exact: bool = True     # False: approximate symmetry reduction (orbit-max durations), see meshplan.cost.symmetry
    rep_op: np.ndarray | None = None   # each op's representative's (the reduction; None: every rank simulated)

    def json(self) -> dict:
        """The ``simulation`` object of ``simulate --json``: ranks simulated, exact, events, wall seconds."""
        return {"ranks_simulated": self.reps, "exact": self.exact, "events": self.events, "wall_s": self.wall_s}


def simulate(sched: Schedule, topo: Topology, *, reduce: bool = True, exact: bool = False) -> SimResult:
    """Simulate every pass of ``sched`` on ``topo``.

    A quotient schedule (:mod:`meshplan.plan.quotient`: only the representatives' ops, the others proved alike) is
    simulated as the reduction it is.

    Args:
        reduce: simulate one node's ranks when the others are alike (see :mod:`meshplan.cost.symmetry`).
        exact: refuse approximate reductions (durations equal only within 1%).
    Raises:
        UserError: the schedule needs more devices than the topology has.
    """
    from meshplan.core.errors import UserError

    if sched.device_of_rank.max(initial=0) >= topo.n_devices:
        raise UserError("--topo", f"the schedule maps ranks to device {sched.device_of_rank.max()} but "
                        f"{topo.name} has {topo.n_devices} devices", "simulate on a topology with as many devices")
    if (sched.ops.kind == KIND["collective"]).any():
        raise NotImplementedError("collective ops arrive with the baseline library (issue 5)")
    t0 = time.perf_counter()
    durations = CostModel(topo).op_durations(sched)
    quotient = sched.quotient                   # only the representatives' ops, proved alike (meshplan.plan.quotient)
    if quotient is not None:
        partner, red = quotient.partner, Reduction(quotient.reps, np.arange(len(sched.ops)))
    else:
        partner = sched.match_transfers()[0]
        red = find_reduction(sched, topo, durations, partner, 0.0 if exact else DURATION_TOLERANCE) \
            if reduce else identity(sched)
    if not red.exact:
        durations = red.durations[red.rep_op]
    n = len(sched.ops)
    start, end = np.full(n, np.nan), np.full(n, np.nan)
    makespan, offset, events, clock = {}, {}, 0, 0.0
    for phase in sched.passes:
        items = build_items(sched, phase, partner, ranks=red.reps)
        engine = _Engine(sched, topo, items, red, durations, partner)
        s_item, e_item = engine.run()
        events += engine.events
        ops = np.flatnonzero(sched.ops.phase == phase)
        rep_item = items.item_of_op[red.rep_op[ops]]
        start[ops], end[ops] = s_item[rep_item] + clock, e_item[rep_item] + clock
        makespan[phase], offset[phase] = float(np.max(e_item, initial=0.0)), clock
        clock += makespan[phase]
    return SimResult(start, end, makespan, offset, red.n_reps, events, time.perf_counter() - t0, durations, red.exact,
                     red.rep_op if red.n_reps < sched.n_ranks and quotient is None else None)


class _Engine:
    """The event loop over the representatives' items of one pass."""

    def __init__(self, sched, topo, items, red: Reduction, durations, partner) -> None:
        self.events = 0
        o = sched.ops
        self.n_items = k = items.n
        mp = items.member_ptr[: k + 1]
        self.members = items.members[: mp[-1]].tolist()
        self.member_ptr = mp.tolist()
        self.is_comm = items.is_comm[:k].tolist()
        self.remaining = np.diff(items.pred_ptr)[:k].tolist()
        self.succ_ptr = items.succ_ptr[: k + 1].tolist()
        self.succs = items.succs[: items.succ_ptr[k]].tolist()
        self.item_rank = items.rank[:k].tolist()
        mem = items.members[: mp[-1]]
        self.duration = dict(zip(mem.tolist(), durations[mem].tolist()))
        self.item_of_op = dict(zip(mem.tolist(), items.item_of_op[mem].tolist()))
        self.is_send = dict(zip(mem.tolist(), (o.kind[mem] == SEND).tolist()))
        self._setup_transfers(sched, topo, items, red, partner)
        self._setup_resources(sched, topo, red)

    # ------------------------------------------------------------------ set-up
    def _setup_transfers(self, sched, topo, items, red, partner) -> None:
        o = sched.ops
        mem = np.asarray(self.members, dtype=np.int64)
        comm = mem[(o.kind[mem] == SEND) | (o.kind[mem] == KIND["recv"])]
        p_rep = red.rep_op[partner[comm]]
        self.partner = dict(zip(comm.tolist(), p_rep.tolist()))
        sends = comm[o.kind[comm] == SEND]
        src = sched.device_of_rank[o.rank[sends]]
        dst = sched.device_of_rank[o.peer[sends]]
        lat, _ = topo.pair_stats(src, dst)
        kappa, tkappa = topo.kappa(), topo.transfer_kappa()
        cpu = topo.transfer_cpu_s_per_byte() if topo.pool_capacity is not None else np.zeros(len(kappa))
        pool_res = len(topo.link_capacity)               # the pool's resource id (_setup_resources appends it)
        self.flow, cache = {}, {}
        self.flow_tkap: dict[int, float] = {}   # send op -> its cap while an end rank computes (κ_t > 0)
        recv_rank = o.rank[red.rep_op[partner[sends]]]
        for s, a, b, la, size, rr in zip(sends.tolist(), src.tolist(), dst.tolist(), lat.tolist(),
                                         o.size_bytes[sends].tolist(), recv_rank.tolist()):
            key = (a, b)
            if key not in cache:
                route = topo.route(a, b)
                reps = route if red.n_reps == sched.n_ranks else \
                    link_orbit_rep(topo, route, None if sched.quotient is None else sched.quotient.node_rep)
                weights: dict[int, float] = {}
                for link in reps.tolist():
                    weights[link] = weights.get(link, 0.0) + 1.0
                cap = float(topo.link_flow_cap[route].min()) if len(route) else np.inf
                kap = float(kappa[topo.link_class[route]].max()) if len(route) else 0.0
                tkap = float(tkappa[topo.link_class[route]].max()) if len(route) else 0.0
                if tkap > 0.0:      # the slowed flow's cap: (1 − κ_t) × its uncontended rate
                    tkap = (tkap, min(cap, float(topo.link_capacity[route].min())) * (1.0 - tkap))
                c = float(cpu[topo.link_class[route]].max()) if len(route) else 0.0
                res = list(weights.items())
                if c > 0.0:         # CPU work too: the flow in core-seconds, a user of the pool
                    res = [(link, w / c) for link, w in res] + [(pool_res, 1.0)]
                    cap, tkap = cap * c, (tkap[0], tkap[1] * c) if tkap else tkap
                cache[key] = (res, cap, kap, tkap, c if c > 0.0 else 1.0)
            res, cap, kap, tkap, unit = cache[key]
            self.flow[s] = (la, float(size) * unit, res, cap, kap, int(o.rank[s]), int(rr))
            if tkap:
                self.flow_tkap[s] = tkap[1]

    def _setup_resources(self, sched, topo, red) -> None:
        self.res_cap = topo.link_capacity.tolist()
        base = len(self.res_cap)
        pool = topo.pool_capacity
        reps = red.reps.tolist()
        if pool is not None:
            self.compute_res = {r: base for r in reps}
            self.res_cap.append(float(pool))
        else:
            self.compute_res = {r: base + k for k, r in enumerate(reps)}
            self.res_cap.extend([1.0] * len(reps))
        self.res_users: dict[int, dict[int, float]] = {}

    # ------------------------------------------------------------------ the loop
    def run(self):
        k = self.n_items
        self.start, self.end = [np.nan] * k, [np.nan] * k
        self.ready = [0.0] * k
        self.pending = [self.member_ptr[i + 1] - self.member_ptr[i] for i in range(k)]
        self.posted: set[int] = set()
        self.heap: list = []
        self.seq = 0
        self.acts: dict[int, list] = {}      # id -> [remaining, rate, t_update, version, res, cap, kind, payload]
        self.rank_comm = {r: {} for r in self.compute_res}
        self.compute_act: dict[int, int] = {}  # rank -> active compute activity
        self.rank_flows: dict[int, set[int]] = {}  # rank -> its active flows slowed by its compute (κ_t > 0)
        self.next_act = 0
        self.dirty: set[int] = set()
        now = 0.0
        work = [i for i in range(k) if self.remaining[i] == 0]
        self._end_items(self._start_items(work, now), now)
        self._recompute(now)
        while self.heap:
            now = self.heap[0][0]
            horizon = now + _EPS * max(now, 1e-9)
            batch = []
            while self.heap and self.heap[0][0] <= horizon:
                batch.append(heapq.heappop(self.heap))
            self.events += 1
            for _, _, kind, aid, version in batch:
                self._fire(kind, aid, version, now)
            self._recompute(now)
        if any(e != e for e in self.end):
            raise RuntimeError("simulation stalled: the schedule deadlocks (run `meshplan validate`)")
        return np.asarray(self.start), np.asarray(self.end)

    def _push(self, t: float, kind: int, aid: int, version: int) -> None:
        self.seq += 1
        heapq.heappush(self.heap, (t, self.seq, kind, aid, version))

    def _fire(self, kind: int, aid: int, version: int, now: float) -> None:
        if kind == 1:  # latency over: the flow's bytes start
            self._flow_act(aid, now)
            return
        act = self.acts.get(aid)
        if act is None or act[3] != version:
            return
        del self.acts[aid]
        for r in act[4]:
            users = self.res_users[r[0]]
            del users[aid]
            self.dirty.add(r[0])
        tag, payload = act[6]
        if tag == "flow":
            if payload in self.flow_tkap:
                for rank in self.flow[payload][5:]:
                    self.rank_flows[rank].discard(aid)
            self._flow_done(payload, now)
        else:
            rank = self.item_rank[payload]
            del self.compute_act[rank]
            self._flows_dirty(rank)
            self._end_items([payload], now)

    def _flow_done(self, send_op: int, now: float) -> None:
        la, size, res, cap, kap, rs, rr = self.flow[send_op]
        for rank in (rs, rr):
            self._comm_count(rank, kap, -1)
        done = []
        for op in (send_op, self.partner[send_op]):
            item = self.item_of_op[op]
            self.pending[item] -= 1
            if self.pending[item] == 0:
                done.append(item)
        self._end_items(done, now)

    def _end_items(self, items: list[int], now: float) -> None:
        stack = list(items)
        while stack:
            i = stack.pop()
            self.end[i] = now
            ready = []
            for s in self.succs[self.succ_ptr[i]:self.succ_ptr[i + 1]]:
                self.remaining[s] -= 1
                if now > self.ready[s]:
                    self.ready[s] = now
                if self.remaining[s] == 0:
                    ready.append(s)
            stack.extend(self._start_items(ready, now))

    def _start_items(self, items: list[int], now: float) -> list[int]:
        """Start items; returns those that end at once (zero duration)."""
        instant = []
        for i in items:
            self.start[i] = now
            ops = self.members[self.member_ptr[i]:self.member_ptr[i + 1]]
            if self.is_comm[i]:
                for op in ops:
                    self.posted.add(op)
                    p = self.partner[op]
                    if p in self.posted:
                        self._start_flow(op if self.is_send[op] else p, now)
            else:
                d = self.duration[ops[0]]
                if d <= 0.0:
                    instant.append(i)
                else:
                    rank = self.item_rank[i]
                    aid = self._new_act(d, [(self.compute_res[rank], 1.0)], 1.0, ("compute", i), now)
                    self.compute_act[rank] = aid
                    self._flows_dirty(rank)
        return instant

    def _start_flow(self, send_op: int, now: float) -> None:
        la, size, res, cap, kap, rs, rr = self.flow[send_op]
        for rank in (rs, rr):
            self._comm_count(rank, kap, +1)
        if la > 0.0:
            self._push(now + la, 1, send_op, 0)
        else:
            self._flow_act(send_op, now)

    def _flow_act(self, send_op: int, now: float) -> None:
        """The flow's bytes start moving (after its latency)."""
        la, size, res, cap, kap, rs, rr = self.flow[send_op]
        aid = self._new_act(size, res, cap, ("flow", send_op), now)
        if send_op in self.flow_tkap:
            for rank in (rs, rr):
                self.rank_flows.setdefault(rank, set()).add(aid)

    def _flows_dirty(self, rank: int) -> None:
        """A rank started or stopped computing: its κ_t-slowed flows need new rates."""
        for aid in self.rank_flows.get(rank, ()):
            self.dirty.add(self.acts[aid][4][0][0])

    def _comm_count(self, rank: int, kap: float, delta: int) -> None:
        if kap <= 0.0:
            return
        counts = self.rank_comm[rank]
        counts[kap] = counts.get(kap, 0) + delta
        if counts[kap] == 0:
            del counts[kap]
        aid = self.compute_act.get(rank)
        if aid is not None:
            self.dirty.add(self.compute_res[rank])

    def _new_act(self, amount: float, res, cap: float, payload, now: float) -> int:
        aid = self.next_act
        self.next_act += 1
        self.acts[aid] = [amount, 0.0, now, 0, res, cap, payload]
        for r, w in res:
            self.res_users.setdefault(r, {})[aid] = w
            self.dirty.add(r)
        return aid

    # ------------------------------------------------------------------ max-min
    def _compute_cap(self, aid: int, act) -> float:
        if act[6][0] != "compute":
            slowed = self.flow_tkap.get(act[6][1])
            if slowed is None:
                return act[5]
            _, _, _, _, _, rs, rr = self.flow[act[6][1]]
            return slowed if rs in self.compute_act or rr in self.compute_act else act[5]
        counts = self.rank_comm[self.item_rank[act[6][1]]]
        return 1.0 - max(counts) if counts else 1.0

    def _recompute(self, now: float) -> None:
        """Re-solve max-min on every connected component (flows, links) touched since the last call."""
        dirty, self.dirty = self.dirty, set()
        seen: set[int] = set()
        for r0 in dirty:
            if r0 in seen:
                continue
            users = self.res_users.get(r0)
            if users is not None and len(users) == 1:       # one activity, on this resource alone (a rank's
                aid = next(iter(users))                     # kernel): its own component, solved as below
                act = self.acts[aid]
                if len(act[4]) == 1:
                    seen.add(r0)
                    self._set_rate(aid, act, min(self._compute_cap(aid, act), self.res_cap[r0] / act[4][0][1]), now)
                    continue
            comp, stack = set(), [r0]
            while stack:
                r = stack.pop()
                if r in seen:
                    continue
                seen.add(r)
                for aid in self.res_users.get(r, ()):
                    if aid not in comp:
                        comp.add(aid)
                        stack.extend(x[0] for x in self.acts[aid][4])
            if len(comp) == 1:
                aid = comp.pop()
                act = self.acts[aid]
                rate = min([self._compute_cap(aid, act)] + [self.res_cap[r] / w for r, w in act[4]])
                self._set_rate(aid, act, rate, now)
            elif comp:
                rates = fair_rates({a: self.acts[a] for a in comp}, self.res_cap, self._compute_cap)
                for aid, rate in rates.items():
                    self._set_rate(aid, self.acts[aid], rate, now)

    def _set_rate(self, aid: int, act: list, rate: float, now: float) -> None:
        if act[1] != rate:
            act[0] -= act[1] * (now - act[2])
            act[1], act[2] = rate, now
            act[3] += 1
            self._push(now + max(act[0], 0.0) / rate, 0, aid, act[3])
