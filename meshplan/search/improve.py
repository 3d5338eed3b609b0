"""``search --scheduler ilp|auto``: CP-SAT stream orders for the simulated candidates, re-simulated, the better kept;
``search --map-search EVALS``: a rank -> GPU placement search for the best ones (:func:`improve_mapping`).

Which candidates: the simulated ones that could still matter — each of the ``write`` best, and any whose
closed-form bound is below the best simulated makespan (an order can only take it down towards its bound) —
whose model has at most ``ILP_MAX_INTERVALS`` intervals (:func:`meshplan.search.ilp.model.model_size`). ``auto``
solves only where the greedy makespan is more than ``AUTO_GAP`` above the closed-form bound; ``ilp`` wherever the
size allows. The solver's order is written into a copy of the schedule (:func:`meshplan.search.ilp.model.apply_order`),
verified and re-simulated; the faster of greedy and CP-SAT after re-simulation is kept, and the candidates are
ranked again. Each candidate's ``scheduler`` object (docs/formats.md) says what was requested, which order was
kept, the solver's status, its objective and proven bound (in its own model: not the candidate's closed-form
``bound_s``), the gap and the solve time (model building included); also the greedy order's makespan in that
model and simulated, the CP-SAT order's simulated makespan, and why the solver did not run where it did not.
"""

from __future__ import annotations

from typing import Any, Callable

from meshplan import algorithms
from meshplan.cost.metrics import predicted
from meshplan.cost.simulate import simulate
from meshplan.plan.verify import verify
from meshplan.search.candidate import Candidate
from meshplan.search.ranking import ranked

#: Largest model (intervals) the search gives to CP-SAT: the scheduling notes found proofs up to ~500 fixed
#: intervals in seconds and gaps of 2-3% at 2k-8k in 10-30 s on 2 cores.
ILP_MAX_INTERVALS = 3000
#: ``auto`` solves where the greedy simulated makespan is more than this fraction above the closed-form bound.
AUTO_GAP = 0.03
SCHEDULERS = ("greedy", "ilp", "auto")
#: ``status`` of a candidate the solver saw (OR-Tools' names, lower case); ``not_run`` otherwise
STATUSES_RUN = ("optimal", "feasible", "infeasible", "unknown")


def not_run(requested: str, reason: str | None = None) -> dict[str, Any]:
    """The ``scheduler`` object of a candidate the solver did not see."""
    body = {"requested": requested, "kept": "greedy", "status": "not_run", "objective_s": None, "bound_s": None,
            "gap": None, "solve_s": 0.0}
    return body | ({"reason": reason} if reason else {})


def improve(result, scheduler: str, *, time_limit_s: float, workers: int = 0, write: int = 1,
            memory_limit: float | None = None, progress: Callable[[int, int, str], None] | None = None) -> None:
    """Run CP-SAT on ``result``'s eligible candidates (module docstring); re-rank them in place.

    Raises:
        ValueError: unknown ``scheduler``.
    """
    import time

    from meshplan.search.ilp import model as ilp

    t0 = time.perf_counter()
    if scheduler not in SCHEDULERS:
        raise ValueError(f"scheduler must be one of {SCHEDULERS}")
    for c in result.candidates:
        c.scheduler = not_run(scheduler, "--scheduler greedy" if scheduler == "greedy" else "not simulated")
    if scheduler == "greedy":
        return
    topo = result.topology
    sim = [c for c in result.candidates if c.model_level == "simulated" and not c.forward_only]
    if not sim:
        return
    best = min(c.predicted.makespan_s for c in sim)
    chosen = [c for k, c in enumerate(sim) if k < max(write, 1) or c.bound_s < best]
    picked = {id(c) for c in chosen}          # by identity: candidates hold arrays, == would compare them
    for c in sim:
        if id(c) not in picked:
            c.scheduler = not_run(scheduler, "its bound is above the best makespan")
    for k, c in enumerate(chosen):
        if progress:
            progress(k, len(chosen), f"CP-SAT {c.algorithm} {c.workload.layout}")
        greedy_s = c.predicted.makespan_s
        if scheduler == "auto" and greedy_s <= c.bound_s * (1 + AUTO_GAP):
            c.scheduler = not_run(scheduler, f"greedy within {AUTO_GAP:.0%} of the bound")
            continue
        sched = _schedule_of(c, topo)
        size = ilp.model_size(sched, topo)
        if size > ILP_MAX_INTERVALS:
            c.scheduler = not_run(scheduler, f"{size} intervals > {ILP_MAX_INTERVALS}")
            continue
        res = ilp.solve(sched, topo, time_limit_s=time_limit_s, workers=workers,
                        memory_bytes=_buffer_budget(sched, topo, memory_limit))
        body = {"requested": scheduler, "kept": "greedy", "status": res.status, "objective_s": res.objective_s,
                "bound_s": res.bound_s, "gap": res.gap, "solve_s": res.solve_s, "greedy_model_s": res.greedy_s,
                "intervals": res.n_intervals, "greedy_makespan_s": greedy_s, "ilp_makespan_s": None}
        if res.start_s is not None:
            new = ilp.apply_order(sched, res.start_s, res.orders)
            report = verify(new, topo.memory_bytes)
            if not report.ok:
                raise RuntimeError(f"internal error: the CP-SAT order fails verification: {report.violations[0]}")
            new_sim = simulate(new, topo)
            new_s = sum(new_sim.pass_makespan.values())
            body["ilp_makespan_s"] = new_s
            if new_s < greedy_s * (1 - 1e-9):
                _keep(c, new, new_sim, topo, result.ring_ccr)
                body["kept"] = "ilp"
        c.scheduler = body
    _rerank(result, sim)
    result.wall_s += time.perf_counter() - t0


