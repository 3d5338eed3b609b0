"""The table's order and its reference points: the pick and the rows under it (:func:`ranked`), Ring's best
setting as the reference row (:func:`ring_reference`), and the candidates that keep the pick from being proven
the best (:func:`not_proven`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from meshplan.model.topology import Topology
from meshplan.search.beside import simulate_both
from meshplan.search.candidate import (
    Candidate,
    forget_built,
    given_knobs,
    simulate_candidate,
    simulate_command,
    timing_estimate_s,
)

#: Ring settings simulated at most to find its best for the reference row
REFERENCE_SIMULATIONS = 4
#: predicted margins below this are near-ties: closer than the model's error (docs/accuracy.md: the CPU validation's
#: error is several times it), so neither the table nor the reference row tells such plans apart
NEAR_TIE = 0.03


def reference_slack(prune_slack: float) -> float:
    """How far below the reference row's simulated time another Ring setting's lower bound may lie and that setting
    still be left at its bound: the near-tie margin (:data:`NEAR_TIE`), or the prune slack where that is larger. The
    reference row is Ring's best setting to within the model's error — a setting left at its bound cannot beat it by
    more than that (Ring's backward bound sits 3–4% under its simulation, so with the prune slack every one of its
    settings would be simulated only to tell apart times within 0.5% of each other)."""
    return max(prune_slack, NEAR_TIE)


def time_of(c: Candidate) -> float:
    """A candidate's time in the table: simulated, else its closed-form lower bound."""
    return c.predicted.makespan_s if c.predicted is not None and c.model_level == "simulated" else c.bound_s


def ranked(cands: list[Candidate]) -> list[Candidate]:
    """The table's order: the fastest simulated candidate first (the pick), then every other by its time —
    simulated, or its closed-form lower bound — so no bound that could beat a simulated row is listed under it;
    forward-only methods in a fwd+bwd search last, in their own order. Stable: ranking twice changes nothing."""
    both = [c for c in cands if not c.forward_only]
    sim = [c for c in both if c.model_level == "simulated"]
    first = min(sim, key=lambda c: c.predicted.makespan_s) if sim else None
    rest = sorted((c for c in both if c is not first), key=time_of)
    return ([first] if first is not None else []) + rest + [c for c in cands if c.forward_only]


def ring_reference(cands: list[Candidate], topo: Topology, n: int, ccr: float | None, prune_slack: float,
                   max_ranks: int) -> Candidate | None:
    """Ring's best setting, the row every user knows: :func:`reference_simulations`, two at a time
    (:func:`~meshplan.search.beside.simulate_both`), then the fastest simulated setting — or an unsimulated one
    whose bound is more than the reference slack (:func:`reference_slack`) under it (above ``max_ranks``: the best
    bound). None when Ring is not
    among the candidates (``--algos`` without it, or it cannot run)."""
    def simulate(todo: list[Candidate]) -> None:
        if len(todo) == 2:                                          # both cores
            simulate_both(*todo, topo, ccr)
        else:
            simulate_candidate(todo[0], topo, ccr)
        for c in todo:
            forget_built(c)

    reference_simulations(cands, n, prune_slack, max_ranks, simulate, batch=2)
    ring = ring_rows(cands)
    if not ring:
        return None
    sim = [r for r in ring if r.model_level == "simulated"]
    best = min(sim, key=time_of) if sim else None
    lower = [r for r in ring if r.model_level != "simulated"
             and (best is None or r.bound_s < time_of(best) * (1 - reference_slack(prune_slack)))]
    return min(lower, key=time_of) if lower else best       # a bound well below the best simulated stays shown


