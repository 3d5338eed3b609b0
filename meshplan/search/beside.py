"""Simulations in a forked process beside other work (both cores): :func:`simulate_both` (two candidates at once, the
branch and bound's pairs) and :func:`simulate_beside` (candidates one after the other, chosen as the results come,
while the caller's work runs: Ring's reference settings beside the branch and bound). Where fork is not offered
(:func:`meshplan.core.parallel.can_fork`) each runs in turn and gives the same answer."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

from meshplan import algorithms
from meshplan.core.parallel import alongside as run_alongside
from meshplan.core.parallel import can_fork
from meshplan.model.topology import Topology
from meshplan.search.candidate import (
    Candidate,
    forget_built,
    keep_variant,
    simulate_candidate,
    simulate_unkept,
    simulate_variants,
    summary_only,
)

T = TypeVar("T")


def simulate_both(first: Candidate, second: Candidate, topo: Topology, ccr: float | None,
                  keep_below: float = -float("inf")) -> None:
    """:func:`simulate_candidate` of two candidates at once, ``second`` in a forked process
    (:func:`simulate_beside`; in turn where fork is not offered). ``second`` comes back with its simulation's
    summary, and with its schedule and timeline only if its simulated time is under ``keep_below`` (the branch and
    bound's best so far: the one it keeps, to write; ~0.1 s to pickle 0.5M ops against ~0.5 s to build them again) and
    its method does not build its representatives alone (then it is simulated so: :func:`simulate_unkept`)."""
    simulate_beside([second], lambda simulate: simulate(second), topo, ccr,
                    lambda: simulate_candidate(first, topo, ccr), keep_below)


def simulate_beside(pool: list[Candidate], run: Callable[[Callable[[Candidate], None]], Any], topo: Topology,
                    ccr: float | None, main: Callable[[], T],
                    keep_below: float = -float("inf")) -> tuple[T, list[Candidate]]:
    """(``main()``'s result, the candidates simulated beside it): ``run(simulate)``, which simulates candidates of
    ``pool`` one after the other by calling ``simulate(c)`` (and may choose the next by the results so far), runs in
    a forked process while ``main`` runs here (:func:`meshplan.core.parallel.alongside`; after ``main``, here, where
    fork is not offered: the same answer). Each comes back as :func:`simulate_candidate` leaves it but without its
    schedule (rebuilt where needed: written, improved) unless its simulated time is under ``keep_below`` and its
    method does not build its representatives alone (:func:`simulate_unkept`: no schedule then); its
    simulation's summary comes back (:func:`summary_only`; its timeline with its schedule). A candidate ``main``
    simulated itself meanwhile keeps its own (the same) result and is not among those returned."""
    if not pool:
        return main(), []
    if not can_fork():
        out = main()
        done: list[Candidate] = []

        def simulate_here(c: Candidate) -> None:
            if c.model_level != "simulated":
                simulate_candidate(c, topo, ccr)
                done.append(c)
        run(simulate_here)
        return out, done

    where = {id(c): i for i, c in enumerate(pool)}

    def side():
        got = []

        def simulate_there(c: Candidate) -> None:
            if algorithms.get(c.algorithm).quotient_builds:      # its representatives alone: no schedule to keep
                kept = simulate_unkept(c, topo, ccr)
                got.append((where[id(c)], kept, c.predicted, c.documents, c.sim, None))
                return
            kept = simulate_variants(c, topo, ccr)
            sched = c.schedule if c.predicted.makespan_s < keep_below else None
            sim = c.sim if sched is not None else summary_only(c.sim)     # its timeline goes with its schedule
            got.append((where[id(c)], kept, c.predicted, c.documents, sim, sched))
            forget_built(c)                       # this process's copy: its timeline already listed
        run(simulate_there)
        return got

    got, out = run_alongside(side, main)
    done = []
    for i, kept, pred, docs, sim, sched in got:
        c = pool[i]
        if c.model_level == "simulated":
            continue
        if kept:
            keep_variant(c, algorithms.get(c.algorithm).variants(c.plan, topo)[kept])
        c.predicted, c.model_level, c.documents, c.sim, c.schedule = pred, "simulated", docs, sim, sched
        done.append(c)
    return out, done
