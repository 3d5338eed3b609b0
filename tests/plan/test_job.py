"""CP inside a TP x CP x DP job (meshplan.plan.job): Megatron-LM's rank placement, and concurrent CP groups sharing the
NICs (the hand-computed max-min share of the node aggregate)."""

from __future__ import annotations

import json

import numpy as np
import pytest
from typer.testing import CliRunner

from meshplan.cli.app import app
from meshplan.core.errors import UserError
from meshplan.cost.simulate import simulate
from meshplan.model.topology import Topology
from meshplan.model.workload import resolve
from meshplan.plan.job import JobShape, job_schedule
from meshplan.plan.schedule import SEND
from meshplan.search.candidate import predict


@pytest.mark.parametrize("tp,cp,dp,order,groups", [
    # Megatron-LM RankGenerator, order tp-cp-ep-dp-pp (TP innermost): CP groups are TP apart
    (2, 2, 2, "tp-cp-dp", [[0, 2], [1, 3], [4, 6], [5, 7]]),
    (2, 4, 2, "tp-cp-dp", [[0, 2, 4, 6], [1, 3, 5, 7], [8, 10, 12, 14], [9, 11, 13, 15]]),
    (1, 4, 2, "tp-cp-dp", [[0, 1, 2, 3], [4, 5, 6, 7]]),
    (2, 2, 2, "cp-tp-dp", [[0, 1], [2, 3], [4, 5], [6, 7]]),
    (2, 2, 2, "dp-tp-cp", [[0, 4], [2, 6], [1, 5], [3, 7]]),
])
def test_cp_groups_follow_the_rank_order(tp, cp, dp, order, groups):
    shape = JobShape(tp, cp, dp, order)
    got = shape.cp_groups()
    assert got.tolist() == groups
    assert sorted(got.ravel().tolist()) == list(range(shape.world))


def test_tp_divides_the_heads():
    w = resolve(heads=32, kv_heads=8)
    assert JobShape(tp=4, cp=2).cp_workload(w).n_heads == 8 and JobShape(tp=4, cp=2).cp_workload(w).n_kv_heads == 2
    with pytest.raises(UserError, match="--tp"):
        JobShape(tp=16, cp=2).cp_workload(w)
    with pytest.raises(UserError, match="--rank-order"):
        JobShape(order="tp-dp")


def test_concurrent_groups_share_the_node_aggregate():
    """TP 8 x CP 2 on two H100 nodes: the 8 CP groups are [t, t + 8], so each ring step sends 8 flows per direction
    across the nodes; the node aggregate (40 GB/s, declared) gives each 40/8 GB/s, where one group alone runs at
    the per-flow cap (26.15 GB/s)."""
    job_topo = Topology.load("h100x16", gpus=16)
    aggregate = job_topo.spec.node.nics.node_aggregate_GBps * 1e9
    assert aggregate / 8 < 26.15e9
    group_topo = Topology.load("h100x16", gpus=2)
    w = resolve(seq_len="64K", heads=64, kv_heads=64, head_dim=128, passes="fwd")
    shape = JobShape(tp=8, cp=2)
    cand = predict("ring", shape.cp_workload(w), group_topo, 2, {})
    groups = shape.cp_groups()
    for k, rate in ((8, aggregate / 8), (1, 26.15e9)):
        job = job_schedule(cand.schedule, groups[:k])
        sim = simulate(job, job_topo)
        o = job.ops
        sends = np.flatnonzero(o.kind == SEND)
        first = sends[sim.start[sends] == sim.start[sends].min()]
        lat, _ = job_topo.pair_stats(job.device_of_rank[o.rank[first]], job.device_of_rank[o.peer[first]])
        expected = lat + o.size_bytes[first] / rate
        assert len(first) == 2 * k
        np.testing.assert_allclose(sim.end[first] - sim.start[first], expected, rtol=1e-9)


