"""The cost model's op durations: the per-dtype merge factor of blocks merged into their output."""

from __future__ import annotations

import numpy as np


def test_block_merges_take_the_dtypes_merge_factor():
    """A compute op that merges its block into O (combine: merge) takes merge_dtype[dtype] x 3 x its output bytes /
    the merge rate for its merge; accumulating ops (the backward's fp32 gradients) keep 1x."""
    from meshplan.cost.cost import CostModel
    from meshplan.model.topology import Topology
    from meshplan.model.workload import resolve
    from meshplan.plan.schedule import COMBINES, COMPUTE
    from meshplan.search.candidate import predict

    topo = Topology.load("cpu-local", 2)
    w = resolve(seq_len=2048, heads=4, kv_heads=4, head_dim=64, dtype="bf16", mask="causal", passes="fwd+bwd")
    sched = predict("ring", w, topo, 2, {}).schedule
    plain, model = CostModel(topo), CostModel(topo)
    for cost, factor in ((plain, 1.0), (model, 3.0)):      # the shipped calibration's own factor set aside
        cost.kernel = type("K", (), {"__getattr__": lambda s, n: getattr(topo.kernel, n),
                                     "merge_factor": lambda s, dt, f=factor: f if dt == "bf16" else 1.0})()
    o, t = sched.ops, sched.tensors
    out_bytes = np.array([t.size_bytes[o.outputs[o.out_ptr[i]:o.out_ptr[i + 1]]].sum() for i in range(len(o))])
    merging = (o.kind == COMPUTE) & (o.combine == COMBINES.index("merge"))
    extra = model.op_durations(sched) - plain.op_durations(sched)
    assert merging.any() and ((o.kind == COMPUTE) & (o.combine == COMBINES.index("accumulate"))).any()
    np.testing.assert_allclose(extra[merging], 2 * 3 * out_bytes[merging] / plain.merge_rate, rtol=1e-12)
    np.testing.assert_array_equal(extra[~merging], 0.0)
