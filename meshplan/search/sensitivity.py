"""``search --sensitivity P``: how robust the top plans are to the cost model's numbers.

The ``top`` best candidates of a search (any of them left at their closed-form bound is simulated first) are
re-simulated on ``samples`` perturbed copies of the topology; their schedules do not change, only op durations
and link capacities. Each sample draws independent multiplicative factors, each uniform in
[1 − P/100, 1 + P/100] (numpy's ``default_rng(seed)``, so a seed gives the same samples everywhere):

* **bandwidth**: one factor per link class (``LINK_CLASSES``: a cluster's NICs, NVLink ports or PCIe links are
  alike, so they err together), on the usable capacity and the per-flow cap of every link of that class;
* **latency**: one factor per link class on its hop latencies, and one on the per-transfer software overhead
  (``p2p_overhead_us``, alpha_sw);
* **efficiency**: one factor per pass (fwd, bwd) on the attention kernel table's efficiency (so on every block's
  ``FLOPs / (peak · e)``; launches, merges and κ stay nominal). A factor above 1 may take ``e`` past 1: it
  models the table's uncertainty, not a faster device.

Per candidate: its nominal makespan (seconds, all passes), the fraction of samples in which it is the fastest of
the ``top`` (exact ties count for each), its regret ``t / t_best − 1`` against that sample's fastest of the
``top`` (mean and worst, in percent) and its 95th-percentile time. With P = 0 every sample is the nominal model.
``pick="robust"`` moves the candidate with the smallest worst-case regret (ties: the smaller nominal time) to the
front of the search's ranking, the others keeping their nominal order; ``"nominal"`` changes nothing.
"""

from __future__ import annotations

import copy
import math
import time
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from meshplan import algorithms
from meshplan.core.errors import UserError
from meshplan.cost.simulate import simulate
from meshplan.model.topology import LINK_CLASSES, Topology
from meshplan.search.candidate import simulate_candidate
from meshplan.search.ranking import ranked

PICKS = ("nominal", "robust")
PERTURBED = ("bandwidth", "latency", "efficiency")
HOW = {"distribution": "independent factors, each uniform in [1 - P/100, 1 + P/100]",
       "bandwidth": "one factor per link class on its usable capacities and per-flow caps",
       "latency": "one factor per link class on its hop latencies, one on the per-transfer overhead (alpha_sw)",
       "efficiency": "one factor per pass (fwd, bwd) on the attention kernel efficiency table"}


@dataclass(frozen=True)
class Factors:
    """One sample's multipliers: per link class (``LINK_CLASSES`` order) and per pass."""

    bw: np.ndarray          # [len(LINK_CLASSES)] capacity and per-flow cap
    lat: np.ndarray         # [len(LINK_CLASSES)] hop latency
    overhead: float         # per-transfer software overhead (alpha_sw)
    eff: dict[str, float]   # attention kernel efficiency, by pass


def check_args(percent: float | None, samples: int | None, top: int | None, seed: int | None, pick: str, *,
               job: bool = False) -> tuple[int, int, int]:
    """Refuse bad ``search --sensitivity`` input (one line each, naming the flag and the fix); returns (samples,
    top, seed) with the defaults (20, 5, 0) for those not given.

    Raises:
        UserError: P outside [0, 100), fewer than one sample or candidate, an unknown pick, ``robust`` or a
            sample flag without P, or P with a job re-rank (``--tp/--dp``).
    """
    if pick not in PICKS:
        raise UserError("--pick", f"unknown pick {pick!r}", "use nominal or robust")
    if percent is None:
        if pick == "robust":
            raise UserError("--pick", "robust needs samples to judge by", "add --sensitivity P (e.g. 10)")
        for flag, v in (("--sensitivity-samples", samples), ("--sensitivity-top", top), ("--sensitivity-seed", seed)):
            if v is not None:
                raise UserError(flag, "applies with --sensitivity only", "add --sensitivity P (e.g. 10), or drop it")
        return 20, 5, 0
    samples, top, seed = (20 if samples is None else samples, 5 if top is None else top, 0 if seed is None else seed)
    if not (math.isfinite(percent) and 0 <= percent < 100):
        raise UserError("--sensitivity", f"{percent:g} is outside [0, 100)",
                        "give a perturbation in percent, at least 0 and below 100 (e.g. 10)")
    if samples < 1:
        raise UserError("--sensitivity-samples", f"{samples} samples", "give 1 or more (default 20)")
    if top < 1:
        raise UserError("--sensitivity-top", f"{top} candidates", "give 1 or more (default 5)")
    if job:
        raise UserError("--sensitivity", "not combined with --tp/--dp yet (the job re-rank comes after it)",
                        "drop --sensitivity or run it on the CP group alone")
    return samples, top, seed


