"""Mesh-Attention's in-tile scheduler: the order of a rank's fetches and computations.

A rank holds its own Q and KV chunk, fetches a−1 Q chunks (remote rows) and b−1 KV chunks (remote columns),
computes the a × b blocks of its tile and returns a−1 partial outputs. The order is planned once, on a
one-rank model (the seed's setting and docs/worked-examples.md's toy), and is the same on every rank, so each
step of the real schedule is a permutation:

* fetches share one link, one at a time, in the chosen order; partial outputs return after the fetches,
  a row as soon as it is complete, in completion order;
* compute is list-scheduled by groups: when a Q chunk of row u arrives, its blocks against the columns
  present form one group; when a KV chunk of column v arrives, the remote rows present against it form one
  group and the own row's block against it is *held back* as filler (computed only when no remote group is
  ready), so remote rows finish early and their returns hide behind the own row (the seed's two rules).

The greedy picks the next fetch by blocks unlocked per unit of transfer time (the seed's first rule; ties
go to Q); since that rule can lose to a naive order (docs/worked-examples.md), :func:`plan_order` also evaluates
all-Q-first, all-KV-first and alternating and keeps the best. :func:`brute_force` is the reference optimum.
"""

from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass, field

import numpy as np


@dataclass(frozen=True)
class TileCosts:
    """Seconds (or any unit): one Q fetch, one KV fetch, one partial-output return, one block."""

    t_q: float
    t_kv: float
    t_o: float
    t_block: float


@dataclass
class TilePlan:
    """An order and what the one-rank model predicts for it.

    ``groups``: compute groups in program order, each (rows, columns, event) with rows/columns as offsets
    (0 = own) and ``event`` the index of the fetch that unlocked it (−1: present from the start).
    ``returns``: remote rows in the order their partial outputs leave.
    """

    name: str
    order: tuple[str, ...]
    makespan: float
    groups: list[tuple[tuple[int, ...], tuple[int, ...], int]] = field(default_factory=list)
    returns: list[int] = field(default_factory=list)


def evaluate(a: int, b: int, order, costs: TileCosts, own_last: bool = True, name: str = "") -> TilePlan:
    """Run the one-rank model for a fetch order (a sequence of ``'q'``/``'kv'``)."""
    order = tuple(order)
    if sorted(order) != sorted(("q",) * (a - 1) + ("kv",) * (b - 1)):
        raise ValueError(f"an order for a {a}x{b} tile fetches {a - 1} Q and {b - 1} KV chunks")
    events, t, rows, cols = [], 0.0, [0], [0]
    for kind in order:
        t += costs.t_q if kind == "q" else costs.t_kv
        events.append((t, kind))
    ready = [(0.0, 0, ((0,), (0,), -1), True)]  # (time, seq, group, own)
    for k, (t_arr, kind) in enumerate(events):
        if kind == "q":
            rows.append(len(rows))
            ready.append((t_arr, k + 1, ((rows[-1],), tuple(cols), k), False))
        else:
            cols.append(len(cols))
            if len(rows) > 1:
                ready.append((t_arr, k + 1, (tuple(rows[1:]), (cols[-1],), k), False))
            ready.append((t_arr, k + 1, ((0,), (cols[-1],), k), True))
    groups, done_at = _list_schedule(ready, costs, own_last)
    row_done: dict[int, float] = {}
    for (us, _, _), t_done in done_at:
        for u in us:
            if u and t_done > row_done.get(u, -1.0):
                row_done[u] = t_done
    link = events[-1][0] if events else 0.0
    finish = max(t for _, t in done_at)
    returns = sorted(row_done, key=lambda u: (row_done[u], u))
    for u in returns:
        link = max(link, row_done[u]) + costs.t_o
    return TilePlan(name, order, max(finish, link), [g for g, _ in done_at], returns)


def _list_schedule(ready, costs: TileCosts, own_last: bool):
    """One processor; remote groups first-come first-served, own-row groups only as filler."""
    pending = sorted(ready, key=lambda x: (x[0], x[1]))
    remote, own, out, t, i = [], [], [], 0.0, 0
    while i < len(pending) or remote or own:
        while i < len(pending) and pending[i][0] <= t + 1e-12:
            when, seq, group, is_own = pending[i]
            heapq.heappush(own if (is_own and own_last) else remote, (when, seq, group))
            i += 1
        queue = remote or own
        if not queue:
            t = pending[i][0]
            continue
        _, _, group = heapq.heappop(queue)
        t += len(group[0]) * len(group[1]) * costs.t_block
        out.append((group, t))
    return [g for g, _ in out], out


