"""The uncontended evaluation: a replay of the recorded waves equals a fresh evaluation, whatever the durations."""

from __future__ import annotations

import numpy as np
import pytest

from meshplan.cost.bounds import transfer_seconds
from meshplan.cost.cost import CostModel
from meshplan.model.topology import Topology
from meshplan.model.workload import resolve
from meshplan.plan.dataflow import build_items, evaluate
from meshplan.search.candidate import make_candidate


@pytest.mark.parametrize("name,knobs", [("ring", {}), ("usp", {"ulysses_degree": 4}), ("mesh", {}),
                                        ("charm", {})])
def test_a_replayed_evaluation_equals_a_fresh_one(name, knobs):
    from meshplan import algorithms

    topo = Topology.load("h100x16", gpus=16)
    c = make_candidate(name, resolve(seq_len="32K", model="llama3-8b"), topo, 16, knobs)
    sched = algorithms.get(name).schedule(c.plan, topo)
    partner = sched.match_transfers()[0]
    dur, tr = CostModel(topo).op_durations(sched), transfer_seconds(sched, topo, partner)
    rng = np.random.default_rng(7)
    for phase in sched.passes:
        items = build_items(sched, phase, partner)
        first = evaluate(items, dur, tr)
        assert items.waves is not None and first.complete
        for _ in range(3):                                   # other durations: what the contended rounds pass
            d, t = dur * rng.uniform(0.5, 2.0, len(dur)), tr * rng.uniform(0.5, 2.0, len(tr))
            again, fresh = evaluate(items, d, t), evaluate(build_items(sched, phase, partner), d, t)
            np.testing.assert_array_equal(again.start, fresh.start)
            np.testing.assert_array_equal(again.end, fresh.end)
            assert again.waves == fresh.waves and again.complete
