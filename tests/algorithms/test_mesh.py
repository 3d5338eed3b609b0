"""Mesh-Attention against the oracles of docs/algorithms.md and issue 3."""

from __future__ import annotations

import math

import numpy as np
import pytest

from meshplan.algorithms import get
from meshplan.algorithms.mesh.grid import Grid, factorisations, parse_tile, volumes
from meshplan.algorithms.mesh.order import TileCosts, brute_force, evaluate, greedy_order, naive_orders, plan_order
from meshplan.core.errors import UserError
from meshplan.model.topology import Topology
from meshplan.model.workload import resolve
from meshplan.plan.schedule import RECV, SEND
from meshplan.plan.verify import verify
from meshplan.search import run_search
from meshplan.search.candidate import make_candidate, simulate_candidate

MESH = get("mesh")


def build(n, tile, topo="cpu-local", **kw):
    w = resolve(**({"seq_len": 2 * n * 16, "heads": 4, "kv_heads": 4, "head_dim": 16} | kw))
    t = Topology.load(topo, gpus=n)
    plan = MESH.plan(w, t, n, MESH.normalize({"tile": tile}))
    return plan, MESH.schedule(plan, t)


@pytest.mark.parametrize("n", [4, 9, 16, 64, 256, 1024])
def test_square_tile_volume_ratio(n):
    a = math.isqrt(n)
    q = 1.0                         # MHA: KVc = 2·Qc; Oc = Qc (equal dtypes), no LSE
    ratio = volumes(Grid(a, a), q, 2 * q, q, 0.0) / ((n - 1) * 2 * q)
    assert ratio == pytest.approx(2 / (math.sqrt(n) + 1))
    if n == 9:
        assert ratio == pytest.approx(0.5)


def test_argmin_of_total_bytes_at_256():
    """Topology-free argmin with bf16 partials (LSE included): 16x16 MHA, 8x32 at 4:1 GQA, 4x64 at 8:1."""
    c, h, d = 4096, 32, 128
    for kv_heads, want in ((32, (16, 16)), (8, (8, 32)), (4, (4, 64))):
        qc, kvc, oc, lc = c * h * d * 2, 2 * c * kv_heads * d * 2, c * h * d * 2, 4 * c * h
        best = min(factorisations(256), key=lambda ab: volumes(Grid(*ab), qc, kvc, oc, lc))
        assert best == want


@pytest.mark.parametrize("n", [4, 6, 8, 9, 12, 16, 64])
def test_kvr_invariants_for_every_factorisation(n):
    for a, b in factorisations(n):
        plan, s = build(n, f"{a}x{b}", mask="full", layout="contiguous")
        o, grid = s.ops, plan.extra["grid"]
        owner = plan.owner
        assert all(owner[g, g] == g for g in range(n))                          # own (Q_g, KV_g) block in tile
        fwd_recv = (o.kind == RECV) & (o.phase == 0)
        q_in = np.bincount(o.rank[fwd_recv & (o.stream == s.streams.names.index("q"))], minlength=n)
        kv_in = np.bincount(o.rank[fwd_recv & (o.stream == s.streams.names.index("kv"))], minlength=n)
        kv_out = np.bincount(o.rank[(o.kind == SEND) & (o.phase == 0) & (o.stream == s.streams.names.index("kv"))],
                             minlength=n)
        back = np.bincount(o.rank[(o.kind == SEND) & (o.phase == 0) & (o.stream == s.streams.names.index("out"))],
                           minlength=n)
        assert (q_in == a - 1).all() and (kv_in == b - 1).all() and (kv_out == b - 1).all() and (back == a - 1).all()
        assert verify(s).ok, (a, b)
        # every fetch step is a permutation: no rank receives twice in one (stream, step)
        for stream in ("q", "kv"):
            sid = s.streams.names.index(stream)
            sel = fwd_recv & (o.stream == sid)
            pairs = o.step[sel].astype(np.int64) * n + o.rank[sel]
            assert len(np.unique(pairs)) == sel.sum()
        assert grid.n == n


@pytest.mark.parametrize("n", [4, 8, 16])
@pytest.mark.parametrize("mask,layout", [("causal", "zigzag"), ("causal", "contiguous"), ("window:20", "striped"),
                                         ("full", "zigzag")])
def test_every_block_once_in_every_tile(n, mask, layout):
    for a, b in factorisations(n):
        _, s = build(n, f"{a}x{b}", mask=mask, layout=layout, heads=4, kv_heads=2)
        report = verify(s)
        assert report.ok, (a, b, report.violations[:2])


def test_a_equals_1_moves_rings_bytes():
    for n in (4, 8):
        _, mesh = build(n, f"1x{n}", passes="fwd")
        ring = get("ring")
        w = resolve(seq_len=2 * n * 16, heads=4, kv_heads=4, head_dim=16, passes="fwd")
        t = Topology.load("cpu-local", gpus=n)
        rs = ring.schedule(ring.plan(w, t, n, ring.normalize({})), t)
        assert np.array_equal(_recv_bytes(mesh, n), _recv_bytes(rs, n))


