"""CP-SAT stream orders (meshplan.search.ilp.model) and search --scheduler: references are the flow-shop optimum of a
plain ring (docs/cost-model.md: Johnson's rule, no search needed), the order-independent compute bound, and the
simulator re-run on the reordered schedule."""

from __future__ import annotations

import json

import numpy as np
import pytest
from typer.testing import CliRunner

from meshplan.cli.app import app
from meshplan.cost.bounds import schedule_timing
from meshplan.cost.cost import CostModel
from meshplan.cost.simulate import simulate
from meshplan.model.topology import Topology
from meshplan.model.workload import resolve
from meshplan.plan.schedule import KIND
from meshplan.plan.verify import verify
from meshplan.search.candidate import make_candidate, simulate_candidate
from meshplan.search.ilp import model as ilp
from meshplan.search.improve import STATUSES_RUN


def _cand(topo_name: str, n: int, alg: str, knobs: dict, seq: str = "16K", passes: str = "fwd+bwd"):
    topo = Topology.load(topo_name, gpus=n)
    w = resolve(seq_len=seq, heads=8, kv_heads=2, head_dim=64, layout="zigzag", mask="causal", passes=passes)
    c = make_candidate(alg, w, topo, n, knobs)
    simulate_candidate(c, topo, None)
    return c, topo


def test_ring_on_nvswitch_greedy_is_proven_optimal():
    """No shared links and one input per block: a two-machine flow shop, whose greedy order is optimal."""
    c, topo = _cand("h100x8", 4, "ring", {})
    r = ilp.solve(c.schedule, topo, time_limit_s=30, workers=1)
    assert r.status == "optimal" and r.gap == 0.0
    assert r.objective_s == pytest.approx(r.greedy_s, rel=1e-9)
    # on NVSwitch nothing contends, so the model's makespan is the uncontended evaluation of the greedy order
    uncontended = sum(t.makespan_s for t in schedule_timing(c.schedule, topo).values())
    assert r.greedy_s == pytest.approx(uncontended, rel=1e-4)


@pytest.mark.parametrize("topo_name", ["h100x8", "l20x8"])
def test_mesh_order_is_no_worse_than_greedy_and_bounded(topo_name):
    c, topo = _cand(topo_name, 4, "mesh", {"tile": "2x2"})
    sched = c.schedule
    r = ilp.solve(sched, topo, time_limit_s=30, workers=1)
    assert r.status == "optimal"
    assert r.bound_s <= r.objective_s <= r.greedy_s * (1 + 1e-9)
    dur = CostModel(topo).op_durations(sched)
    busy = np.isin(sched.ops.kind, [KIND["compute"], KIND["merge"], KIND["accumulate"]])
    per_rank = [max(np.bincount(sched.ops.rank[busy & (sched.ops.phase == p)],
                                weights=dur[busy & (sched.ops.phase == p)], minlength=4)) for p in sched.passes]
    assert r.objective_s >= sum(per_rank) * (1 - 1e-6)       # no order beats every rank's compute
    new = ilp.apply_order(sched, r.start_s, r.orders)
    assert verify(new, topo.memory_bytes).ok
    assert sum(simulate(new, topo).pass_makespan.values()) > 0
    # the same ops, each rank's program reordered: FLOPs and bytes unchanged
    assert np.array_equal(np.sort(new.ops.flops), np.sort(sched.ops.flops))
    assert new.ops.size_bytes.sum() == sched.ops.size_bytes.sum()


def test_apply_order_with_the_original_order_is_the_same_schedule():
    c, topo = _cand("l20x8", 4, "mesh", {"tile": "2x2"})
    sched = c.schedule
    same = ilp.apply_order(sched, np.arange(len(sched.ops), dtype=float))
    for name in ("rank", "kind", "stream", "deps", "dep_ptr", "inputs", "q_chunks"):
        assert np.array_equal(getattr(same.ops, name), getattr(sched.ops, name)), name
    assert np.array_equal(same.tensors.alloc_op, sched.tensors.alloc_op)
    assert simulate(same, topo).pass_makespan == simulate(sched, topo).pass_makespan


def test_reordering_keeps_hazard_orders_as_deps():
    """CHARM+ writes and sends one buffer on one stream (order alone protects it): the solver keeps every hazard
    pair in time, and the reordered schedule carries the cross-stream ones as deps."""
    c, topo = _cand("h100x8", 4, "charm", {"domains": 2}, seq="8K", passes="fwd")
    sched = c.schedule
    r = ilp.solve(sched, topo, time_limit_s=20, workers=1)
    assert r.start_s is not None and r.orders is not None and len(r.orders[0])
    a, b = r.orders
    assert (sched.ops.rank[a] == sched.ops.rank[b]).all() and (a < b).all()
    assert (r.start_s[b] >= r.start_s[a]).all()
    new = ilp.apply_order(sched, r.start_s, r.orders)
    report = verify(new, topo.memory_bytes)
    assert report.ok, report.violations[:3]
    cross = sched.ops.stream[a] != sched.ops.stream[b]
    assert len(new.ops.deps) >= len(sched.ops.deps) and (not cross.any() or len(new.ops.deps) > len(sched.ops.deps)
                                                         or _all_deps_already(sched, a[cross], b[cross]))


