"""Ulysses and USP: bytes per rank against the closed forms, valid degrees, all-to-alls inside nodes, coverage."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import build, recv_bytes

from meshplan.algorithms import get
from meshplan.core.errors import SkipCandidate, UserError
from meshplan.model.topology import Topology
from meshplan.model.workload import resolve
from meshplan.plan.schedule import SEND
from meshplan.plan.verify import verify


def closed_form(w, n, u, dkv_bytes=4, hops="n"):
    """docs/algorithms.md / the module docstring, written out: bytes received per rank, (fwd, bwd)."""
    B, D, beta, h = w.batch, w.head_dim, w.elem_bytes, w.n_heads
    c, R, hr = w.seq_len // n, n // u, h // u
    kvr = -(-hr // w.gqa_group)                      # KV heads a head range reads (replicated when u > h_kv)
    q, kv, o = B * c * hr * D * beta, 2 * B * c * kvr * D * beta, B * c * hr * D * beta + 4 * B * c * hr
    dkv = 2 * B * c * kvr * D * dkv_bytes
    fwd = (u - 1) * (q + kv) + (R - 1) * u * kv + (u - 1) * o
    ring_dkv = 0 if R == 1 else (R if hops == "n" else R - 1) * u * dkv
    bwd = (u - 1) * q + (R - 1) * u * kv + ring_dkv + (u - 1) * (q + kv)
    return fwd, bwd


@pytest.mark.parametrize("n,heads,kv_heads", [(2, 32, 8), (4, 32, 8), (8, 32, 8), (16, 32, 8), (8, 8, 2),
                                               (4, 4, 4)])
def test_ulysses_bytes_per_rank(n, heads, kv_heads):
    s, w = build("ulysses", n, heads=heads, kv_heads=kv_heads)
    fwd, bwd = closed_form(w, n, n)
    assert np.all(recv_bytes(s, 0) == fwd) and np.all(recv_bytes(s, 1) == bwd)


def test_ulysses_forward_matches_the_papers_volume_without_replication():
    """(u−1)/u · B·c·(2h + 2h_kv)·D·β (docs/algorithms.md), plus the fp32 LSE that returns with O."""
    n, s_len = 8, 8 * 64
    s, w = build("ulysses", n, passes="fwd", heads=32, kv_heads=8, seq_len=s_len)
    c = s_len // n
    paper = (n - 1) / n * w.batch * c * (2 * 32 + 2 * 8) * w.head_dim * w.elem_bytes
    lse = (n - 1) * 4 * w.batch * c * 32 // n
    assert recv_bytes(s, 0).max() == paper + lse


@pytest.mark.parametrize("n,u,order,hops", [(8, 2, "ulysses-first", "n"), (8, 4, "ring-first", "n-1"),
                                             (16, 8, "ulysses-first", "n"), (16, 2, "ring-first", "n")])
def test_usp_bytes_per_rank(n, u, order, hops):
    s, w = build("usp", n, knobs={"ulysses_degree": str(u), "rank_order": order, "dkv_hops": hops})
    fwd, bwd = closed_form(w, n, u, hops=hops)
    assert np.all(recv_bytes(s, 0) == fwd) and np.all(recv_bytes(s, 1) == bwd)


def test_usp_of_degree_one_moves_rings_bytes():
    ring, w = build("ring", 8)
    usp, _ = build("usp", 8, knobs={"ulysses_degree": "1"})
    assert np.array_equal(recv_bytes(ring, 0), recv_bytes(usp, 0))
    assert np.array_equal(recv_bytes(ring, 1), recv_bytes(usp, 1))


HYBRIDS = [("ulysses", {}, n) for n in (2, 4, 8, 16)] + \
    [("usp", {"ulysses_degree": "2", "rank_order": o, "dkv_hops": h}, n) for n in (4, 8, 16)
     for o, h in (("ulysses-first", "n"), ("ring-first", "n-1"))]


@pytest.mark.parametrize("name,knobs,n", HYBRIDS)
@pytest.mark.parametrize("mask,layout", [("causal", "zigzag"), ("causal", "contiguous"), ("full", "contiguous"),
                                         ("window:100", "striped")])
def test_every_permitted_block_once_per_head(name, knobs, n, mask, layout):
    s, _ = build(name, n, heads=16, kv_heads=4, mask=mask, layout=layout, knobs=knobs)
    rep = verify(s)
    assert rep.ok, rep.violations[:3]


def test_usp_with_u8_keeps_all_to_alls_inside_8_gpu_nodes():
    topo = Topology.load("h100x16", gpus=16)
    w = resolve(seq_len=16 * 256, passes="fwd+bwd")
    alg = get("usp")
    knobs = alg.normalize({"ulysses_degree": "8"})
    s = alg.schedule(alg.plan(w, topo, 16, knobs), topo)
    o = s.ops
    a2a = (o.kind == SEND) & (o.stream == s.streams.names.index("a2a"))
    ring = (o.kind == SEND) & (o.stream == s.streams.names.index("kv"))
    assert a2a.any() and topo.same_node(o.rank[a2a], o.peer[a2a]).all()
    assert not topo.same_node(o.rank[ring], o.peer[ring]).any()      # the ring crosses nodes, u = node size


def test_usp_auto_degree_is_the_node_size():
    topo = Topology.load("h100x16", gpus=16)
    alg = get("usp")
    plan = alg.plan(resolve(seq_len=4096), topo, 16, alg.normalize({}))
    assert plan.knobs["ulysses_degree"] == 8


def test_ulysses_never_exceeds_its_head_limit():
    """12 heads over 16 ranks: skipped with the reason; every head range of a valid run is h/u wide."""
    topo = Topology.load("h100x16", gpus=16)
    w = resolve(seq_len=4096, heads=12, kv_heads=12)
    with pytest.raises(SkipCandidate, match="cannot split 12"):
        get("ulysses").check(w, topo, 16, {"rank_order": "ulysses-first"})
    s, _ = build("ulysses", 8, heads=32, kv_heads=8)
    comp = s.ops.kind == 0
    assert set((s.ops.h1 - s.ops.h0)[comp]) == {4}


@pytest.mark.parametrize("degree,needle", [("5", "does not divide 8 ranks"), ("4", "KV heads"),
                                           ("x", "cannot read")])
def test_bad_ulysses_degree_is_one_line(degree, needle):
    alg = get("usp")
    topo = Topology.load("h100x16", gpus=8)
    w = resolve(seq_len=4096, heads=12, kv_heads=3)
    with pytest.raises(UserError, match=needle) as err:
        alg.check(w, topo, 8, alg.normalize({"ulysses_degree": degree}))
    assert "--ulysses-degree" in str(err.value) and "\n" not in str(err.value)
