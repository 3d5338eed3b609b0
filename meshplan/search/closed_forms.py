"""The closed forms of many candidates at once (a search's enumeration), on both cores: :func:`make_candidates`."""

from __future__ import annotations

from typing import Any

from meshplan.algorithms.base import BuildCache, PassTiming
from meshplan.core.errors import SkipCandidate
from meshplan.core.parallel import alongside as run_alongside
from meshplan.core.parallel import can_fork, shared_counter
from meshplan.model.matrix import AttnMatrix
from meshplan.model.topology import Topology
from meshplan.model.workload import Workload
from meshplan.plan.plan import Plan
from meshplan.search.candidate import Candidate, plan_candidate

#: closed forms that build a schedule cost ~0.1–1 s each from this many ranks: worth a second process
PARALLEL_MIN_RANKS = 64
#: from this many ranks the schedule-free closed forms cost ~0.02-0.1 s each too (Mesh: ~70-90 plans), and are
#: halved between the two processes where none builds a schedule (from 128 ranks the search starts the methods that
#: build from their schedule-free bounds: ``BuiltTiming.lazy``)
LIGHT_SPLIT_MIN_RANKS = 128


def make_candidates(jobs: list[tuple[str, Workload, dict[str, Any], AttnMatrix | None]], topo: Topology,
                    n_ranks: int, builds: BuildCache | None = None) -> list[Candidate | SkipCandidate]:
    """:func:`make_candidate` of every (name, workload, knobs, matrix) job, in order; a job the method cannot run
    gives its :class:`SkipCandidate`. From :data:`PARALLEL_MIN_RANKS` ranks the closed forms that build a schedule
    (``BuiltTiming``: up to a second each at 256 ranks) are shared between this process and a forked one
    (:func:`meshplan.core.parallel.alongside`; in turn where fork is not offered), halved by count; the
    schedule-free closed forms (~1/50 of one each) stay here and count against this process's half. Where none
    builds a schedule, from :data:`LIGHT_SPLIT_MIN_RANKS` ranks, the two processes take the schedule-free ones one
    at a time, in order, whichever is free (:func:`~meshplan.core.parallel.shared_counter`).

    Raises:
        UserError: bad knob values or an impossible workload.
    """
    from meshplan.algorithms.base import BuiltTiming

    planned: list[tuple[Any, Plan, Workload] | SkipCandidate] = []
    for name, w, knobs, matrix in jobs:
        try:
            planned.append(plan_candidate(name, w, topo, n_ranks, knobs, matrix, builds))
        except SkipCandidate as skip:
            planned.append(skip)
    todo = [i for i, p in enumerate(planned) if not isinstance(p, SkipCandidate)]
    for i in todo:                       # start from the schedule-free bound; built when the search simulates it
        if planned[i][0].lazy(n_ranks):
            planned[i][1].extra["lazy"] = True
    heavy = [i for i in todo if isinstance(planned[i][0], BuiltTiming) and planned[i][0].builds_to_time(n_ranks)
             and not planned[i][1].extra.get("lazy")]
    light = sorted(set(todo) - set(heavy))
    def timings(idx: list[int]) -> dict[int, dict[str, PassTiming]]:
        return {i: planned[i][0].timing(planned[i][1], topo) for i in idx}

    if n_ranks >= PARALLEL_MIN_RANKS and len(heavy) >= 2 and can_fork():
        light_cost = 0.02 * len(light)                         # the schedule-free closed forms, kept here
        k = min(len(heavy) - 1, round((len(heavy) + light_cost) / 2))
        side = sorted((heavy[0::2] + heavy[1::2])[:k])         # every other first: each method on both sides
        side_t, mine_t = run_alongside(lambda: timings(side), lambda: timings(sorted(set(todo) - set(side))))
    elif n_ranks >= LIGHT_SPLIT_MIN_RANKS and len(light) >= 8 and can_fork():
        # one at a time, in order, to whichever process is free: their costs differ 100-fold (a Mesh tile's link
        # geometry against a Ring bound), so halves by count left one process idle for a third of the time
        take = shared_counter()

        def pulled() -> dict[int, dict[str, PassTiming]]:
            got = {}
            while (k := take()) < len(light):
                got |= timings([light[k]])
            return got
        side_t, mine_t = run_alongside(pulled, lambda: timings(heavy) | pulled())
    else:
        side_t, mine_t = {}, timings(todo)
    timing = side_t | mine_t
    return [p if isinstance(p, SkipCandidate) else
            Candidate(p[0].name, p[2], p[1].knobs, n_ranks, plan=p[1], timing=timing[i]) for i, p in enumerate(planned)]
