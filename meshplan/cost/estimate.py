"""A contended closed form: the simulator's sharing rules applied to time-averaged loads (no event loop).

The uncontended evaluation (:func:`meshplan.plan.dataflow.evaluate`, L0) times every op alone. The simulator (L1)
shares each link max-min fairly among the flows crossing it, shares a compute pool (CPU ranks on a few cores)
among the ranks computing, slows a rank's kernel by κ while that rank communicates, and slows a flow by κ_t while
one of its ranks computes (docs/cost-model.md). This estimate keeps L1's rules but replaces its event loop by a
mean-field fixed point, in the manner of analytic network models (bandwidth shared by the average load):

1. evaluate the schedule's dataflow with the current op durations (max-plus, vectorised);
2. from the op intervals, each activity's use of each resource at its actual mean rate (its work over its
   width), and per activity the time-averaged total use of each of its resources over its interval,
   ``L = (1/|I_a|) ∫_{I_a} Σ_b use_b dt``, by a per-resource sweep (prefix integrals, one sort); where L exceeds
   the capacity C the activity takes width · L / C (never less than alone). Kernels on a shared CPU pool take
   their max-min fair share of what the flows leave, averaged over their interval by a second sweep. The
   fraction of a kernel's time its rank communicates gives its κ slowdown, the fraction of a flow's time an end
   rank computes its κ_t;
3. new durations (transfers keep their latency), all the way in the first round, half-way in the second.

It has no bound property; it is the planner's estimate where simulating costs too much (``plan_batch``: seconds
at 64+ ranks against milliseconds here). Its error against the simulator is tested on fuzzed packed batches
(``tests/cost/test_estimate.py``).
"""

from __future__ import annotations

import numpy as np

from meshplan.model.topology import Topology
from meshplan.plan.dataflow import Evaluation, Items, evaluate
from meshplan.plan.schedule import BUSY_KINDS, SEND, Schedule

ROUNDS = 2
#: how far each round moves the durations toward the new ones: all the way first (from L0's uncontended
#: durations), half-way after (the fixed point of a mean-field model can oscillate; 2 rounds so damped are within
#: 5% of the simulator on the fuzzed batches of tests/cost/test_estimate.py)
DAMPING = (1.0, 0.5)


def contended_evaluation(sched: Schedule, topo: Topology, items: Items, duration: np.ndarray,
                         transfer_s: np.ndarray, first: Evaluation | None = None,
                         rounds: int = ROUNDS) -> Evaluation:
    """The evaluation of one pass (``items``, every rank's) with durations stretched by contention and overlap
    (module docstring).

    Args:
        duration: [n_ops] seconds of each compute/merge op alone (:meth:`CostModel.op_durations`).
        transfer_s: [n_ops] seconds of the transfer each send/recv takes part in, alone on its route.
        first: the uncontended evaluation of ``items`` with these durations, when the caller has it.
    Raises:
        RuntimeError: the schedule deadlocks.
    """
    o = sched.ops
    flows = _Flows(sched, topo, items.partner, items.phase, transfer_s)
    busy = np.flatnonzero((o.phase == items.phase) & np.isin(o.kind, BUSY_KINDS) & (duration > 0))
    share = _Sharing(sched, topo, flows, busy)
    d, tr = duration.copy(), transfer_s.copy()
    ev = first if first is not None else evaluate(items, d, tr)
    for k in range(rounds):
        if not ev.complete:
            raise RuntimeError("the schedule deadlocks (run meshplan validate)")
        start = ev.start[items.item_of_op]
        c_start = start[busy]
        f_start = np.maximum(start[flows.send], start[flows.recv])
        comp_new, flow_new = _stretched(sched, flows, share, f_start, f_start + tr[flows.send], busy, c_start,
                                        c_start + d[busy], duration)
        a = DAMPING[min(k, len(DAMPING) - 1)]
        d[busy] = (1 - a) * d[busy] + a * comp_new
        t = (1 - a) * tr[flows.send] + a * flow_new
        tr[flows.send] = tr[flows.recv] = t
        ev = evaluate(items, d, tr)
    return ev


