"""A feasible solution of the CP-SAT model for the greedy order: serial list scheduling (the model's hint).

CP-SAT can take long to find any solution once many transfers share links (16 ranks over two nodes: no
solution in 10 s on 2 cores), so the greedy order is timed here, in the model's own terms, and handed over as
a complete hint: items in the order they become ready (earliest first); a compute-like op as early as its
rank's compute (and the CPU core pool) allows; a P2P batch posted when ready; each transfer, once both its
batches are posted, at the earliest time every link it binds has room for it after its latency; a batch ends
when its last transfer does. Every constraint of :class:`meshplan.search.ilp.model._Model` holds by construction
(precedence, stream order, no-overlap, cumulatives); the reservoir caps are then read off this solution.
"""

from __future__ import annotations

import heapq

from meshplan.plan.schedule import BUSY_KINDS

BUSY = BUSY_KINDS
SCALE = 1000            # integer demand units per link capacity


class _Profile:
    """Reservations [start, end) × demand on one resource of capacity ``cap``."""

    def __init__(self, cap: int) -> None:
        self.cap, self.res = cap, []

    def fits(self, t: int, d: int, demand: int) -> int | None:
        """None if [t, t + d) has room for ``demand``; else the earliest end of a reservation that blocks it."""
        used, ends = demand, []
        for s, e, q in self.res:
            if s < t + d and e > t:
                used += q
                ends.append(e)
        return None if used <= self.cap else min(ends)

    def add(self, t: int, d: int, demand: int) -> None:
        self.res.append((t, t + d, demand))


def _earliest(profiles: list[tuple[_Profile, int, int, int]], t: int) -> int:
    """Earliest t' ≥ t at which each (profile, offset, length, demand) has room for [t' + offset, ... + length)."""
    while True:
        blocked = [p.fits(t + off, d, q) for p, off, d, q in profiles]
        late = [b - off for b, (_, off, _, _) in zip(blocked, profiles) if b is not None]
        if not late:
            return t
        t = max(t + 1, min(late))


def greedy_solution(model) -> tuple[dict, int]:
    """(variable → value, makespan ns) of the greedy order under ``model``'s constraints."""

    value: dict = {}
    state = {"rank": {}, "link": {}, "pool": _Profile(model.pool_cap) if model.pool_cap is not None else None,
             "scale": SCALE}
    by_pass: dict[int, list[int]] = {}
    for k, info in enumerate(model.xinfo):
        by_pass.setdefault(info[0], []).append(k)
    barrier = 0
    for p, items in model.items.items():
        barrier = _one_pass(model, p, items, barrier, by_pass.get(p, []), state, value)
        value[model.pass_end[p]] = barrier
    return value, barrier


def _one_pass(model, p: int, items, barrier: int, xs: list[int], state: dict, value: dict) -> int:
    """List-schedule one pass from ``barrier``; fills ``value``; returns the pass's end."""

    n = items.n
    after_end, after_start, remaining = _precedences(model, p, n)
    busy_rank = {i: r for r, its in model.busy.get(p, {}).items() for i in its}
    xs_of = _transfers_of(model, xs, n)
    open_x = [len(x) for x in xs_of]
    ready = [barrier] * n
    start, end, x_end = [None] * n, [None] * n, {}
    heap = [(barrier, i) for i in range(n) if remaining[i] == 0]
    heapq.heapify(heap)

    def release(lst, t):
        for b in lst:
            ready[b] = max(ready[b], t)
            remaining[b] -= 1
            if remaining[b] == 0:
                heapq.heappush(heap, (ready[b], b))

    def finish(i, t):
        end[i] = t
        release(after_end[i], t)

    while heap:
        t, i = heapq.heappop(heap)
        if items.is_comm[i]:
            start[i] = t
            release(after_start[i], t)
            for k in xs_of[i]:
                _, a, b, *_ = model.xinfo[k]
                if start[a] is None or start[b] is None or k in x_end:
                    continue
                _place_transfer(model, state, k, max(start[a], start[b]), x_end, value)
                for item in {a, b}:
                    open_x[item] -= 1
                    if open_x[item] == 0:
                        finish(item, max([x_end[j] for j in xs_of[item]] + [start[item] + 1]))
            if not xs_of[i]:
                finish(i, t + 1)
            continue
        t0, d = _place_item(model, state, items, i, t, busy_rank.get(i))
        start[i] = t0
        release(after_start[i], t0)
        finish(i, t0 + d)
    if any(x is None for x in end):
        raise RuntimeError("internal error: the greedy order does not complete in the CP-SAT model")
    _store(model, p, start, end, x_end, value)
    return max(end, default=barrier)


