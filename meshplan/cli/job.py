"""``meshplan simulate --tp T --dp D [--rank-order ORDER]``: one CP group's plan, run by every CP group of the job."""

from __future__ import annotations

from meshplan.core.errors import UserError
from meshplan.core.units import fmt_seconds


def job_setup(gpus, topo, workload, tp, dp, rank_order, scheduler, map_search):
    """``search --tp/--dp``: (the job shape, the CP group's workload, the job's topology).

    Raises:
        UserError: a bad job shape, TP that does not divide the heads, a job larger than the topology, or a
            search option the job ranking does not take yet.
    """
    from meshplan.cli.options import topology
    from meshplan.plan.job import JobShape

    if scheduler != "greedy" or map_search:
        flag = "--scheduler" if scheduler != "greedy" else "--map-search"
        raise UserError(flag, "is not combined with --tp/--dp yet", f"drop {flag}, or search the CP group alone")
    shape = JobShape(tp, gpus, dp, rank_order)
    cp_w = shape.cp_workload(workload)
    try:
        job_topo = topology(topo, shape.world, "search")
    except UserError as err:
        raise UserError("--dp" if dp > 1 else "--tp", f"a TP {tp} x CP {gpus} x DP {dp} job needs {shape.world} "
                        f"GPUs: {err.problem}", err.fix) from None
    return shape, cp_w, job_topo


def simulate_job(algo, gpus, topo, workload, knobs, tp, dp, rank_order, out, trace, as_json, emit) -> None:
    """Plan ``algo`` for one CP group of ``gpus`` ranks (heads / TP) and simulate all TP x DP groups together on
    the job's GPUs (:mod:`meshplan.plan.job`); ``predicted`` is the job's (its slowest group), ``job.alone_s`` group 0
    alone on its own GPUs. ``--out`` writes group 0's schedule on its GPUs of the job's topology (simulating the
    file gives ``alone_s``)."""
    from meshplan.algorithms import get
    from meshplan.algorithms.ring import ring_ccr
    from meshplan.cli.options import topology
    from meshplan.cli.simulate import schedule_title, write_timeline_trace, write_verified
    from meshplan.cost.metrics import predicted
    from meshplan.cost.simulate import simulate
    from meshplan.plan.job import JobShape, job_schedule
    from meshplan.search.candidate import predict, result_json

    if algo is None:
        raise UserError("--algo", "simulate --tp/--dp needs an algorithm", "give --algo NAME (ring, pass-q, ...)")
    get(algo)
    if gpus is None:
        raise UserError("--gpus", "with --tp/--dp, --gpus is the CP group size", "give --gpus N")
    if out is not None and not (out.endswith(".json") or out.endswith(".json.gz")):
        raise UserError("--out", f"{out!r} is not a .json or .json.gz name", "name the file *.json or *.json.gz")
    shape = JobShape(tp, gpus, dp, rank_order)
    cp_w = shape.cp_workload(workload)
    group_topo = topology(topo, gpus, "simulate")
    try:
        job_topo = topology(topo, shape.world, "simulate")
    except UserError as err:
        raise UserError("--dp" if dp > 1 else "--tp", f"a TP {tp} x CP {gpus} x DP {dp} job needs {shape.world} "
                        f"GPUs: {err.problem}", err.fix) from None
    cand = predict(algo, cp_w, group_topo, gpus, knobs)
    groups = shape.cp_groups()
    job = job_schedule(cand.schedule, groups)
    sim = simulate(job, job_topo)
    alone = simulate(job_schedule(cand.schedule, groups[:1]), job_topo)
    ccr = ring_ccr(cp_w, group_topo, gpus)
    body_predicted = predicted(job, job_topo, sim, ccr)
    body = result_json(cand) | {"topology": {"name": job_topo.name, "devices": job_topo.n_devices}}
    body["predicted"] = body_predicted.json()
    body["simulation"] = sim.json()
    body["job"] = shape.to_dict() | {
        "cp_groups": groups.tolist() if len(groups) <= 64 else None, "groups": len(groups),
        "alone_s": float(sum(alone.pass_makespan.values())), "together_s": float(sum(sim.pass_makespan.values())),
        "heads_per_group": cp_w.n_heads, "kv_heads_per_group": cp_w.n_kv_heads}
    if out is not None:                      # group 0 on its own GPUs of the job's topology
        from meshplan.algorithms.base import topology_record
        one = job_schedule(cand.schedule, groups[:1])
        one.topology = topology_record(job_topo)
        write_verified(one, job_topo, out)
        body["schedule_path"] = out
    if trace is not None:
        write_timeline_trace(job, sim, trace)
    title = schedule_title(cand.algorithm, cand.knobs, job_topo, shape.world, cp_w)
    emit(body, as_json, lambda console: _print_job(body, console, title, groups[0].tolist()))


def _print_job(body: dict, console, title: str, group0: list[int]) -> None:
    """The job's predicted metrics, then group 0 alone against all groups together."""
    from meshplan.show.tables import print_simulation

    print_simulation(body, console, title)
    j = body["job"]
    slower = j["together_s"] / j["alone_s"] - 1 if j["alone_s"] > 0 else 0.0
    console.print(f"job TP {j['tp']} x CP {j['cp']} x DP {j['dp']} ({j['order']}, innermost first): "
                  f"{j['groups']} CP groups at once, group 0 on GPUs {group0}; group 0 alone "
                  f"{fmt_seconds(j['alone_s'])}, all groups together {fmt_seconds(j['together_s'])} "
                  f"({slower:+.1%})")
