"""Max-min fair sharing (progressive filling), the rate rule of the flow-level simulator.

Each round raises every unfrozen activity's rate to the next bottleneck: the resource whose remaining
capacity, split over its unfrozen users by weight, is smallest, or an activity's own cap; the activities
it blocks are frozen at that level. This is the classic water-filling allocation (Bertsekas & Gallager,
*Data Networks*, §6.5.2), as used by flow-level network simulators such as SimGrid's LMM solver.
"""

from __future__ import annotations

import numpy as np

NUMPY_MAXMIN_FROM = 16  # components with more activities are solved on arrays


def fair_rates(acts: dict[int, list], res_cap: list[float], cap_of) -> dict[int, float]:
    """Max-min fair rates by progressive filling.

    Args:
        acts: activity id -> the simulator's activity record; item 4 is its list of (resource id, weight)
            pairs (a flow's links, a compute op's resource), the rest is the caller's.
        res_cap: capacity of each resource (bytes/s for links, 1 for a compute resource).
        cap_of: ``cap_of(aid, act)``, the activity's own rate cap (per-flow cap, or 1 − κ for compute).
    Returns:
        activity id -> rate.
    """
    caps = {a: cap_of(a, act) for a, act in acts.items()}
    if len(acts) == 1:
        (a, act), = acts.items()
        return {a: min([caps[a]] + [res_cap[r] / w for r, w in act[4]])}
    if len(acts) > NUMPY_MAXMIN_FROM:
        return _maxmin_numpy(acts, res_cap, caps)
    users: dict[int, list] = {}
    for a, act in acts.items():
        for r, w in act[4]:
            users.setdefault(r, []).append((a, w))
    load = {r: 0.0 for r in users}
    wsum = {r: sum(w for _, w in us) for r, us in users.items()}
    rate: dict[int, float] = {}
    unfrozen = set(acts)
    level = 0.0
    while unfrozen:
        nxt, which = np.inf, None
        for r, ws in wsum.items():
            if ws > 0:
                lv = (res_cap[r] - load[r]) / ws
                if lv < nxt:
                    nxt, which = lv, ("res", r)
        for a in unfrozen:
            if caps[a] < nxt:
                nxt, which = caps[a], ("act", a)
        level = max(nxt, level)
        if which[0] == "act":
            frozen = [a for a in unfrozen if caps[a] <= level * (1 + 1e-12)]
        else:
            frozen = [a for a, _ in users[which[1]] if a in unfrozen]
        touched = set()
        for a in frozen:
            unfrozen.discard(a)
            rate[a] = level
            for r, w in acts[a][4]:
                load[r] += level * w
                touched.add(r)
        for r in touched:       # summed afresh: weights of very different sizes leave no residue
            wsum[r] = sum(w for a, w in users[r] if a in unfrozen)
    return rate


def _maxmin_numpy(acts: dict[int, list], res_cap: list[float], caps: dict[int, float]) -> dict[int, float]:
    """Progressive filling on arrays: each round raises every unfrozen rate to the next bottleneck level."""
    ids = list(acts)
    act_idx, res_raw, weight = [], [], []
    for k, a in enumerate(ids):
        for r, w in acts[a][4]:
            act_idx.append(k)
            res_raw.append(r)
            weight.append(w)
    act_idx, weight = np.asarray(act_idx), np.asarray(weight, dtype=np.float64)
    res_ids, res_idx = np.unique(np.asarray(res_raw), return_inverse=True)
    cap_r = np.asarray(res_cap, dtype=np.float64)[res_ids]
    cap_a = np.asarray([caps[a] for a in ids], dtype=np.float64)
    n_a, n_r = len(ids), len(res_ids)
    rate = np.zeros(n_a)
    free = np.ones(n_a, dtype=bool)
    load = np.zeros(n_r)
    while free.any():
        live = free[act_idx]
        wsum = np.bincount(res_idx[live], weights=weight[live], minlength=n_r)
        with np.errstate(divide="ignore", invalid="ignore"):
            level_r = np.where(wsum > 0, (cap_r - load) / wsum, np.inf)
        level = min(level_r.min(), cap_a[free].min())
        tol = level * (1 + 1e-12) + 1e-300
        saturated = level_r <= tol
        hit = np.zeros(n_a, dtype=bool)
        hit[act_idx[live & saturated[res_idx]]] = True
        frozen = free & (hit | (cap_a <= tol))
        rate[frozen] = level
        sel = frozen[act_idx]
        load += np.bincount(res_idx[sel], weights=weight[sel] * level, minlength=n_r)
        free &= ~frozen
    return dict(zip(ids, rate.tolist()))


def max_min_fair(routes: list[list[int]], capacity: list[float], flow_cap: list[float] | None = None) -> list[float]:
    """Max-min fair rates of flows over links (progressive filling), the rule the simulator applies.

    Args:
        routes: for each flow, the ids of the links it crosses (a link listed twice counts twice).
        capacity: bytes/s of each link.
        flow_cap: optional per-flow cap (bytes/s).
    Returns:
        bytes/s of each flow.
    """
    acts = {}
    for f, route in enumerate(routes):
        weights: dict[int, float] = {}
        for link in route:
            weights[link] = weights.get(link, 0.0) + 1.0
        cap = np.inf if flow_cap is None else flow_cap[f]
        acts[f] = [0.0, 0.0, 0.0, 0, list(weights.items()), cap, ("flow", f)]
    rates = fair_rates(acts, list(capacity), lambda a, act: act[5])
    return [rates[f] for f in range(len(routes))]
