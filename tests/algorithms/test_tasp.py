"""TASP: shipped Hamiltonian decompositions, Ring's bytes spread over N−1 links, refusals, coverage."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import build, recv_bytes, sizes

from meshplan.algorithms import get
from meshplan.algorithms.tasp_cycles import check_decomposition, check_paths, node_aware, shipped, shipped_paths
from meshplan.core.errors import SkipCandidate
from meshplan.model.topology import Topology
from meshplan.model.workload import resolve
from meshplan.plan.schedule import SEND
from meshplan.plan.verify import verify


@pytest.mark.parametrize("n", [8, 12, 16, 20])
def test_shipped_decompositions_are_hamiltonian_and_cover_every_arc_once(n):
    assert check_decomposition(shipped()[n])


def test_the_checker_rejects_a_non_decomposition():
    bad = shipped()[8].copy()
    bad[[0, 1]] = bad[[1, 0]]
    bad[0] = bad[1]                                          # two equal cycles: arcs used twice
    assert not check_decomposition(bad)


@pytest.mark.parametrize("n", [8, 16])
@pytest.mark.parametrize("mask,layout", [("causal", "zigzag"), ("causal", "contiguous"), ("full", "contiguous")])
def test_ring_bytes_over_n_minus_1_links_and_every_block_once(n, mask, layout):
    """Flat routing: N − 1 rings, so at each step every ordered pair of ranks carries one piece."""
    s, w = build("tasp", n, passes="fwd", topo="h100x16", seq_len=2 * n * (n - 1) * 4, mask=mask, layout=layout,
                 knobs={"routing": "flat"})
    assert verify(s).ok
    kvc = sizes(w, n)[0]
    assert np.all(recv_bytes(s, 0) == (n - 1) * kvc)
    o = s.ops
    sends = (o.kind == SEND) & (o.step == 0)
    assert len(set(zip(o.rank[sends].tolist(), o.peer[sends].tolist()))) == n * (n - 1)   # every link at once


@pytest.mark.parametrize("n,passes,seq,needle", [(4, "fwd", 1200, "Tillson"), (6, "fwd", 1200, "Tillson"),
                                                 (10, "fwd", 1800, "not 10"), (8, "fwd", 1000, "multiple of 112"),
                                                 (8, "fwd+bwd", 1120, "no backward")])
def test_refusals_name_the_reason(n, passes, seq, needle):
    alg = get("tasp")
    w = resolve(seq_len=seq, passes=passes)
    with pytest.raises(SkipCandidate, match=needle):
        alg.check(w, Topology.load("h100x16", gpus=16), n, alg.normalize({}))


def test_tasp_contends_on_pcie_and_matches_ring_on_nvswitch():
    """docs/algorithms.md: its N−1 concurrent rings contend on PCIe (slower than Ring there); on NVSwitch every
    GPU port carries the same bytes either way (the model has no per-flow limit below the port's)."""
    from meshplan.search.candidate import predict

    def t(algo, topo):
        w = resolve(seq_len=896, batch=64, heads=8, kv_heads=8, head_dim=128, passes="fwd", mask="full")
        return predict(algo, w, Topology.load(topo, gpus=8), 8, {}).predicted.json()
    assert t("tasp", "l20x8")["makespan_s"] > 1.2 * t("ring", "l20x8")["makespan_s"]
    nv_t, nv_r = t("tasp", "h100x8"), t("ring", "h100x8")
    assert nv_t["comm_busy_s"] == pytest.approx(nv_r["comm_busy_s"], rel=0.05)


@pytest.mark.parametrize("g", [2, 4, 8])
def test_shipped_paths_cover_every_arc_of_a_node_once(g):
    assert check_paths(shipped_paths()[g])


@pytest.mark.parametrize("m,g", [(2, 8), (4, 8), (3, 4), (2, 2)])
def test_node_aware_cycles_cross_each_nic_once_per_step(m, g):
    """g cycles over M·g ranks: each Hamiltonian; together they use every ordered pair inside a node exactly once
    (per node) and give each rank exactly one successor and one predecessor in another node."""
    rank_at = np.arange(m * g).reshape(m, g)
    succ = node_aware(rank_at)
    n = m * g
    for row in succ:
        seen, x = set(), 0
        for _ in range(n):
            seen.add(x)
            x = int(row[x])
        assert len(seen) == n and x == 0
    node = np.arange(n) // g
    cross = node[succ] != node[np.arange(n)][None, :]
    assert (cross.sum(axis=0) == 1).all()                       # one cross-node arc out of every rank
    into = np.zeros(n, dtype=int)
    np.add.at(into, succ[cross], 1)
    assert (into == 1).all()                                    # and one into every rank
    inside = np.zeros((n, n), dtype=int)
    np.add.at(inside, (np.broadcast_to(np.arange(n), succ.shape)[~cross], succ[~cross]), 1)
    same = (node[:, None] == node[None, :]) & ~np.eye(n, dtype=bool)
    assert (inside[same] == 1).all() and (inside[~same] == 0).all()


@pytest.mark.parametrize("mask,layout", [("causal", "zigzag"), ("full", "contiguous")])
def test_node_aware_on_two_nodes_sends_one_piece_across_per_rank_and_step(mask, layout):
    """Two h100x16 nodes, routing auto: 8 rings (one per GPU of a node), KV cut in 8; Ring's bytes per rank, every
    block once, and at each step every rank sends 8 pieces, exactly one of them to the other node."""
    n = 16
    s, w = build("tasp", n, passes="fwd", topo="h100x16", seq_len=2 * n * 8 * 4, mask=mask, layout=layout)
    assert verify(s).ok
    assert np.all(recv_bytes(s, 0) == (n - 1) * sizes(w, n)[0])
    o = s.ops
    for step in range(n - 1):
        sends = (o.kind == SEND) & (o.step == step)
        assert np.bincount(o.rank[sends], minlength=n).tolist() == [8] * n
        across = sends & (o.rank // 8 != o.peer // 8)
        assert np.bincount(o.rank[across], minlength=n).tolist() == [1] * n


def test_routing_refusals_say_what_to_use():
    alg = get("tasp")
    w = resolve(seq_len=8 * 7 * 2 * 4, passes="fwd")
    with pytest.raises(SkipCandidate, match="routing=flat"):
        alg.check(w, Topology.load("h100x8", gpus=8), 8, alg.normalize({"routing": "node-aware"}))
    with pytest.raises(SkipCandidate, match=r"hold \[2, 8\]"):              # 10 ranks: 8 on one node, 2 on the next
        alg.check(resolve(seq_len=10 * 9 * 2 * 4, passes="fwd"), Topology.load("h100x16", gpus=16), 10,
                  alg.normalize({"routing": "node-aware"}))