def test_job_schedule_copies_the_group_onto_its_devices():
    topo = Topology.load("h100x16", gpus=4)
    w = resolve(seq_len="16K", heads=8, kv_heads=2, head_dim=64)
    cand = predict("ring", w, topo, 4, {})
    groups = np.array([[0, 2, 4, 6], [1, 3, 5, 7]])
    job = job_schedule(cand.schedule, groups)
    assert job.n_ranks == 8 and job.device_of_rank.tolist() == [0, 2, 4, 6, 1, 3, 5, 7]
    n = len(cand.schedule.ops)
    assert np.array_equal(job.ops.kind[n:], cand.schedule.ops.kind)
    assert np.array_equal(job.ops.deps[len(cand.schedule.ops.deps):] - n, cand.schedule.ops.deps)
    partner, ok, problems = job.match_transfers()
    assert not problems and (job.ops.rank[partner[partner >= 0]] // 4 == job.ops.rank[partner >= 0] // 4).all()
    with pytest.raises(ValueError):
        job_schedule(cand.schedule, np.array([[0, 1, 2, 3], [3, 4, 5, 6]]))


def test_simulate_job_cli(tmp_path):
    r = CliRunner().invoke(app, ["simulate", "--algo", "ring", "--gpus", "2", "--tp", "8", "--topo", "h100x16",
                                 "--seq-len", "64K", "--heads", "8", "--kv-heads", "8", "--head-dim", "128",
                                 "--pass", "fwd", "--json"])
    assert r.exit_code == 0, r.stderr
    body = json.loads(r.stdout)
    j = body["job"]
    assert (j["tp"], j["cp"], j["dp"], j["groups"], j["heads_per_group"]) == (8, 2, 1, 8, 1)
    assert j["cp_groups"][0] == [0, 8] and j["together_s"] > j["alone_s"]
    assert body["predicted"]["makespan_s"] == pytest.approx(j["together_s"])


@pytest.mark.parametrize("args,flag", [(["--tp", "3"], "--tp"), (["--rank-order", "tp-pp-dp"], "--rank-order"),
                                       (["--tp", "2", "--dp", "3"], "--dp"),
                                       (["--dp", "0"], "--dp")])
def test_simulate_job_bad_input(args, flag):
    r = CliRunner().invoke(app, ["simulate", "--algo", "ring", "--gpus", "2", "--topo", "h100x16", "--seq-len", "16K",
                                 "--heads", "8", "--kv-heads", "8", *args])
    assert r.exit_code == 2 and flag in r.stderr and r.stderr.count("\n") == 1, r.stderr


def test_written_group_schedule_is_on_its_job_gpus(tmp_path):
    """``--out`` writes group 0 on its own GPUs of the job's topology: simulating the file gives ``alone_s``."""
    out = tmp_path / "g.json"
    args = ["--algo", "ring", "--gpus", "2", "--tp", "8", "--topo", "h100x16", "--seq-len", "32K", "--heads", "8",
            "--kv-heads", "8", "--pass", "fwd"]
    r = CliRunner().invoke(app, ["simulate", *args, "--out", str(out), "--json"])
    assert r.exit_code == 0, r.stderr
    job = json.loads(r.stdout)["job"]
    doc = json.loads(out.read_text())
    assert doc["device_of_rank"] == [0, 8] and doc["topology"]["devices"] == 16
    again = CliRunner().invoke(app, ["simulate", str(out), "--json"])
    assert again.exit_code == 0, again.stderr
    assert json.loads(again.stdout)["predicted"]["makespan_s"] == pytest.approx(job["alone_s"], rel=1e-9)
    refused = CliRunner().invoke(app, ["simulate", str(out), "--tp", "2"])
    assert refused.exit_code == 2 and "--tp" in refused.stderr


def test_search_ranks_plans_by_the_whole_job(tmp_path):
    """search --tp: the best plans are re-ranked by all CP groups at once; #1's file is group 0 on its GPUs."""
    res = CliRunner().invoke(app, ["search", "--gpus", "2", "--tp", "8", "--topo", "h100x16", "--seq-len", "64K",
                                   "--model", "llama3-70b", "--pass", "fwd", "--top", "5", "--write", "1",
                                   "--out", str(tmp_path), "--json"])
    assert res.exit_code == 0, res.output
    body = json.loads(res.stdout)
    job, cands = body["job"], body["candidates"]
    k = job["ranked_as_job"]                       # the best 5, and each method's best
    assert (job["tp"], job["cp"], job["groups"]) == (8, 2, 8) and k >= 5
    assert len({c["algorithm"] for c in cands[:k]}) == len({c["algorithm"] for c in cands})
    together = [c["job"]["together_s"] for c in cands[:k]]
    assert together == sorted(together) and all("job" not in c for c in cands[k:])
    assert all(c["job"]["together_s"] >= c["job"]["alone_s"] * (1 - 1e-9) for c in cands[:k])  # sharing only slows
    sim = CliRunner().invoke(app, ["simulate", cands[0]["schedule_path"], "--topo", "h100x16", "--json"])
    assert json.loads(sim.stdout)["predicted"]["makespan_s"] == pytest.approx(cands[0]["job"]["alone_s"])


def test_search_job_refuses_what_it_does_not_combine():
    res = CliRunner().invoke(app, ["search", "--gpus", "2", "--tp", "8", "--topo", "h100x16", "--seq-len", "64K",
                                   "--scheduler", "ilp", "--write", "0"])
    assert res.exit_code == 2 and res.output.strip().startswith("error: --scheduler"), res.output
