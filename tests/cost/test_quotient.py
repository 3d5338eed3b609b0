"""Quotient builds (meshplan.plan.quotient): the representatives' programs alone simulate to the full schedule's
prediction, key for key; a build whose ranks are not alike falls back (None)."""

from __future__ import annotations

import numpy as np
import pytest

from meshplan.algorithms import get
from meshplan.cost.metrics import predicted
from meshplan.cost.simulate import simulate
from meshplan.model.topology import Topology
from meshplan.model.workload import resolve


def _plan(n, ud, order, **workload):
    topo = Topology.load("h100x32", n)                   # 8 GPUs a node
    w = resolve(model="llama3-8b", seq_len=64 * n * 8, **workload)
    alg = get("usp")
    return topo, alg, alg.plan(w, topo, n, alg.normalize({"ulysses_degree": ud, "rank_order": order}))


def _flat(pred: dict) -> dict:
    """Every number of a ``predicted`` object (per pass and flat)."""
    return {(part, k): v for part, keys in {"": pred, **pred}.items() if isinstance(keys, dict)
            for k, v in keys.items() if v is not None and not isinstance(v, dict)}


@pytest.mark.parametrize("ud,order,workload,reps", [
    (8, "ring-first", {}, 8),                                       # rings inside a node: the node shift
    (4, "ring-first", {}, 8),                                       # rings over 2 nodes: turned (c x 2c for 2c x c)
    (2, "ring-first", {"passes": "fwd"}, 8),                        # over 4 nodes
    (8, "ring-first", {"mask": "full", "layout": "contiguous"}, 8),
    (8, "ring-first", {"layout": "contiguous"}, 8),                 # causal, unbalanced: rings alike all the same
    (4, "ring-first", {"layout": "contiguous"}, 16),                # a turn changes the work: moved rings only
    (8, "ring-first", {"layout": "striped"}, 8),
    (8, "ulysses-first", {}, 8),                                    # groups in a node, rings across: other shapes
    (4, "ulysses-first", {"mask": "full"}, 8),
    (16, "ulysses-first", {}, 16),                                  # groups over 2 nodes: shifted by a group
])
def test_usp_quotient_predicts_the_full_schedule(ud, order, workload, reps):
    topo, alg, plan = _plan(64, ud, order, **workload)
    quotient = alg.quotient_schedule(plan, topo)
    full = alg.build(plan, topo)
    assert quotient is not None and quotient.quotient.orbit_size == 64 // reps
    assert len(quotient.ops) * quotient.quotient.orbit_size == len(full.ops)
    assert set(np.unique(quotient.ops.rank)) == set(quotient.quotient.reps.tolist())
    sim_q, sim_f = simulate(quotient, topo), simulate(full, topo)
    a, b = _flat(predicted(quotient, topo, sim_q, None).json()), _flat(predicted(full, topo, sim_f, None).json())
    assert a.keys() == b.keys() and len(a) >= 11
    assert a == pytest.approx(b, rel=1e-12)
    assert sim_q.reps == reps


def test_ranks_not_alike_are_built_whole():
    # Ulysses groups first on a contiguous causal layout: a ring's members (one per group) hold different tokens,
    # so neither the shift by a node nor by a group keeps the kernels' times: no quotient
    topo, alg, plan = _plan(64, 4, "ulysses-first", layout="contiguous")
    assert alg.quotient_schedule(plan, topo) is None
    # documents inside a block: not tried
    topo, alg, plan = _plan(64, 8, "ring-first", mask="docs:" + ",".join(["4096"] * 8))
    assert alg.quotient_schedule(plan, topo) is None


def test_a_wrong_symmetry_is_caught(monkeypatch):
    # a permutation of whole nodes that is not a symmetry: the rings of nodes 0, 1, 2 cycled (0 -> 2 -> 1 -> 0), the
    # others kept — an all-to-all's peers follow the shift by one node, not this cycle: the builder's check refuses
    topo, alg, plan = _plan(64, 8, "ring-first")
    g, r = topo.gpus_per_node, np.arange(64)
    node = {0: 2, 2: 1, 1: 0}
    cycle = np.array([node.get(x // g, x // g) * g + x % g for x in r.tolist()])
    assert alg.quotient_schedule(plan, topo) is not None
    monkeypatch.setattr(type(alg), "symmetries", lambda self, plan, topo: [[(r + g) % 64, cycle]])
    assert alg.quotient_schedule(plan, topo) is None


def test_a_method_without_quotient_builds_says_so():
    topo = Topology.load("h100x32", 64)
    alg = get("mesh")
    w = resolve(model="llama3-8b", seq_len=64 * 64 * 8)
    assert alg.quotient_schedule(alg.plan(w, topo, 64, alg.normalize({})), topo) is None