def reference_simulations(cands: list[Candidate], n: int, prune_slack: float, max_ranks: int,
                          simulate: Callable[[list[Candidate]], Any], batch: int = 1) -> None:
    """Simulate Ring's settings for the reference row: zigzag with its default knobs first (the setting torchtitan
    and Megatron-LM run, so its simulation serves their rows too), then in bound order; up to ``REFERENCE_SIMULATIONS``
    and up to ``max_ranks`` ranks (above, its bounds stand: a schedule alone takes GBs, 8 GB at 1024 ranks and 1M
    tokens), until no bound is more than the reference slack (:func:`reference_slack`) under the best simulated —
    as the search prunes, with the near-tie margin for its slack. ``simulate(todo)`` simulates up to ``batch`` of
    them at a time. A search runs this beside its branch and bound, one at a time in another process
    (:func:`~meshplan.search.beside.simulate_beside`); :func:`ring_reference` then simulates any left (one the
    branch and bound found over the memory limit no longer counts)."""
    order = sorted(ring_rows(cands), key=lambda c: (not _frameworks_ring(c), c.bound_s))[:REFERENCE_SIMULATIONS]
    while n <= max_ranks:
        ring = ring_rows(cands)
        best = min((time_of(r) for r in ring if r.model_level == "simulated"), default=float("inf"))
        todo = [c for c in order if c.model_level not in ("simulated", "over-memory")
                and c.bound_s < best * (1 - reference_slack(prune_slack))][:batch]
        if not todo:                                                # no bound beats the best: as the search prunes
            break
        simulate(todo)


def _frameworks_ring(c: Candidate) -> bool:
    """Whether ``c`` is the Ring setting torchtitan and Megatron-LM run: zigzag, every knob at its default."""
    return c.workload.layout == "zigzag" and not given_knobs(c)


def ring_rows(cands: list[Candidate]) -> list[Candidate]:
    """Ring's settings that can be the reference row: not over the memory limit, not forward-only."""
    return [c for c in cands if c.algorithm == "ring" and c.model_level != "over-memory" and not c.forward_only]


def not_proven(result) -> list[dict[str, Any]]:
    """Of a :class:`~meshplan.search.SearchResult` (not imported here: the package imports this module): the
    candidates left at a lower bound more than the prune slack below the pick's simulated time (the search could
    not simulate them: ``Candidate.not_simulated``) — the pick is not proven the best while they stand. Each: its
    1-based ``rank`` in the table, ``bound_s``, ``reason``, the ``simulate`` command that times it alone, and its
    contended estimate ``estimate_s`` where :func:`estimate_unproven` made one."""
    return [{"rank": i, "algorithm": c.algorithm, "bound_s": c.bound_s, "reason": c.not_simulated or "not simulated",
             "simulate": simulate_command(c, result.topology)}
            | ({"estimate_s": c.unproven_estimate_s} if c.unproven_estimate_s is not None else {})
            for i, c in _unproven(result)]


def _unproven(result) -> list[tuple[int, Candidate]]:
    """(1-based rank, candidate) of the candidates :func:`not_proven` lists."""
    cands = result.candidates
    if not cands or cands[0].model_level != "simulated":
        return []
    best, slack = cands[0].predicted.makespan_s, result.counts.get("prune_slack", 0.0)
    return [(i, c) for i, c in enumerate(cands, start=1)
            if c.model_level != "simulated" and not c.forward_only and c.bound_s < best * (1 - slack)]


def estimate_unproven(result) -> None:
    """The contended estimate (:mod:`meshplan.cost.estimate`: the simulator's sharing rules applied to the
    uncontended timeline, without its event loop) of each candidate that keeps the pick from being proven, where
    its schedule can be built (not a method timed by its schedule-free bound above its build limit): a number to
    weigh the unproven pick by, seconds where the simulation would take minutes (a 1024-rank Mesh without node
    symmetry: ~4 s against ~750 s). Kept on ``Candidate.unproven_estimate_s`` (``not_proven``'s ``estimate_s``)."""
    from meshplan import algorithms
    from meshplan.cost.bounds import schedule_timing

    for _, c in _unproven(result):
        alg = algorithms.get(c.algorithm)
        if not alg.search_may_build(c.n_ranks) or c.plan is None:
            continue
        plan = alg.variants(c.plan, result.topology)[0]
        timing = schedule_timing(alg.schedule(plan, result.topology), result.topology, contended=True)
        c.unproven_estimate_s = timing_estimate_s(timing)
        forget_built(c)
        plan.extra.pop("schedule", None)
