"""search --sensitivity: P = 0 is the nominal ranking, samples are seeded, close calls are unstable, --pick robust."""

from __future__ import annotations

import json

import numpy as np
import pytest
from helpers import one_line_error, run

from meshplan.cost.simulate import simulate
from meshplan.model.topology import LINK_CLASSES, Topology
from meshplan.model.workload import resolve
from meshplan.search import run_search
from meshplan.search.ranking import ranked
from meshplan.search.sensitivity import Factors, draw_factors, perturbed_topology, run_sensitivity, sample_times

SMALL = ["search", "--gpus", "4", "--topo", "h100x8", "--seq-len", "16K", "--write", "0"]


def uniform(bw=1.0, lat=1.0, overhead=1.0, fwd=1.0, bwd=1.0) -> Factors:
    n = len(LINK_CLASSES)
    return Factors(np.full(n, bw), np.full(n, lat), overhead, {"fwd": fwd, "bwd": bwd})


@pytest.fixture(scope="module")
def close_call():
    """l20x8, 8 GPUs, 32K: the best few plans are within 1% of each other with different communication."""
    topo = Topology.load("l20x8", gpus=8)
    return run_search(resolve(seq_len="32K"), topo, 8, algos=["usp", "ulysses"])


def test_zero_perturbation_is_the_nominal_ranking_with_full_stability():
    res = run(*SMALL, "--sensitivity", 0, "--sensitivity-samples", 3, "--json")
    assert res.exit_code == 0, res.stderr
    body = json.loads(res.stdout)
    s = body["sensitivity"]
    assert (s["percent"], s["samples"], s["seed"], s["pick"], s["picked"]) == (0, 3, 0, "nominal", 0)
    assert s["perturbed"] == ["bandwidth", "latency", "efficiency"]
    top = body["candidates"][:len(s["candidates"])]
    assert len(s["candidates"]) == min(5, len(body["candidates"]))
    best = top[0]["predicted"]["makespan_s"]
    for k, (c, b) in enumerate(zip(s["candidates"], top)):
        assert (c["rank"], c["algorithm"], c["layout"], c["knobs"]) == (k + 1, b["algorithm"], b["layout"], b["knobs"])
        assert b["model_level"] == "simulated"                # the top K left at their bound are simulated
        assert c["nominal_s"] == b["predicted"]["makespan_s"] == c["p95_s"]   # every sample is the nominal model
        tie = c["nominal_s"] == best
        assert c["best_fraction"] == (1.0 if tie else 0.0)
        assert c["regret_mean_pct"] == c["regret_worst_pct"] == pytest.approx(100 * (c["nominal_s"] / best - 1),
                                                                              rel=1e-12, abs=1e-12)
    assert s["candidates"][0]["regret_worst_pct"] == 0.0
    human = run(*SMALL, "--sensitivity", 0, "--sensitivity-samples", 2)
    assert human.exit_code == 0 and "sensitivity: ±0%" in human.stdout and "best in" in human.stdout


def test_samples_are_deterministic_for_a_seed():
    a, b, c = draw_factors(10, 4, seed=3), draw_factors(10, 4, seed=3), draw_factors(10, 4, seed=4)
    for x, y in zip(a, b):
        assert np.array_equal(x.bw, y.bw) and np.array_equal(x.lat, y.lat) and x.eff == y.eff
        assert x.overhead == y.overhead
    assert not np.array_equal(a[0].bw, c[0].bw)
    every = np.concatenate([np.r_[f.bw, f.lat, f.overhead, f.eff["fwd"], f.eff["bwd"]] for f in a])
    assert ((every >= 0.9) & (every <= 1.1)).all() and not (every == 1.0).all()
    assert all((np.r_[f.bw, f.lat, f.overhead, list(f.eff.values())] == 1.0).all() for f in draw_factors(0, 3))