def greedy_order(a: int, b: int, costs: TileCosts) -> tuple[str, ...]:
    """The seed's rule: the fetch that unlocks the most blocks per unit of transfer time (ties: Q)."""
    nq, nkv, order = 1, 1, []
    while nq < a or nkv < b:
        gain_q = (nkv / costs.t_q if costs.t_q > 0 else np.inf) if nq < a else -1.0
        gain_kv = (nq / costs.t_kv if costs.t_kv > 0 else np.inf) if nkv < b else -1.0
        if gain_q >= gain_kv:
            order.append("q")
            nq += 1
        else:
            order.append("kv")
            nkv += 1
    return tuple(order)


def naive_orders(a: int, b: int) -> dict[str, tuple[str, ...]]:
    """All Q first, all KV first, and alternating (Q first) orders."""
    alt, q, kv = [], a - 1, b - 1
    while q or kv:
        if q:
            alt.append("q")
            q -= 1
        if kv:
            alt.append("kv")
            kv -= 1
    return {"q-first": ("q",) * (a - 1) + ("kv",) * (b - 1), "kv-first": ("kv",) * (b - 1) + ("q",) * (a - 1),
            "alternate": tuple(alt)}


ORDERS = ("auto", "greedy", "q-first", "kv-first", "alternate")


def plan_order(a: int, b: int, costs: TileCosts, choice: str = "auto", own_last: bool = True) -> TilePlan:
    """The order to use: ``auto`` = the best of the greedy and the naive orders on the one-rank model."""
    cands = {"greedy": greedy_order(a, b, costs), **naive_orders(a, b)}
    if choice != "auto":
        return evaluate(a, b, cands[choice], costs, own_last, choice)
    plans = [evaluate(a, b, order, costs, own_last, name) for name, order in cands.items()]
    return min(plans, key=lambda p: (p.makespan, list(cands).index(p.name)))


def streams_estimate(plan: TilePlan, costs: TileCosts, inflight: int, t_merge: float = 0.0) -> float:
    """Makespan of a tile plan under the real schedule's rules, one rank, uncontended (every rank alike).

    Q and KV fetches run on their own streams, fetch i waiting for fetch i − ``inflight`` to land; groups
    run in order once their chunks landed; each row's partial leaves on its own stream when the row is
    done; received partials are merged at the end. An estimate (mean costs), not a bound.
    """
    landed, free = [], {"q": 0.0, "kv": 0.0}
    for i, kind in enumerate(plan.order):
        start = max(free[kind], landed[i - inflight] if i >= inflight else 0.0)
        free[kind] = start + (costs.t_q if kind == "q" else costs.t_kv)
        landed.append(free[kind])
    row_at = [i for i, k in enumerate(plan.order) if k == "q"]
    col_at = [i for i, k in enumerate(plan.order) if k == "kv"]
    t, row_done = 0.0, {}
    for rows, cols, _ in plan.groups:
        need = [landed[row_at[u - 1]] for u in rows if u] + [landed[col_at[v - 1]] for v in cols if v]
        t = max([t] + need) + len(rows) * len(cols) * costs.t_block
        for u in rows:
            row_done[u] = t
    out = 0.0
    for u in plan.returns:
        out = max(out, row_done.get(u, 0.0)) + costs.t_o
    return max(t, out) + len(plan.returns) * t_merge


def brute_force(a: int, b: int, costs: TileCosts, own_last: bool = True) -> TilePlan:
    """The best fetch order by enumerating every one (C(a+b−2, a−1) orders: small tiles only)."""
    n = a + b - 2
    best = None
    for q_at in itertools.combinations(range(n), a - 1):
        order = tuple("q" if i in q_at else "kv" for i in range(n))
        plan = evaluate(a, b, order, costs, own_last, "optimum")
        if best is None or plan.makespan < best.makespan:
            best = plan
    return best
