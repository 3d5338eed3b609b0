"""StarTrail: bytes against the closed form (P2P about N/C KV chunks), coverage, team-size refusals."""

from __future__ import annotations

import numpy as np
import pytest
from helpers import build, recv_bytes, sizes

from meshplan.algorithms import get
from meshplan.core.errors import SkipCandidate, UserError
from meshplan.model.topology import Topology
from meshplan.model.workload import resolve
from meshplan.plan.verify import verify


@pytest.mark.parametrize("n,C", [(4, 2), (8, 2), (16, 2), (16, 4), (9, 3)])
def test_forward_bytes_per_rank(n, C):
    """Team all-gather (C−1)(Qc+KVc), the initial fetch C·KVc (members t > 0), sub-ring (N/C² − 1)·C·KVc,
    reduce-scatter (C−1)(Oc+Lc) — the module docstring's forms."""
    s, w = build("startrail", n, passes="fwd", topo="cpu-local", knobs={"team_size": str(C)})
    kvc, qc, lc, _ = sizes(w, n)
    t = np.arange(n) % C
    L = n // (C * C)
    want = (C - 1) * (qc + kvc) + np.where(t > 0, C * kvc, 0) + (L - 1) * C * kvc + (C - 1) * (qc + lc)
    assert np.array_equal(recv_bytes(s, 0), want)


def test_p2p_volume_drops_by_about_c():
    ring, w = build("ring", 16, passes="fwd", topo="cpu-local")
    st, _ = build("startrail", 16, passes="fwd", topo="cpu-local", knobs={"team_size": "4"})
    o = st.ops
    ring_bytes = recv_bytes(ring, 0).max()
    p2p = np.isin(o.stream, [st.streams.names.index(x) for x in ("fetch", "kv")]) & (o.kind == 1)
    per_rank = np.bincount(o.rank[p2p], weights=o.size_bytes[p2p], minlength=16)
    assert per_rank.max() <= ring_bytes / 4 * 1.1


@pytest.mark.parametrize("n,C", [(4, 2), (8, 2), (16, 4), (9, 3)])
@pytest.mark.parametrize("mask,layout", [("causal", "zigzag"), ("causal", "contiguous"), ("full", "striped")])
def test_every_permitted_block_once(n, C, mask, layout):
    s, _ = build("startrail", n, topo="cpu-local", mask=mask, layout=layout, knobs={"team_size": str(C)})
    rep = verify(s)
    assert rep.ok, rep.violations[:3]


def test_team_sizes_that_do_not_fit_are_refused():
    alg, w = get("startrail"), resolve(seq_len=4096)
    topo = Topology.load("cpu-local", gpus=8)
    with pytest.raises(UserError, match="--team-size: a team size of 3 does not divide 8"):
        alg.check(w, topo, 8, alg.normalize({"team_size": "3"}))
    with pytest.raises(SkipCandidate, match="C² | N"):
        alg.check(w, topo, 8, alg.normalize({"team_size": "4"}))
    assert [k["team_size"] for k in alg.knob_space(w, topo, 16, {})] == [2, 4]
