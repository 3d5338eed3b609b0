"""Schedules from Ring and pass-Q against the closed forms of docs/algorithms.md."""

from __future__ import annotations

import pytest
from helpers import build, recv_bytes, sizes

from meshplan.model.matrix import AttnMatrix
from meshplan.plan.schedule import COMPUTE


@pytest.mark.parametrize("n", [2, 4, 8, 16])
@pytest.mark.parametrize("layout", ["contiguous", "zigzag", "striped"])
def test_ring_bytes_per_rank(n, layout):
    s, w = build("ring", n, layout=layout)
    kvc, _, _, dkvc = sizes(w, n)
    assert (recv_bytes(s, 0) == (n - 1) * kvc).all()                 # forward: (N−1)·KVc
    assert (recv_bytes(s, 1) == (n - 1) * kvc + n * dkvc).all()      # backward: (N−1)·KVc + N·dKVc


@pytest.mark.parametrize("n", [2, 8])
def test_ring_dkv_variants(n):
    s, w = build("ring", n, knobs={"dkv_hops": "n-1"})
    kvc, _, _, dkvc = sizes(w, n)
    assert (recv_bytes(s, 1) == (n - 1) * (kvc + dkvc)).all()
    s, w = build("ring", n, knobs={"dkv_dtype": "bf16"})
    assert (recv_bytes(s, 1) == (n - 1) * kvc + n * kvc).all()       # dK/dV in the input dtype: dKVc = KVc


@pytest.mark.parametrize("n", [2, 4, 8])
def test_pass_q_bytes_per_rank(n):
    s, w = build("pass-q", n)
    _, qc, lc, _ = sizes(w, n)
    assert (recv_bytes(s, 0) == (n - 1) * (qc + qc + lc)).all()      # Q in, then partial O (bf16) + LSE home
    dqc = qc * 4 // w.elem_bytes
    assert (recv_bytes(s, 1) == (n - 1) * (2 * qc + 2 * lc) + n * dqc).all()


def test_gqa_bytes_scale_with_kv_heads():
    """BUGCASES C7: bytes on the wire proportional to Hkv, not H."""
    one, _ = build("ring", 4, passes="fwd", heads=4, kv_heads=1, head_dim=64)
    two, _ = build("ring", 4, passes="fwd", heads=4, kv_heads=2, head_dim=64)
    assert (2 * recv_bytes(one, 0) == recv_bytes(two, 0)).all()


@pytest.mark.parametrize("name", ["ring", "pass-q"])
@pytest.mark.parametrize("mask,layout", [("causal", "zigzag"), ("causal", "contiguous"), ("window:50", "striped"),
                                         ("full", "zigzag")])
def test_flops_add_up_to_the_matrix(name, mask, layout):
    s, w = build(name, 8, mask=mask, layout=layout)
    m = AttnMatrix(w, 8)
    o = s.ops
    for phase, pass_ in ((0, "fwd"), (1, "bwd")):
        sel = (o.kind == COMPUTE) & (o.phase == phase)
        assert o.flops[sel].sum() == pytest.approx(m.flops(pass_).sum())


def test_every_comm_stream_has_its_own_communicator():
    s, _ = build("pass-q", 4)
    comms = [c for c, k in zip(s.streams.communicator, s.streams.kinds) if k == "comm"]
    assert len(comms) == len(set(comms)) == 3