def draw_factors(percent: float, samples: int, seed: int = 0) -> list[Factors]:
    """``samples`` draws of every factor, uniform in [1 − P/100, 1 + P/100]; all exactly 1 for P = 0."""
    rng = np.random.default_rng(seed)
    n, p = len(LINK_CLASSES), percent / 100.0
    out = []
    for _ in range(samples):
        f = 1.0 + p * rng.uniform(-1.0, 1.0, size=2 * n + 3)
        out.append(Factors(f[:n], f[n:2 * n], float(f[2 * n]), {"fwd": float(f[2 * n + 1]),
                                                                  "bwd": float(f[2 * n + 2])}))
    return out


class _ScaledKernel:
    """A kernel table whose efficiencies are multiplied by a factor per pass (the rest delegated)."""

    def __init__(self, base, factor: dict[str, float]) -> None:
        self._base, self._factor = base, factor
        self.spec, self.launch_s = base.spec, base.launch_s

    def efficiency(self, s_q, s_kv, pass_: str, elementwise, head_dim: int | None = None,
                   envelope: bool = False, dtype: str | None = None) -> np.ndarray:
        return self._base.efficiency(s_q, s_kv, pass_, elementwise, head_dim, envelope, dtype) * self._factor[pass_]

    def __getattr__(self, name: str):
        return getattr(self._base, name)


def perturbed_topology(topo: Topology, f: Factors, tag: str = "perturbed") -> Topology:
    """A copy of ``topo`` with ``f`` applied; ``topo`` itself is untouched (routes and graph are shared).

    Capacity-derived caches are reset and ``content_hash`` gets ``tag`` appended, so caches keyed by the hash
    (block times, Mesh timings) never mix nominal and perturbed numbers.
    """
    t = copy.copy(topo)
    cls = topo.link_class
    t.link_capacity = topo.link_capacity * f.bw[cls]
    t.link_flow_cap = topo.link_flow_cap * f.bw[cls]
    t.link_latency_s = topo.link_latency_s * f.lat[cls]
    t._stats = None                                # pair_stats' tables, rebuilt from the scaled arrays
    t.spec = topo.spec.model_copy(update={"p2p_overhead_us": topo.spec.p2p_overhead_us * f.overhead})
    t.__dict__["kernel"] = _ScaledKernel(topo.kernel, f.eff)
    t.__dict__["content_hash"] = f"{topo.content_hash}~{tag}"
    return t


def _eligible(result, top: int, progress) -> tuple[list, set[int]]:
    """The ``top`` best candidates ranked on all passes, simulated (those left at their bound are simulated now;
    their ids returned), the candidates re-ranked (:func:`~meshplan.search.candidate.ranked`) until the top ones
    are all simulated: a simulated time can fall below another's bound, which then joins the top."""
    fresh: set[int] = set()
    while True:
        chosen = [c for c in result.candidates if not c.forward_only][:top]
        todo = [c for c in chosen if c.model_level != "simulated"]
        if not todo:
            return chosen, fresh
        for k, c in enumerate(todo):
            if progress:
                progress(k, len(todo), f"simulating {c.algorithm} {c.workload.layout}")
            simulate_candidate(c, result.topology, result.ring_ccr)
            fresh.add(id(c))
        result.candidates[:] = ranked(result.candidates)