def test_perturbed_copy_scales_the_model_and_leaves_the_topology_alone(close_call):
    topo = close_call.topology
    cap, lat = topo.link_capacity.copy(), topo.pair_stats(0, 7)
    half = perturbed_topology(topo, uniform(bw=0.5, lat=2.0, overhead=2.0))
    assert np.array_equal(topo.link_capacity, cap) and np.array_equal(topo.pair_stats(0, 7), lat)
    assert half.pair_stats(0, 7)[1] == pytest.approx(lat[1] / 2, rel=1e-12)
    assert half.pair_stats(0, 7)[0] == pytest.approx(lat[0] * 2, rel=1e-12)
    assert half.content_hash != topo.content_hash
    c = close_call.candidates[0]
    nominal = c.predicted.makespan_s
    same, slow_links, slow_kernels = sample_times(
        [c], topo, [uniform(), uniform(bw=0.5), uniform(fwd=0.5, bwd=0.5)])[0]
    assert same == nominal                                   # factors of 1: bit-identical to the nominal run
    assert nominal < slow_links < 2 * nominal                 # half the bandwidth: slower, not twice (overlap)
    assert nominal < slow_kernels <= 2 * nominal * (1 + 1e-9)
    if c.schedule is not None:                                # the shared topology still gives the nominal time
        assert sum(simulate(c.schedule, topo).pass_makespan.values()) == nominal


def test_a_hair_win_is_not_stable_and_robust_pick_reorders(close_call):
    result = close_call
    first, second = (c.predicted.makespan_s for c in result.candidates[:2])
    assert second / first - 1 < 0.01, "the premise: the two best plans within 1%"
    pick = result.candidates[0]
    nominal = run_sensitivity(result, 20, samples=10, top=4)
    order = [id(c) for c in result.candidates]                # re-ranked where the top's bounds were simulated
    again = run_sensitivity(result, 20, samples=10, top=4)
    assert nominal["candidates"] == again["candidates"]       # fixed seed: the same report
    assert [id(c) for c in result.candidates] == order        # --pick nominal keeps the ranking
    assert result.candidates[0] is pick and result.candidates == ranked(result.candidates)
    cands = nominal["candidates"]
    assert cands[0]["best_fraction"] < 1.0
    assert sum(c["best_fraction"] for c in cands) >= 1.0
    assert all(c["regret_worst_pct"] >= c["regret_mean_pct"] >= 0 for c in cands)
    robust = run_sensitivity(result, 20, samples=10, top=4, pick="robust")
    k = robust["picked"]
    worst = [c["regret_worst_pct"] for c in robust["candidates"]]
    assert worst[k] == min(worst)
    assert all(robust["candidates"][k]["nominal_s"] <= c["nominal_s"] for c in robust["candidates"]
               if c["regret_worst_pct"] == worst[k])
    assert [id(c) for c in result.candidates] == [order[k]] + [i for i in order if i != order[k]]
    assert result.candidates[0].workload.layout == robust["candidates"][k]["layout"]


@pytest.mark.parametrize("args,needles", [
    (["--sensitivity", 100], ["--sensitivity", "[0, 100)"]),
    (["--sensitivity", -5], ["--sensitivity", "[0, 100)"]),
    (["--sensitivity", "nan"], ["--sensitivity", "[0, 100)"]),
    (["--sensitivity", 10, "--sensitivity-samples", 0], ["--sensitivity-samples", "1 or more"]),
    (["--sensitivity", 10, "--sensitivity-top", 0], ["--sensitivity-top"]),
    (["--pick", "robust"], ["--pick", "--sensitivity P"]),
    (["--sensitivity", 10, "--pick", "best"], ["--pick", "nominal or robust"]),
    (["--sensitivity-samples", 5], ["--sensitivity-samples", "applies with --sensitivity only"]),
    (["--sensitivity-seed", 1], ["--sensitivity-seed", "add --sensitivity P"]),
])
def test_bad_input_is_one_line_exit_2(args, needles):
    one_line_error(run(*SMALL, *args), *needles)


def test_per_class_factors_reach_cross_node_routes():
    topo = Topology.load("h100x16", gpus=16)
    f = uniform()
    net = LINK_CLASSES.index("net")
    f.bw[net], f.lat[net] = 0.5, 3.0
    lat, bw = topo.pair_stats(0, 8)                          # across the nodes: the NIC's rate bounds the flow
    p_lat, p_bw = perturbed_topology(topo, f).pair_stats(0, 8)
    assert p_bw == pytest.approx(bw / 2, rel=1e-12)
    hops = topo.route(0, 8)
    extra = 2.0 * topo.link_latency_s[hops][topo.link_class[hops] == net].sum()
    assert p_lat == pytest.approx(lat + extra, rel=1e-12)
    assert np.array_equal(perturbed_topology(topo, f).pair_stats(0, 1), topo.pair_stats(0, 1))  # NVLink untouched
