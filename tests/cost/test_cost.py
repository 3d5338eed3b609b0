"""The cost model's op durations: the per-dtype merge factor of blocks merged into their output, the executor's
staging of each op's inputs."""

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


def _staging_extra(kv_heads: int):
    """(op durations with the executor's staging priced minus without, the schedule, the merge rate)."""
    from meshplan.cost.cost import CostModel
    from meshplan.model.kernel_tables import KernelTable
    from meshplan.model.topology import Topology
    from meshplan.model.workload import resolve
    from meshplan.search.candidate import predict

    topo = Topology.load("cpu-local", 2)
    assert topo.kernel.spec.stage_inputs                     # calibrated on the executor: it stages
    w = resolve(seq_len=2048, heads=4, kv_heads=kv_heads, head_dim=64, dtype="fp32", mask="causal",
                passes="fwd+bwd")
    sched = predict("ring", w, topo, 2, {}).schedule
    staged, plain = CostModel(topo), CostModel(topo)
    plain.kernel = KernelTable(topo.kernel.spec.model_copy(update={"stage_inputs": False}))
    return staged.op_durations(sched) - plain.op_durations(sched), sched, staged.merge_rate


def test_the_executors_staging_is_priced_by_the_bytes_it_copies():
    """Each compute op first copies its inputs into kernel layout ([B, T, h, D] -> contiguous [B, h, T, D]): Ring's
    forward op reads Q of its query tokens and K, V of its keys (4 heads x 64 x 4 B per token each), backward ops
    also O and dO; each byte read once and written once, at the merge rate. MHA: no head expansion."""
    from meshplan.plan.schedule import COMPUTE

    extra, sched, rate = _staging_extra(kv_heads=4)
    o = sched.ops
    token = 4 * 64 * 4
    comp = (o.kind == COMPUTE) & (o.flops > 0)
    q_parts = np.where(o.phase == 0, 1, 3)                   # Ring's backward carries O: Q, O, dO
    want = 2 * token * (q_parts * o.s_q + 2 * o.s_kv) / rate
    assert comp.any() and (o.phase[comp] == 1).any()
    np.testing.assert_allclose(extra[comp], want[comp], rtol=1e-12)
    np.testing.assert_array_equal(extra[~comp], 0.0)


def test_staging_with_gqa_expands_the_kv_heads():
    """GQA (4 query heads on 1 KV head): K and V are copied at their one head, then expanded to the op's 4 (read
    1 head, write 4): per K or V token 2·1 + (1 + 4) heads' worth of bytes."""
    from meshplan.plan.schedule import COMPUTE

    extra, sched, rate = _staging_extra(kv_heads=1)
    o = sched.ops
    head = 64 * 4
    comp = (o.kind == COMPUTE) & (o.flops > 0)
    q_parts = np.where(o.phase == 0, 1, 3)
    want = head * (2 * 4 * q_parts * o.s_q + 2 * (2 * 1 + 1 + 4) * o.s_kv) / rate
    np.testing.assert_allclose(extra[comp], want[comp], rtol=1e-12)


def test_published_gpu_tables_do_not_stage():
    """The shipped GPU tables price frameworks whose kernels read their inputs in place (no staging)."""
    from meshplan.model.topology import Topology

    for name in ("h100x16", "h100x32", "dgx-h100", "l20x8", "a100x8"):
        assert not Topology.load(name).kernel.spec.stage_inputs, name


def test_striped_ops_run_block_by_block_as_the_block_mask_says():
    """The striped shortcut of the pricing (residues up to a common shift, hashed a shape at a time) flags exactly
    the multi-chunk compute ops that the block mask's own test runs block by block, op by op (a 64-rank Mesh)."""
    from meshplan.algorithms import get
    from meshplan.cost.cost import _runs_by_block
    from meshplan.model.blockmask import PERIODS, runs_by_block
    from meshplan.model.matrix import attn_matrix
    from meshplan.model.topology import Topology
    from meshplan.model.workload import resolve

    topo, n = Topology.load("h100x32", gpus=64), 64
    w = resolve(layout="striped", seq_len=str(64 * 4 * PERIODS))
    mesh = get("mesh")
    plan = mesh.variants(mesh.plan(w, topo, n, mesh.normalize({"tile": "8x8", "mapping": "row-major"})), topo)[0]
    s = mesh.schedule(plan, topo)
    o, ch = s.ops, attn_matrix(w, n).chunks
    assert ch.count.shape[1] == 1 and (ch.stride == n).all() and (ch.count >= PERIODS).all()   # the shortcut's case
    ops = np.flatnonzero(o.kind == 0)
    got = _runs_by_block(s, attn_matrix(w, n), ops)
    seg = lambda chunks, q: [(int(ch.start[i, 0]), int(ch.stride[i, 0]), int(ch.count[i, 0])) for i in chunks]  # noqa: E731
    want = [runs_by_block(w.mask, seg(o.q_chunks[o.qc_ptr[k]:o.qc_ptr[k + 1]], True),
                          seg(o.kv_chunks[o.kvc_ptr[k]:o.kvc_ptr[k + 1]], False)) for k in ops.tolist()]
    assert got.tolist() == want and 0 < got.sum() < len(ops)
