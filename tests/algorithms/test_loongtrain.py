"""LoongTrain's double ring: bytes against the closed form, inner rings inside nodes, coverage, refusals."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import build, recv_bytes, sizes

from meshplan.algorithms import get
from meshplan.core.errors import UserError
from meshplan.model.topology import Topology
from meshplan.model.workload import resolve
from meshplan.plan.schedule import SEND
from meshplan.plan.verify import verify


@pytest.mark.parametrize("n,w", [(8, 1), (8, 2), (8, 4), (8, 8), (16, 8), (16, 4)])
def test_pure_double_ring_bytes(n, w):
    """u = 1: forward (N−1)·KVc like Ring; backward adds n_win·w inner hops of the dK/dV sums (none when w = 1)
    and n_win − 1 outer ones (fp32)."""
    s, wl = build("loongtrain", n, topo="h100x16", knobs={"inner_ring": str(w)})
    kvc, _, _, dkvc = sizes(wl, n)
    n_win = n // w
    assert np.all(recv_bytes(s, 0) == (n - 1) * kvc)
    assert np.all(recv_bytes(s, 1) == (n - 1) * kvc + (n_win * w * (w > 1) + n_win - 1) * dkvc)


def test_inner_rings_stay_inside_nodes_and_one_outer_hop_per_window_step():
    topo = Topology.load("h100x16", gpus=16)
    alg = get("loongtrain")
    plan = alg.plan(resolve(seq_len=4096, passes="fwd"), topo, 16, alg.normalize({}))
    assert plan.knobs["inner_ring"] == 8                     # auto: a node's GPUs
    s = alg.schedule(plan, topo)
    o = s.ops
    inner = (o.kind == SEND) & (o.stream == s.streams.names.index("kv"))
    outer = (o.kind == SEND) & (o.stream == s.streams.names.index("outer"))
    assert topo.same_node(o.rank[inner], o.peer[inner]).all()
    assert not topo.same_node(o.rank[outer], o.peer[outer]).any()
    assert np.bincount(o.rank[outer], minlength=16).tolist() == [1] * 16     # n_win − 1 = 1 outer step


@pytest.mark.parametrize("knobs,n", [({"inner_ring": "1"}, 2), ({"inner_ring": "2"}, 4),
                                     ({"inner_ring": "2", "ulysses_degree": "2"}, 8), ({"inner_ring": "4"}, 8),
                                     ({"inner_ring": "1", "ulysses_degree": "4"}, 16), ({}, 16)])
@pytest.mark.parametrize("mask,layout", [("causal", "zigzag"), ("causal", "contiguous"), ("full", "striped")])
def test_every_permitted_block_once_per_head(knobs, n, mask, layout):
    s, _ = build("loongtrain", n, topo="h100x16", heads=16, kv_heads=4, mask=mask, layout=layout, knobs=knobs)
    rep = verify(s)
    assert rep.ok, rep.violations[:3]


def test_an_inner_ring_that_does_not_divide_is_refused():
    alg = get("loongtrain")
    with pytest.raises(UserError, match="--inner-ring") as err:
        alg.check(resolve(seq_len=4096), Topology.load("h100x8", gpus=8), 8, alg.normalize({"inner_ring": "3"}))
    assert "divisor of 8" in str(err.value)
