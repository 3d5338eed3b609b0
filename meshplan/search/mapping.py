"""Rank → GPU placement search for any method: local search with the simulator as judge.

The schedule's ops name ranks; where each rank runs (``device_of_rank``) decides which flows share which links
(PCIe switch uplinks, socket links, NICs, the per-node aggregate). Starting from the algorithm's own placement
(identity for rings, Mesh's node-block mapping), :func:`search_mapping` tries swaps of two ranks' devices in
random order and keeps the first that lowers the simulated makespan (first-improvement hill climbing), until no
swap of a full sweep helps or the evaluation budget is spent. Swaps of two devices that see the topology
alike (the same node, domain and route to every third device) are skipped: they change nothing.

Each evaluation is a full simulation (:func:`meshplan.cost.simulate.simulate`): a placement that breaks node symmetry
makes the simulator run every rank, so the search is for up to ``MAX_RANKS`` ranks.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from meshplan.cost.simulate import simulate
from meshplan.model.topology import Topology
from meshplan.plan.schedule import Schedule

MAX_RANKS = 64


@dataclass
class MappingResult:
    """Outcome of a placement search; makespans are simulated totals over passes, seconds."""

    device_of_rank: np.ndarray
    start_s: float
    best_s: float
    evals: int
    swaps: int
    wall_s: float

    def to_dict(self) -> dict:
        """The ``mapping_search`` object of a search candidate."""
        return {"start_s": self.start_s, "best_s": self.best_s, "gain": 1 - self.best_s / self.start_s
                if self.start_s > 0 else 0.0, "evals": self.evals, "swaps": self.swaps, "wall_s": self.wall_s,
                "device_of_rank": self.device_of_rank.tolist()}


def with_devices(sched: Schedule, device_of_rank: np.ndarray) -> Schedule:
    """A copy of ``sched`` placed on ``device_of_rank`` ([n_ranks] device ids); declared symmetries stay (the
    simulator checks that each still moves whole nodes before it uses it)."""
    return Schedule(sched.algorithm, dict(sched.knobs), sched.workload, sched.n_ranks, sched.n_chunks,
                    np.asarray(device_of_rank, dtype=np.int64).copy(), sched.topology, sched.streams, sched.ops,
                    sched.tensors, list(sched.symmetries))


def makespan_s(sched: Schedule, topo: Topology) -> float:
    """Simulated makespan summed over passes."""
    return float(sum(simulate(sched, topo).pass_makespan.values()))


def _signature(topo: Topology, devices: np.ndarray) -> list[tuple]:
    """Per device: its node, domain and its latency and bandwidth to each device of ``devices`` (alike devices
    have equal signatures up to the pair itself)."""
    sig = []
    for d in devices.tolist():
        lat, bw = topo.pair_stats(np.full(len(devices), d), devices)
        sig.append((int(topo.node_of_device[d]), int(topo.domain_of_device[d]),
                    tuple(np.round(lat, 12).tolist()), tuple(np.round(bw, 3).tolist())))
    return sig


def _alike(sig: list[tuple], i: int, j: int) -> bool:
    """Devices i and j see every other device alike (their entries for each other swapped)."""
    a, b = sig[i], sig[j]
    if a[:2] != b[:2]:
        return False
    for k in (2, 3):
        x, y = list(a[k]), list(b[k])
        x[i], x[j] = x[j], x[i]
        if x != y:
            return False
    return True


def search_mapping(sched: Schedule, topo: Topology, *, max_evals: int = 100, seed: int = 0,
                   time_budget_s: float | None = None) -> MappingResult:
    """Hill-climb on rank swaps from ``sched.device_of_rank`` (module docstring).

    Args:
        max_evals: simulations at most (the starting placement's included).
        time_budget_s: stop starting new evaluations after this many seconds (None: no limit).
    Raises:
        ValueError: ``max_evals`` < 1, or more than ``MAX_RANKS`` ranks.
    """
    if max_evals < 1:
        raise ValueError("max_evals must be at least 1")
    if sched.n_ranks > MAX_RANKS:
        raise ValueError(f"placement search is for up to {MAX_RANKS} ranks")
    t0 = time.perf_counter()
    rng = np.random.default_rng(seed)
    cur = np.asarray(sched.device_of_rank, dtype=np.int64).copy()
    start = best = makespan_s(sched, topo)
    evals, swaps = 1, 0
    n = sched.n_ranks
    out_of_time = lambda: (evals >= max_evals or  # noqa: E731
                           (time_budget_s is not None and time.perf_counter() - t0 > time_budget_s))
    improved = True
    while improved and not out_of_time():
        improved = False
        sig = _signature(topo, cur)
        pairs = [(i, j) for i in range(n) for j in range(i + 1, n) if not _alike(sig, i, j)]
        for k in rng.permutation(len(pairs)).tolist():
            if out_of_time():
                break
            i, j = pairs[k]
            trial = cur.copy()
            trial[i], trial[j] = cur[j], cur[i]
            t = makespan_s(with_devices(sched, trial), topo)
            evals += 1
            if t < best * (1 - 1e-9):
                cur, best, swaps, improved = trial, t, swaps + 1, True
                break
    return MappingResult(cur, start, best, evals, swaps, time.perf_counter() - t0)
