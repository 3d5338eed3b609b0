"""``search --tp T --dp D [--rank-order ORDER]``: rank a CP group's plans by the whole job's time.

The search itself runs for one CP group (``--gpus`` ranks, heads / TP, on that many devices of the topology);
then its ``top`` best candidates and each method's best (simulated here if the group search left them at their
bound, since sharing the job's links can reorder plans whose group times are close) are laid onto every CP
group's GPUs of the job (:func:`meshplan.plan.job.job_schedule`) and simulated together on the job's topology,
where the groups share NICs and links. Those candidates are re-ranked by that time (``job.together_s``); the
others keep their group order after them. A written schedule is group 0's on its job GPUs (simulating the
file gives ``job.alone_s``).

The plans themselves are still made for ``cp`` devices of the topology, not for the group's GPUs (a group that
TP spreads over nodes is planned as if it sat in one): the job simulation times them where they really run.
"""

from __future__ import annotations

from typing import Any

from meshplan import algorithms
from meshplan.cost.simulate import simulate
from meshplan.model.topology import Topology
from meshplan.plan.job import JobShape, job_schedule
from meshplan.search import SearchResult


def best_group_s(result: SearchResult) -> float | None:
    """The fastest simulated CP-group time of a search (seconds), or None."""
    return min((c.predicted.makespan_s for c in result.candidates
                if c.model_level == "simulated" and c.predicted.makespan_s), default=None)


def rerank_for_job(result: SearchResult, shape: JobShape, job_topo: Topology, top: int,
                   progress=None) -> dict[str, Any]:
    """Simulate the ``top`` best simulated candidates as the whole job and re-rank them by it.

    Fills each such candidate's ``job`` ({alone_s, together_s}; seconds, all passes) and returns the search's
    ``job`` object (the shape, the CP groups, how many candidates were timed as the job).
    """
    from meshplan.algorithms.base import topology_record
    from meshplan.search.candidate import simulate_candidate

    groups = shape.cp_groups()
    eligible = [c for c in result.candidates if not c.forward_only]
    timed = eligible[:top]
    for name in dict.fromkeys(c.algorithm for c in eligible):        # and each method's best: sharing the job's
        first = next(c for c in eligible if c.algorithm == name)     # links can reorder methods whose group
        if first not in timed:                                       # times are close or tied
            timed.append(first)
    for k, c in enumerate(timed):
        if progress:
            progress(k, len(timed), f"the job: {c.algorithm} {c.workload.layout}")
        if c.model_level != "simulated":      # left at its bound by the group search: the job may reorder it
            simulate_candidate(c, result.topology, result.ring_ccr)
        sched = c.schedule if c.schedule is not None else algorithms.get(c.algorithm).schedule(c.plan,
                                                                                                result.topology)
        together = simulate(job_schedule(sched, groups), job_topo)
        one = job_schedule(sched, groups[:1])
        one.topology = topology_record(job_topo)
        alone = simulate(one, job_topo)
        c.job = {"alone_s": float(sum(alone.pass_makespan.values())),
                 "together_s": float(sum(together.pass_makespan.values()))}
        c.schedule, c.sim = one, None                  # what --write writes: group 0 on its job GPUs
    rest = [c for c in result.candidates if c not in timed]
    result.candidates = sorted(timed, key=lambda c: c.job["together_s"]) + rest
    return shape.to_dict() | {"cp_groups": groups.tolist() if len(groups) <= 64 else None, "groups": len(groups),
                              "topology": {"name": job_topo.name, "devices": job_topo.n_devices},
                              "ranked_as_job": len(timed)}