def _keep(c: Candidate, sched, sim, topo, ccr) -> None:
    """Adopt the re-simulated CP-SAT order as the candidate's schedule and prediction."""
    c.schedule, c.sim = sched, sim
    c.predicted = predicted(sched, topo, sim, ccr)


def improve_mapping(result, max_evals: int, *, write: int = 1,
                    progress: Callable[[int, int, str], None] | None = None) -> None:
    """``search --map-search EVALS``: a placement search (:func:`meshplan.search.mapping.search_mapping`) for each of
    the ``write`` best simulated candidates (at most ``MAX_RANKS`` ranks), re-ranked in place; each candidate's
    ``mapping_search`` object says what it found (None where it did not run)."""
    import time

    from meshplan.search.mapping import MAX_RANKS, search_mapping, with_devices

    t0 = time.perf_counter()
    topo = result.topology
    sim = [c for c in result.candidates if c.model_level == "simulated" and not c.forward_only]
    if max_evals <= 0 or not sim or result.n_ranks > MAX_RANKS:
        return
    for k, c in enumerate(sim[:max(write, 1)]):
        if progress:
            progress(k, min(len(sim), max(write, 1)), f"placement {c.algorithm} {c.workload.layout}")
        sched = _schedule_of(c, topo)
        res = search_mapping(sched, topo, max_evals=max_evals)
        c.mapping_search = res.to_dict()
        if res.best_s < c.predicted.makespan_s * (1 - 1e-9):
            new = with_devices(sched, res.device_of_rank)
            _keep(c, new, simulate(new, topo), topo, result.ring_ccr)
    _rerank(result, sim)
    result.wall_s += time.perf_counter() - t0


def _schedule_of(c: Candidate, topo):
    """The candidate's schedule, rebuilt if the search dropped it (as ``write_best`` does)."""
    if c.schedule is None:
        c.schedule = algorithms.get(c.algorithm).schedule(c.plan, topo)
    return c.schedule


def _rerank(result, sim: list[Candidate]) -> None:
    """The simulated candidates by predicted makespan, then the rest in their order."""
    result.candidates[:] = ranked(result.candidates)


def _buffer_budget(sched, topo, memory_limit: float | None) -> float:
    """What ``--memory-limit`` (default: the device's memory) leaves the buffers once the largest op's workspace
    and the runtime's memory are set aside (:mod:`meshplan.cost.memory`): the CP-SAT reservoir bounds buffers
    only (never below the greedy order's level)."""
    from meshplan.cost.memory import op_workspace_bytes
    spec = topo.memory_model
    limit = topo.memory_bytes if memory_limit is None else memory_limit
    usable = (limit - spec.runtime_bytes) / spec.overhead_factor
    return max(usable - float(op_workspace_bytes(sched, spec).max(initial=0.0)), 0.0)