def _transfers_of(model, xs: list[int], n: int) -> list[list[int]]:
    """Per item of the pass, the transfers (of ``xs``) it takes part in."""
    xs_of: list[list[int]] = [[] for _ in range(n)]
    for k in xs:
        _, a, b, *_ = model.xinfo[k]
        for item in {a, b}:
            xs_of[item].append(k)
    return xs_of


def _place_item(model, state: dict, items, i: int, ready: int, rank: int | None) -> tuple[int, int]:
    """(start, duration) of compute item ``i`` at the earliest time from ``ready`` its rank's compute (and the shared
    pool, if any) has room for it, booked there; an item on no busy rank takes 1 from ``ready``."""
    o = model.sched.ops
    members = items.members[items.member_ptr[i]:items.member_ptr[i + 1]]
    d = max(int(model.dur[members[0]]), 1) if o.kind[members[0]] in BUSY else 1
    profs = []
    if rank is not None:
        profs.append((state["rank"].setdefault(rank, _Profile(1)), 0, d, 1))
        if state["pool"] is not None:
            profs.append((state["pool"], 0, d, state["scale"]))
    t0 = _earliest(profs, ready)
    for prof, off, dd, q in profs:
        prof.add(t0 + off, dd, q)
    return t0, d


def _place_transfer(model, state: dict, k: int, ready: int, x_end: dict, value: dict) -> None:
    """Transfer ``k`` at the earliest time from ``ready`` its links' profiles have room for its demand (after
    its latency, for its duration less the latency); books them and records its start and end."""
    _, _, _, lat, dur, x_s, _ = model.xinfo[k]
    profs = [(state["link"].setdefault(link, _Profile(state["scale"])), lat, dur - lat, q)
             for link, q in model.link_demand.get(k, [])]
    x0 = _earliest(profs, ready)
    for prof, off, d, q in profs:
        prof.add(x0 + off, d, q)
    x_end[k] = x0 + dur
    value[x_s] = x0


def _precedences(model, p: int, n: int) -> tuple[list[list[int]], list[list[int]], list[int]]:
    """Pass ``p``'s precedences among its ``n`` items: the items after each one's end, after each one's start,
    and how many predecessors each has."""
    prec = model.prec.get(p, {"end": set(), "start": set()})
    after_end, after_start = [[] for _ in range(n)], [[] for _ in range(n)]
    remaining = [0] * n
    for a, b in prec["end"]:
        after_end[a].append(b)
        remaining[b] += 1
    for a, b in prec["start"]:
        after_start[a].append(b)
        remaining[b] += 1
    return after_end, after_start, remaining


def _store(model, p: int, start: list, end: list, x_end: dict, value: dict) -> None:
    """The list schedule of pass ``p`` as CP-SAT hint values: item starts and ends, transfer sizes and ends,
    and the end of each buffer's last use."""
    for i in range(len(start)):
        value[model.start[p, i]], value[model.end[p, i]] = start[i], end[i]
        if (p, i) in model.comm_size:
            value[model.comm_size[p, i]] = end[i] - start[i]
    for k, t in x_end.items():
        value[model.xinfo[k][6]] = t
    for free, fp, _, f_items in model.free_info:
        if fp == p:
            value[free] = max(end[j] for j in f_items)