def _all_deps_already(sched, a, b) -> bool:
    owner = np.repeat(np.arange(len(sched.ops)), np.diff(sched.ops.dep_ptr))
    have = set(zip(sched.ops.deps.tolist(), owner.tolist()))
    return all((int(x), int(y)) in have for x, y in zip(a, b))


def test_solve_refuses_a_bad_time_limit():
    c, topo = _cand("h100x8", 4, "ring", {}, passes="fwd")
    with pytest.raises(ValueError, match="time_limit_s"):
        ilp.solve(c.schedule, topo, time_limit_s=0)


def test_search_ilp_reports_scheduler_and_keeps_the_better(tmp_path):
    r = CliRunner().invoke(app, ["search", "--gpus", "4", "--topo", "l20x8", "--seq-len", "16K", "--heads", "8",
                                 "--kv-heads", "2", "--head-dim", "64", "--algos", "mesh,ring", "--scheduler", "ilp",
                                 "--ilp-time-limit-s", "5", "--ilp-workers", "1", "--write", "1",
                                 "--out", str(tmp_path), "--json"])
    assert r.exit_code == 0, r.stderr
    body = json.loads(r.stdout)
    ran = [c for c in body["candidates"] if c["scheduler"]["status"] != "not_run"]
    assert ran, "the best candidate is always given to the solver"
    for c in body["candidates"]:
        s = c["scheduler"]
        assert s["requested"] == "ilp" and s["kept"] in ("greedy", "ilp")
        assert set(s) >= {"requested", "kept", "status", "objective_s", "bound_s", "gap", "solve_s"}
    for c in ran:
        s = c["scheduler"]
        assert s["status"] in STATUSES_RUN
        if s["objective_s"] is not None:
            assert s["bound_s"] <= s["objective_s"] * (1 + 1e-12) and 0 <= s["gap"] <= 1
        if s["kept"] == "ilp":     # kept only when the re-simulated order is faster
            assert c["predicted"]["makespan_s"] == pytest.approx(s["ilp_makespan_s"])
            assert s["ilp_makespan_s"] < s["greedy_makespan_s"]
            assert c["schedule_path"] is None or c["schedule_path"].endswith("-cpsat.json")
    sim = [c["predicted"]["makespan_s"] for c in body["candidates"] if c["model_level"] == "simulated"]
    assert sim == sorted(sim)
    written = body["candidates"][0]["schedule_path"]
    assert written and json.loads(open(written).read())["algorithm"] == body["candidates"][0]["algorithm"]


@pytest.mark.parametrize("flag,value", [("--ilp-time-limit-s", "0"), ("--ilp-time-limit-s", "inf"),
                                        ("--ilp-workers", "-1"), ("--ilp-workers", "100000"),
                                        ("--scheduler", "optimal"), ("--write", "-3"), ("--top", "-1")])
def test_search_scheduler_flags_bad_values(flag, value):
    r = CliRunner().invoke(app, ["search", "--gpus", "4", "--topo", "l20x8", "--seq-len", "16K", "--write", "0",
                                 "--scheduler", "ilp", flag, value])
    assert r.exit_code == 2 and flag in r.stderr and r.stderr.count("\n") == 1


def test_placement_search_recovers_the_ring_placement():
    """A ring placed alternately across the sockets of l20x8 crosses the socket link at every hop; the identity
    placement (two crossings) is the reference the search must reach."""
    from meshplan.search.mapping import makespan_s, search_mapping, with_devices
    c, topo = _cand("l20x8", 8, "ring", {}, seq="32K")
    identity = makespan_s(with_devices(c.schedule, np.arange(8)), topo)
    bad = with_devices(c.schedule, np.array([0, 4, 1, 5, 2, 6, 3, 7]))
    r = search_mapping(bad, topo, max_evals=200)
    assert r.start_s > identity * 1.05
    assert r.best_s <= identity * (1 + 1e-9) and r.swaps >= 1 and r.evals <= 200
    assert sorted(r.device_of_rank.tolist()) == list(range(8))
    assert makespan_s(with_devices(c.schedule, r.device_of_rank), topo) == pytest.approx(r.best_s, rel=1e-12)