class _Flows:
    """Every matched transfer of a schedule: its send and recv ops, ranks, route and uncontended time."""

    def __init__(self, sched: Schedule, topo: Topology, partner: np.ndarray, phase: int,
                 transfer_s: np.ndarray) -> None:
        o, dev = sched.ops, sched.device_of_rank
        self.send = np.flatnonzero((o.kind == SEND) & (partner >= 0) & (o.phase == phase))
        self.recv = partner[self.send]
        self.src_rank, self.dst_rank = o.rank[self.send], o.rank[self.recv]
        src, dst = dev[self.src_rank], dev[self.dst_rank]
        self.latency_s, self.rate = topo.pair_stats(src, dst)
        self.alone_s = transfer_s[self.send]
        # incidence (flow, link), a link listed twice on a route counted twice
        self.inc_flow, self.inc_link = topo.route_incidence(src, dst)
        cls = topo.link_class[self.inc_link]
        self.kappa, self.tkappa = np.zeros(len(self.send)), np.zeros(len(self.send))
        np.maximum.at(self.kappa, self.inc_flow, topo.kappa()[cls])
        np.maximum.at(self.tkappa, self.inc_flow, topo.transfer_kappa()[cls])
        self.cpu_per_byte = None
        self.pool = topo.pool_capacity
        if topo.pool_capacity is not None:
            self.cpu_per_byte = np.zeros(len(self.send))
            np.maximum.at(self.cpu_per_byte, self.inc_flow, topo.transfer_cpu_s_per_byte()[cls])