def sample_times(cands: list, topo: Topology, factors: list[Factors], progress=None,
                 drop: set[int] = frozenset()) -> np.ndarray:
    """[len(cands), len(factors)] makespans (s, all passes) of each candidate's schedule on each perturbed copy.

    A schedule the search dropped is rebuilt from the kept plan and dropped again, as are those of ``drop`` (ids).
    """
    from meshplan.search import forget_built

    topos = [perturbed_topology(topo, f, f"s{k}") for k, f in enumerate(factors)]
    times = np.empty((len(cands), len(factors)))
    for i, c in enumerate(cands):
        if progress:
            progress(i, len(cands), f"sensitivity {c.algorithm} {c.workload.layout}")
        rebuilt = c.schedule is None
        sched = algorithms.get(c.algorithm).schedule(c.plan, topo) if rebuilt else c.schedule
        for s, t in enumerate(topos):
            times[i, s] = sum(simulate(sched, t).pass_makespan.values())
        if rebuilt or id(c) in drop:
            forget_built(c)
    for c in cands:                  # the shared builds of the search the plans came from
        builds = c.plan.extra.get("builds")
        if builds is not None:
            builds.clear()
    return times


def summarize(times: np.ndarray) -> dict[str, np.ndarray]:
    """Per candidate (rows): best fraction, mean and worst regret (%) against each sample's best, p95 time."""
    best = times.min(axis=0)
    regret = times / best - 1.0
    return {"best_fraction": (times <= best * (1 + 1e-12)).mean(axis=1),
            "regret_mean_pct": 100 * regret.mean(axis=1), "regret_worst_pct": 100 * regret.max(axis=1),
            "p95_s": np.percentile(times, 95, axis=1)}


def robust_index(worst_pct: np.ndarray, nominal_s: np.ndarray) -> int:
    """The candidate with the smallest worst-case regret; ties by the smaller nominal time."""
    return min(range(len(worst_pct)), key=lambda i: (float(worst_pct[i]), float(nominal_s[i])))


def run_sensitivity(result, percent: float, *, samples: int = 20, top: int = 5, seed: int = 0,
                    pick: str = "nominal", progress: Callable[[int, int, str], None] | None = None) -> dict[str, Any]:
    """Perturb, re-simulate and summarise ``result``'s ``top`` best (module docstring); with ``pick="robust"``
    re-rank ``result.candidates`` in place. Returns the ``sensitivity`` object of ``search --json``.

    Raises:
        UserError: bad arguments (:func:`check_args`).
    """
    check_args(percent, samples, top, seed, pick)
    t0 = time.perf_counter()
    cands, fresh = _eligible(result, top, progress)
    body = {"percent": percent, "samples": samples, "seed": seed, "top": top, "perturbed": list(PERTURBED),
            "how": HOW, "link_classes": [LINK_CLASSES[k] for k in np.unique(result.topology.link_class)],
            "regret_against": "the fastest of these candidates in the same sample", "candidates": [],
            "pick": pick, "picked": None}
    if not cands:
        return body | {"wall_s": time.perf_counter() - t0}
    times = sample_times(cands, result.topology, draw_factors(percent, samples, seed), progress, fresh)
    nominal = np.asarray([c.predicted.makespan_s for c in cands])
    stats = summarize(times)
    picked = robust_index(stats["regret_worst_pct"], nominal) if pick == "robust" else 0
    for k, c in enumerate(cands):
        body["candidates"].append({"rank": k + 1, "algorithm": c.algorithm, "layout": c.workload.layout,
                                   "knobs": jsonable(c.knobs), "nominal_s": float(nominal[k]),
                                   **{key: float(v[k]) for key, v in stats.items()}})
    if picked:
        chosen = cands[picked]
        result.candidates[:] = [chosen] + [c for c in result.candidates if c is not chosen]
    wall = time.perf_counter() - t0
    result.wall_s += wall
    return body | {"picked": picked, "wall_s": wall}


def jsonable(d: Any) -> Any:
    """A copy without numpy scalars, ready for ``json.dumps``."""
    if isinstance(d, dict):
        return {k: jsonable(v) for k, v in d.items()}
    if isinstance(d, (np.floating, np.integer)):
        return d.item()
    return d