def _recv_bytes(s, n):
    """Bytes each of the n ranks receives in schedule s."""
    recv = s.ops.kind == RECV
    return np.bincount(s.ops.rank[recv], weights=s.ops.size_bytes[recv], minlength=n)


def test_worked_example_toy():
    c = TileCosts(t_q=1, t_kv=2, t_o=1, t_block=1)
    assert brute_force(4, 4, c).makespan == 17
    assert evaluate(4, 4, naive_orders(4, 4)["kv-first"], c).makespan == 20
    assert evaluate(4, 4, ("q", "q", "kv", "q", "kv", "kv"), c).makespan == 17
    assert evaluate(4, 4, ("q", "q", "kv", "q", "kv", "kv"), c, own_last=False).makespan > 17
    assert plan_order(4, 4, c).makespan == 17


def test_pure_rule_can_lose_and_auto_keeps_the_naive_winner():
    c = TileCosts(t_q=3, t_kv=1, t_o=3, t_block=1)
    assert evaluate(2, 4, ("kv", "kv", "kv", "q"), c).makespan == 13
    assert evaluate(2, 4, greedy_order(2, 4, c), c).makespan > 10
    best = plan_order(2, 4, c)
    assert best.makespan == 10 and best.name == "q-first"


def test_auto_is_never_worse_than_greedy_or_naive():
    rng = np.random.default_rng(0)
    for _ in range(200):
        a, b = int(rng.integers(1, 5)), int(rng.integers(1, 5))
        c = TileCosts(*rng.uniform(0.2, 3, 4))
        auto = plan_order(a, b, c).makespan
        assert auto <= evaluate(a, b, greedy_order(a, b, c), c).makespan + 1e-12
        for order in naive_orders(a, b).values():
            assert auto <= evaluate(a, b, order, c).makespan + 1e-12
        assert brute_force(a, b, c).makespan <= auto + 1e-12


def test_bad_tiles_and_mappings():
    with pytest.raises(UserError, match=r"--tile: 3x3 does not factor N = 8.*1x8, 2x4, 4x2, 8x1"):
        parse_tile("3x3", 8)
    with pytest.raises(UserError, match="--tile"):
        parse_tile("big", 8)
    w = resolve(seq_len="64K")
    t = Topology.load("h100x16")
    with pytest.raises(UserError, match="--mapping: block:3x3 does not tile"):
        MESH.plan(w, t, 16, MESH.normalize({"tile": "4x4", "mapping": "block:3x3"}))


def test_node_block_mapping_keeps_the_heavier_group_inside_nodes():
    """8:1 GQA at N = 256 on 8-GPU nodes: for 8x32, a 1x8 node block keeps every Q row inside a node."""
    w = resolve(seq_len="1M", heads=64, kv_heads=8, passes="fwd")
    t = Topology.load("dgx-h100", gpus=256)
    plan = MESH.plan(w, t, 256, MESH.normalize({"tile": "8x32"}))
    assert plan.knobs["mapping"] == "block:1x8"
    cand = make_candidate("mesh", w, t, 256, {"tile": "8x32", "mapping": "block:1x8"})
    kvc = 2 * 4096 * 8 * 128 * 2
    assert cand.timing["fwd"].inter_node_bytes_max == pytest.approx(31 * kvc)    # (b − p)·KVc, no Q/O across


def test_search_pick_equals_exhaustive_on_dgx_h100():
    topo = Topology.load("dgx-h100", gpus=32)
    w = resolve(seq_len="256K", heads=32, kv_heads=32, passes="fwd")
    result = run_search(w, topo, 32, algos=["mesh"], prune_slack=0.0)
    best = result.candidates[0].predicted.makespan_s
    every = []
    for tile in (f"{a}x{b}" for a, b in factorisations(32)):
        for knobs in MESH.knob_space(w.with_(layout="zigzag"), topo, 32, {"tile": tile}):
            for layout in ("zigzag", "contiguous", "striped"):
                c = make_candidate("mesh", w.with_(layout=layout), topo, 32, knobs)
                every.append(simulate_candidate(c, topo, None).predicted.makespan_s)
    assert best == pytest.approx(min(every), rel=1e-12)


def test_memory_limit_no_plan_meets():
    from typer.testing import CliRunner

    from meshplan.cli.app import app
    r = CliRunner().invoke(app, ["search", "--gpus", "8", "--topo", "h100x8", "--seq-len", "64K",
                                 "--memory-limit", "1MB", "--write", "0"])
    assert r.exit_code == 2 and "--memory-limit" in r.stderr and "smallest" in r.stderr
    assert r.stderr.count("\n") == 1


@pytest.mark.parametrize("topo_name,n,seq", [("h100x16", 16, "64K"), ("l20x8", 8, "32K"), ("cpu-local", 4, 1024),
                                             ("dgx-h100", 32, "128K")])
