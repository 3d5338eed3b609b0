"""Per-rank kernel sums by block class (meshplan/cost/block_classes.py) against the N x N block times they replace:
every mask kind and layout, owners of Ring, Mesh and CHARM+ plans, both passes, kernel growths, with and without the
envelope."""

from __future__ import annotations

import numpy as np
import pytest

from meshplan.model.topology import Topology
from meshplan.model.workload import resolve

CASES = [("causal", "zigzag"), ("causal", "contiguous"), ("causal", "striped"), ("full", "zigzag"),
         ("window:3000", "zigzag"), ("docs:4992,7008,4384", "contiguous"), ("docs:1984,9024,5376", "zigzag")]


def _plans(mask: str, layout: str):
    from meshplan.search.candidate import plan_candidate

    topo = Topology.load("h100x16", gpus=16)
    w = resolve(seq_len=16384, heads=8, kv_heads=2, head_dim=64, mask=mask, layout=layout)
    out = []
    for name, knobs in (("ring", {}), ("mesh", {"tile": "4x4", "mapping": "row-major"}),
                        ("mesh", {"tile": "2x8", "mapping": "row-major"}), ("charm", {})):
        try:
            out.append(plan_candidate(name, w, topo, 16, knobs)[1])
        except Exception:          # noqa: BLE001 - a method that cannot run this workload: not a case
            continue
    return topo, out


@pytest.mark.parametrize("mask,layout", CASES)
def test_class_sums_equal_the_block_times_summed_per_rank(mask, layout):
    from meshplan.cost.block_classes import mean_block_s, rank_kernel_s
    from meshplan.cost.cost import CostModel

    topo, plans = _plans(mask, layout)
    assert len(plans) >= 3
    cost = CostModel(topo)
    for plan in plans:
        m, owner, n = plan.matrix, plan.owner, plan.n_ranks
        for pass_ in ("fwd", "bwd"):
            for chunks in ((1, 1), (2, 8), (4, 4)):
                blocks = cost.matrix_block_times(m, pass_, chunks, envelope=True) - cost.kernel.launch_s
                sel = m.permitted
                total = np.bincount(owner[sel], weights=blocks[sel], minlength=n)
                cheapest = np.full(n, np.inf)
                np.minimum.at(cheapest, owner[sel], blocks[sel])
                cheapest[~np.isfinite(cheapest)] = 0.0
                got = rank_kernel_s(cost, m, owner, n, pass_, chunks)
                np.testing.assert_allclose(got[0], total, rtol=1e-12)
                np.testing.assert_allclose(got[1], cheapest, rtol=1e-12)
                np.testing.assert_array_equal(got[2], np.bincount(owner[sel], minlength=n))
                plain = cost.matrix_block_times(m, pass_, chunks)
                assert mean_block_s(cost, m, pass_, chunks) == pytest.approx(float(plain[sel].mean()), rel=1e-12)


def test_without_class_sums_the_block_times_are_summed(monkeypatch):
    """More (rank, class) cells than MAX_CELLS: the N x N path, the same numbers; plans sharing an owner array share
    its sums (one count per array)."""
    import meshplan.cost.block_classes as bc
    from meshplan.cost.cost import CostModel

    topo, plans = _plans("docs:1984,9024,5376", "zigzag")
    cost = CostModel(topo)
    plan = plans[1]
    by_class = bc.rank_kernel_s(cost, plan.matrix, plan.owner, 16, "bwd", (4, 4))
    assert bc.class_sums(plan.matrix, plan.owner, 16) is bc.class_sums(plan.matrix, plan.owner, 16)
    monkeypatch.setattr(bc, "MAX_CELLS", 0)
    plan.matrix.__dict__.pop("_class_sums")
    assert bc.class_sums(plan.matrix, plan.owner, 16) is None
    summed = bc.rank_kernel_s(cost, plan.matrix, plan.owner, 16, "bwd", (4, 4))
    for a, b in zip(by_class, summed):
        np.testing.assert_allclose(a, b, rtol=1e-12)


def test_a_permitted_block_without_an_owner_has_no_class_sums():
    """An owner array that leaves a permitted block at −1 (not a plan: refused by Plan.check) gives None, not a sum
    that silently drops the block."""
    from meshplan.cost.block_classes import class_sums

    _, plans = _plans("causal", "zigzag")
    m = plans[0].matrix
    owner = plans[0].owner.copy()
    owner[np.argwhere(m.permitted)[0][0], np.argwhere(m.permitted)[0][1]] = -1
    assert class_sums(m, owner, 16) is None


def test_plans_with_the_same_owners_share_one_read_only_array():
    """Ring's two dK/dV hop settings, Mesh's mappings of one tile: one [N, N] owner array (and so one count of its
    class sums); it cannot be written through a plan."""
    from meshplan.search.candidate import plan_candidate

    topo = Topology.load("h100x16", gpus=16)
    w = resolve(seq_len=16384, heads=8, kv_heads=2, head_dim=64)
    a = plan_candidate("ring", w, topo, 16, {"dkv_hops": "n"})[1]
    b = plan_candidate("ring", w, topo, 16, {"dkv_hops": "n-1"})[1]
    assert a.owner is b.owner and not a.owner.flags.writeable
    np.testing.assert_array_equal(a.owner, np.where(a.matrix.permitted, np.arange(16)[:, None], -1))
    c = plan_candidate("pass-q", w, topo, 16, {})[1]
    np.testing.assert_array_equal(c.owner, np.where(c.matrix.permitted, np.arange(16)[None, :], -1))
    with pytest.raises(ValueError):
        a.owner[0, 0] = 3