def test_placement_search_skips_alike_devices_and_refuses_bad_budgets():
    from meshplan.search.mapping import _alike, _signature, search_mapping
    c, topo = _cand("l20x8", 8, "ring", {}, passes="fwd")
    sig = _signature(topo, np.arange(8))
    assert _alike(sig, 0, 1) and not _alike(sig, 0, 2) and not _alike(sig, 0, 4)   # 2 GPUs per PCIe switch
    with pytest.raises(ValueError, match="max_evals"):
        search_mapping(c.schedule, topo, max_evals=0)


def test_search_map_search_reports_and_writes_the_placement(tmp_path):
    r = CliRunner().invoke(app, ["search", "--gpus", "8", "--topo", "l20x8", "--seq-len", "16K", "--heads", "8",
                                 "--kv-heads", "2", "--head-dim", "64", "--algos", "usp", "--map-search", "30",
                                 "--write", "1", "--out", str(tmp_path), "--json"])
    assert r.exit_code == 0, r.stderr
    best = json.loads(r.stdout)["candidates"][0]
    m = best["mapping_search"]
    assert m["evals"] <= 30 and m["best_s"] <= m["start_s"]
    assert best["predicted"]["makespan_s"] == pytest.approx(m["best_s"], rel=1e-9)
    assert json.loads(open(best["schedule_path"]).read())["device_of_rank"] == m["device_of_rank"]


@pytest.mark.heavy
def test_buffer_reservoir_binds_only_when_memory_is_short():
    """With the device's memory the buffers always fit (no constraint); with none to spare they are held at
    the greedy order's level: a more constrained model, so its objective is no better than the free optimum."""
    from meshplan.search.ilp.hint import greedy_solution
    c, topo = _cand("l20x8", 4, "mesh", {"tile": "2x2"})
    counts = {}
    for mem in (None, 0):
        model = ilp._Model(c.schedule, topo, True)
        model.build()
        value, _ = greedy_solution(model)
        before = len(model.m.Proto().constraints)
        model.add_reservoirs(lambda v, value=value: value[v], topo.memory_bytes if mem is None else mem)
        counts[mem] = len(model.m.Proto().constraints) - before
    assert counts[None] == 0 and counts[0] > 0
    free = ilp.solve(c.schedule, topo, time_limit_s=20, workers=1, memory=False)
    held = ilp.solve(c.schedule, topo, time_limit_s=5, workers=1, memory_bytes=0)
    assert free.status == "optimal" and held.objective_s >= free.objective_s * (1 - 1e-9)
    assert held.objective_s <= held.greedy_s * (1 + 1e-9)


@pytest.mark.heavy
def test_symmetric_nodes_are_modelled_once_and_stay_symmetric():
    """Two alike H100 nodes: node 0's ranks are modelled, every rank takes its representative's order, so the
    reordered schedule still simulates one node's ranks (and verifies)."""
    c, topo = _cand("h100x16", 16, "mesh", {"tile": "4x4"}, seq="32K", passes="fwd")
    model = ilp._Model(c.schedule, topo, True)
    assert model.reduced and len(model.red.reps) == 8
    assert ilp.model_size(c.schedule, topo) < len(c.schedule.ops)
    r = ilp.solve(c.schedule, topo, time_limit_s=5, workers=1)
    assert r.status in ("optimal", "feasible") and r.objective_s <= r.greedy_s * (1 + 1e-9)
    new = ilp.apply_order(c.schedule, r.start_s, r.orders)
    assert verify(new, topo.memory_bytes).ok
    assert simulate(new, topo).reps == 8


@pytest.mark.parametrize("topo_name,n,alg,knobs", [("l20x8", 8, "mesh", {"tile": "2x4"}),
                                                   ("h100x16", 16, "charm", {}), ("cpu-local", 4, "ring", {})])
def test_list_scheduled_greedy_order_satisfies_the_model(topo_name, n, alg, knobs):
    """The hint is a solution: every variable fixed to it, CP-SAT finds the model feasible, at the greedy value."""
    from ortools.sat.python import cp_model

    from meshplan.search.ilp.hint import greedy_solution
    c, topo = _cand(topo_name, n, alg, knobs, seq="8K" if topo_name == "cpu-local" else "32K")
    model = ilp._Model(c.schedule, topo, True)
    objective = model.build()
    value, makespan_ns = greedy_solution(model)
    model.add_reservoirs(lambda v: value[v], 0)          # the tightest buffer cap: the greedy level itself
    for var, x in value.items():
        model.m.Add(var == int(x))
    solver = cp_model.CpSolver()
    solver.parameters.max_time_in_seconds = 20
    solver.parameters.num_workers = 1
    assert solver.Solve(model.m) == cp_model.OPTIMAL
    assert solver.Value(objective) == makespan_ns
    # and it is no faster than the uncontended evaluation of the same order (contention only delays)
    uncontended = sum(t.makespan_s for t in schedule_timing(c.schedule, topo).values())
    assert makespan_ns / 1e9 >= uncontended * (1 - 1e-6)