@pytest.mark.parametrize("layout,mask", [("zigzag", "causal"), ("contiguous", "causal"), ("striped", "full")])
@pytest.mark.parametrize("keep", ["refetch", "keep"])
def test_closed_forms_bound_the_simulation(topo_name, n, seq, layout, mask, keep):
    topo = Topology.load(topo_name, gpus=n)
    w = resolve(seq_len=seq, layout=layout, mask=mask, heads=8, kv_heads=2, head_dim=64)
    for a, b in factorisations(n):
        cand = make_candidate("mesh", w, topo, n, {"tile": f"{a}x{b}", "bwd_inputs": keep})
        exact = MESH.refine(cand.plan, topo)
        simulate_candidate(cand, topo, None)
        for p, cheap in cand.timing.items():
            sim = cand.predicted.passes[p].makespan_s
            assert cheap.bound_s <= exact[p].bound_s * (1 + 1e-9), (a, b, p)
            assert exact[p].makespan_s <= sim * (1 + 1e-9), (a, b, p)


def test_keeping_forward_chunks_trades_bytes_for_memory():
    topo = Topology.load("h100x16")
    w = resolve(seq_len="64K")
    runs = {}
    for keep in ("refetch", "keep"):
        cand = make_candidate("mesh", w, topo, 16, {"tile": "4x4", "bwd_inputs": keep})
        simulate_candidate(cand, topo, None)
        assert verify(cand.schedule).ok
        runs[keep] = cand.predicted.json()
    assert runs["keep"]["bwd"]["comm_bytes_per_gpu_max"] < runs["refetch"]["bwd"]["comm_bytes_per_gpu_max"]
    assert runs["keep"]["fwd"]["peak_memory_bytes"] > runs["refetch"]["fwd"]["peak_memory_bytes"]
    assert runs["keep"]["fwd"]["comm_bytes_per_gpu_max"] == runs["refetch"]["fwd"]["comm_bytes_per_gpu_max"]


@pytest.mark.parametrize("topo_name,gpus,tile,mapping", [("h100x16", 16, "4x4", "row-major"),
                                                          ("h100x16", 16, "2x8", "row-major"),
                                                          ("h100x32", 64, "8x8", "block:2x4"),
                                                          ("h100x32", 64, "1x64", "row-major"),
                                                          ("dgx-h100", 8, "8x1", "row-major")])
def test_geometry_equals_every_transfer_routed_one_family_at_a_time(topo_name, gpus, tile, mapping, monkeypatch):
    """Mesh's link geometry (peers a block at a time; the families out taken from the families in, a row's peers
    being a group) against each family's transfers listed and routed whole: the same unit link loads, per-rank counts
    and sums of the transfers received, and per-step latencies of the families in."""
    import meshplan.algorithms.mesh.timing as timing
    from meshplan.algorithms.mesh.mesh import Mesh
    from meshplan.model.topology import Topology
    from meshplan.model.workload import resolve

    topo = Topology.load(topo_name, gpus=gpus)
    alg = Mesh()
    plan = alg.plan(resolve(seq_len=16 * gpus), topo, gpus, alg.normalize({"tile": tile, "mapping": mapping}))
    monkeypatch.setattr(timing, "GEOMETRY_PAIRS", 3 * gpus)            # several blocks of peers
    timing._GEOMETRY.clear()
    geo = timing.geometry(plan, topo)
    grid, dev, n = plan.extra["grid"], plan.device_of_rank, gpus
    g = np.arange(n)
    for side in ("row", "col"):
        k = np.arange(1, grid.a if side == "row" else grid.b)[:, None]
        peer = (grid.row_peer if side == "row" else grid.col_peer)(g[None, :], k).ravel()
        me = np.broadcast_to(g[None, :], (len(k), n)).ravel()
        for direction, (src, dst) in (("in", (peer, me)), ("out", (me, peer))):
            lat, bw = topo.pair_stats(dev[src], dev[dst])
            f = geo[(side, direction)]
            np.testing.assert_array_equal(f["loads"], topo.link_loads(dev[src], dev[dst], 1.0))
            np.testing.assert_array_equal(f["count"], np.bincount(dst, minlength=n))
            np.testing.assert_array_equal(f["cross"], np.bincount(dst, weights=~topo.same_node(dev[src], dev[dst]),
                                                                  minlength=n))
            np.testing.assert_allclose(f["lat"], np.bincount(dst, weights=lat, minlength=n), rtol=1e-12)
            np.testing.assert_allclose(f["inv_bw"], np.bincount(dst, weights=1 / bw, minlength=n), rtol=1e-12)
            if direction == "in":
                np.testing.assert_array_equal(f["step_lat"], lat.reshape(len(k), n))
                np.testing.assert_array_equal(f["step_inv_bw"], (1 / bw).reshape(len(k), n))
    timing._GEOMETRY.clear()