class _Sharing:
    """The (activity, resource, demand) incidences that can contend, fixed for a pass: activities are the compute
    ops, then the flows; resources the links, then each rank's compute, then the pool (CPU ranks share their
    cores). A resource whose users' demands together fit its capacity (a link one flow crosses, a rank's compute
    with one compute stream) never slows anyone and is left out."""

    def __init__(self, sched: Schedule, topo: Topology, flows: _Flows, busy: np.ndarray) -> None:
        o = sched.ops
        n_links, n_ranks, pool = len(topo.link_capacity), sched.n_ranks, topo.pool_capacity
        nc = len(busy)
        rate = np.where(np.isfinite(flows.rate), flows.rate, 0.0)
        compute_res = np.full(nc, n_links + n_ranks) if pool is not None else n_links + o.rank[busy]
        act, res, dem = [np.arange(nc), nc + flows.inc_flow], [compute_res, flows.inc_link], [np.ones(nc),
                                                                                              rate[flows.inc_flow]]
        if pool is not None and flows.cpu_per_byte is not None:
            used = flows.cpu_per_byte * rate            # core-seconds per second a flow takes from the pool
            on = np.flatnonzero(used > 0)
            act.append(nc + on)
            res.append(np.full(len(on), n_links + n_ranks))
            dem.append(used[on])
        act, res, dem = np.concatenate(act), np.concatenate(res), np.concatenate(dem)
        cap = np.concatenate([topo.link_capacity, np.ones(n_ranks), [pool if pool is not None else 1.0]])
        total = np.bincount(res, weights=dem, minlength=len(cap))
        may = total > cap * (1 + 1e-9)
        if pool is None:                                # a rank's compute contends only across its streams
            streams = np.unique(o.rank[busy] * (int(o.stream.max(initial=0)) + 1) + o.stream[busy])
            ranks_multi = np.bincount(streams // (int(o.stream.max(initial=0)) + 1), minlength=n_ranks) > 1
            may[n_links:n_links + n_ranks] &= ranks_multi
        keep = may[res]
        self.act, self.res, self.dem, self.cap = act[keep], res[keep], dem[keep], cap[res[keep]]
        self.n_act = nc + len(flows.send)


def _stretched(sched, flows: _Flows, share: _Sharing, f_start, f_end, busy, c_start, c_end, alone):
    """(new durations of the compute ops ``busy``, new times of the flows) from the current intervals.

    Each activity uses its resources at its actual mean rate over its current interval (its work over its
    width: a stretched kernel uses less than a core); where a resource's time-averaged use over an activity's
    interval, L, exceeds its capacity C the activity takes width · L / C (its share scaled down to fit), never less
    than it takes alone (slowed by κ where its rank communicates)."""
    o = sched.ops
    nc, n_ranks = len(busy), sched.n_ranks
    moving = np.minimum(f_start + flows.latency_s, f_end)          # a flow's bytes move after its latency
    width = np.concatenate([c_end - c_start, f_end - moving])
    work = np.concatenate([alone[busy], np.maximum(flows.alone_s - flows.latency_s, 0.0)])
    need = np.zeros(share.n_act)                                    # max over its resources of L / C
    if len(share.act):
        ratio = np.where(width > 0, work / np.where(width > 0, width, 1.0), 1.0)
        load = _mean_load(share.act, share.res, share.dem * ratio[share.act], np.concatenate([c_start, moving]),
                          np.concatenate([c_end, f_end]))
        np.maximum.at(need, share.act, load / share.cap)
    # κ: a kernel runs at 1 − κ while its rank communicates; κ_t: a flow at 1 − κ_t while an end rank computes
    comm_frac = _busy_fraction(np.concatenate([flows.src_rank, flows.dst_rank]), np.tile(f_start, 2),
                               np.tile(f_end, 2), np.tile(flows.kappa, 2), o.rank[busy], c_start, c_end, n_ranks)
    if flows.pool is None:
        comp_new = np.maximum(alone[busy] / np.maximum(1.0 - comm_frac, 1e-9), width[:nc] * need[:nc])
    else:                          # kernels on shared cores: each gets its fair share of what the flows leave
        used = flows.cpu_per_byte * np.where(width[nc:] > 0, work[nc:] / np.where(width[nc:] > 0, width[nc:], 1.0),
                                             0.0) * np.where(np.isfinite(flows.rate), flows.rate, 0.0)
        fair = _pool_fair_rate(c_start, c_end, moving, f_end, used, flows.pool)
        comp_new = alone[busy] / np.maximum(np.minimum(1.0 - comm_frac, fair), 1e-9)
    flow_alone = work[nc:]
    if (flows.tkappa > 0).any():
        on = np.ones(nc)
        frac = np.maximum(_busy_fraction(o.rank[busy], c_start, c_end, on, flows.src_rank, f_start, f_end, n_ranks),
                          _busy_fraction(o.rank[busy], c_start, c_end, on, flows.dst_rank, f_start, f_end, n_ranks))
        flow_alone = flow_alone / np.maximum(1.0 - flows.tkappa * frac, 1e-9)
    flow_new = np.where(flows.alone_s > 0, flows.latency_s + np.maximum(flow_alone, width[nc:] * need[nc:]), 0.0)
    return comp_new, flow_new


def _pool_fair_rate(c_start, c_end, f_start, f_end, f_used, capacity: float) -> np.ndarray:
    """[n kernels] each kernel's mean rate over its interval on a pool of ``capacity`` cores, shared max-min
    fairly: at each instant every running kernel gets min(1, (capacity − the flows' core use) / running kernels)
    (the flows' use ``f_used``: core-seconds per second, their link-limited rates). One sweep over the events."""
    t = np.concatenate([c_start, c_end, f_start, f_end])
    d_n = np.concatenate([np.ones(len(c_start)), -np.ones(len(c_end)), np.zeros(2 * len(f_start))])
    d_u = np.concatenate([np.zeros(2 * len(c_start)), f_used, -f_used])
    order = np.argsort(t, kind="stable")
    t, running, flows_use = t[order], np.cumsum(d_n[order]), np.cumsum(d_u[order])
    rate = np.minimum(1.0, np.maximum(capacity - flows_use, 0.0) / np.maximum(running, 1.0))
    gap = np.diff(t, append=t[-1] if len(t) else 0.0)
    integral = np.concatenate([[0.0], np.cumsum(rate * gap)])      # ∫ up to each event

    def at(x):
        i = np.searchsorted(t, x, side="right")
        k = np.maximum(i - 1, 0)
        return integral[k] + rate[k] * (x - t[k])

    width = c_end - c_start
    got = np.where(width > 0, (at(c_end) - at(c_start)) / np.where(width > 0, width, 1.0), 1.0)
    return np.clip(got, 1e-9, 1.0)


def _mean_load(act, res, dem, s, e) -> np.ndarray:
    """[n incidences] the time-averaged total demand on the incidence's resource over its activity's interval
    (its own demand included), by one sweep: per resource, the step function of active demand and its prefix
    integral, read at each interval's ends."""
    a_s, a_e = s[act], e[act]
    span = float(np.nanmax(e, initial=0.0)) * 2 + 1.0
    # events: +demand at start, −demand at end, keyed by resource then time (times shifted apart per resource)
    key = np.concatenate([res * span + a_s, res * span + a_e])
    delta = np.concatenate([dem, -dem])
    order = np.argsort(key)
    key, delta = key[order], delta[order]
    res_ev = np.concatenate([res, res])[order]
    level = np.cumsum(delta)                             # active demand after each event (resources cancel out)
    base = np.concatenate([[0.0], level[:-1]])
    gap = np.concatenate([[0.0], np.diff(key)])
    gap[np.concatenate([[True], res_ev[1:] != res_ev[:-1]])] = 0.0   # no integral across resources
    integral = np.cumsum(base * gap)                     # ∫ active demand up to each event, since resource 0

    # each interval end is itself an event, found from the sort's inverse permutation rather than searched (events
    # tied on a key have the same integral: no gap between them)
    where = np.empty(len(key), dtype=np.int64)
    where[order] = np.arange(len(key))
    width = a_e - a_s
    used = integral[where[len(act):]] - integral[where[:len(act)]]
    mean = np.where(width > 0, used / np.where(width > 0, width, 1.0), 0.0)
    return np.maximum(mean, dem)                          # an empty interval: its own use alone


def _busy_fraction(ranks, s, e, weight, q_rank, q_s, q_e, n_ranks) -> np.ndarray:
    """For each query interval on rank ``q_rank``, the fraction of it during which the rank has some interval
    among (``ranks``, ``s``, ``e``), times the largest ``weight`` of those (κ of the link class): intervals of
    one rank merged, then measured with prefix sums."""
    if len(ranks) == 0 or len(q_rank) == 0:
        return np.zeros(len(q_rank))
    w = np.zeros(n_ranks)
    np.maximum.at(w, ranks, weight)
    span = float(max(np.nanmax(e), np.nanmax(q_e))) * 2 + 1.0
    a, b = ranks * span + s, ranks * span + e
    order = np.argsort(a, kind="stable")
    a, b = a[order], b[order]
    reach = np.maximum.accumulate(b)
    new = np.concatenate([[True], a[1:] > reach[:-1]])  # a merged run starts here
    run = np.cumsum(new) - 1
    lo = a[new]
    hi = np.zeros(new.sum())
    np.maximum.at(hi, run, b)
    covered = np.concatenate([[0.0], np.cumsum(hi - lo)])  # covered length before each run

    def cover(t):                                       # covered length of the merged runs up to t
        i = np.searchsorted(lo, t, side="right") - 1
        inside = np.where(i >= 0, np.minimum(t, hi[np.maximum(i, 0)]) - lo[np.maximum(i, 0)], 0.0)
        return np.where(i >= 0, covered[np.maximum(i, 0)] + inside, 0.0)

    qa, qb = q_rank * span + q_s, q_rank * span + q_e
    width = q_e - q_s
    frac = np.where(width > 0, (cover(qb) - cover(qa)) / np.where(width > 0, width, 1.0), 0.0)
    return np.clip(frac, 0.0, 1.0) * w[q_rank]
