"""The simulator: max-min sharing, hand-computed makespans, symmetry reduction, lower bounds."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import unit_topology, unit_workload

from meshplan.algorithms import get
from meshplan.cost.maxmin import max_min_fair
from meshplan.cost.simulate import simulate
from meshplan.model.topology import Topology
from meshplan.model.workload import resolve
from meshplan.search.candidate import predict


def test_two_flows_on_one_link_get_half_each():
    assert max_min_fair([[0], [0]], [10.0]) == pytest.approx([5.0, 5.0])


def test_flow_limited_elsewhere_leaves_the_rest():
    # flow 1 is held to 3 by link 1, so flow 0 gets the other 7 of link 0
    assert max_min_fair([[0], [0, 1]], [10.0, 3.0]) == pytest.approx([7.0, 3.0])
    assert max_min_fair([[0], [0]], [10.0], flow_cap=[2.0, np.inf]) == pytest.approx([2.0, 8.0])


def test_textbook_three_links():
    # Bertsekas & Gallager's example: links of capacity 1; flow 0 crosses both, flows 1 and 2 one each
    assert max_min_fair([[0, 1], [0], [1], [1]], [1.0, 1.0]) == pytest.approx([1 / 3, 2 / 3, 1 / 3, 1 / 3])


def _makespans(name, n, topo, passes="fwd", **knobs):
    w = unit_workload(n, passes)
    alg = get(name)
    sched = alg.schedule(alg.plan(w, topo, n, alg.normalize(knobs)), topo)
    return simulate(sched, topo).pass_makespan


# d = 1 s per block; a KV chunk is 16 B, so T = 16 / port_Bps.
@pytest.mark.parametrize("n,port,expect", [
    (2, 8.0, 3.0),     # d + max(d, T) with T = 2
    (4, 32.0, 4.0),    # compute-bound: N·d (T = 0.5)
    (4, 8.0, 7.0),     # comm-bound: (N−1)·T + d (T = 2)
])
def test_ring_forward_hand_computed(n, port, expect):
    assert _makespans("ring", n, unit_topology(n, port_Bps=port))[0] == pytest.approx(expect, rel=1e-9)


def test_overlap_costs_kappa():
    # T = 1.5, kappa = 0.5: block 0 runs at half speed while the transfer lasts (0.75 done by 1.5 s),
    # finishes at 1.75; block 1 follows: 2.75 s (2.5 s with kappa = 0)
    topo = unit_topology(2, port_Bps=16 / 1.5, kappa=0.5)
    assert _makespans("ring", 2, topo)[0] == pytest.approx(2.75, rel=1e-9)
    assert _makespans("ring", 2, unit_topology(2, port_Bps=16 / 1.5))[0] == pytest.approx(2.5, rel=1e-9)


def test_transfer_kappa_slows_flows_while_an_end_computes():
    # T = 3 alone, d = 1, kappa_t = 0.5: during block 0 (1 s) the transfer moves at half rate (0.5 s of work),
    # then at full rate: it ends at 1 + 2.5 = 3.5; block 1 follows: 4.5 s (4 s with kappa_t = 0)
    slow = unit_topology(2, port_Bps=16 / 3, transfer_kappa=0.5)
    assert _makespans("ring", 2, slow)[0] == pytest.approx(4.5, rel=1e-9)
    assert _makespans("ring", 2, unit_topology(2, port_Bps=16 / 3))[0] == pytest.approx(4.0, rel=1e-9)
    # compute-bound (T = 0.5 alone): the transfer runs beside block 0 at half rate, 1 s, so block 1 starts at 1
    assert _makespans("ring", 2, unit_topology(2, port_Bps=32, transfer_kappa=0.5))[0] == pytest.approx(2.0)
    # the same with both kappas: block 0 at 1 − 0.5 while the transfer (half rate) lasts
    both = unit_topology(2, port_Bps=32, transfer_kappa=0.5, kappa=0.5)
    # transfer: 0.5 s of work at half rate = 1 s; block 0: 0.5 done by 1 s, ends at 1.5; block 1: 2.5 s
    assert _makespans("ring", 2, both)[0] == pytest.approx(2.5, rel=1e-9)


def test_shared_loopback_and_shared_cores():
    # both KV transfers share the 16 B/s loopback: 8 B/s each, T = 2 -> d + T = 3
    topo = unit_topology(2, kind="loopback", port_Bps=16.0, shared_Bps=16.0, cores=2)
    assert _makespans("ring", 2, topo)[0] == pytest.approx(3.0, rel=1e-9)
    # two ranks on one core: every block takes 2 s; comm is ~free -> 4 s
    topo = unit_topology(2, kind="loopback", port_Bps=1e9, shared_Bps=1e9, cores=1)
    assert _makespans("ring", 2, topo)[0] == pytest.approx(4.0, rel=1e-6)


def test_transfers_take_cpu_from_the_shared_pool():
    # two ranks on 2 cores, each block 1 s of one core; each KV transfer is 16 B at up to 16 B/s on its link
    def ring(cpu: float) -> float:
        topo = unit_topology(2, kind="loopback", port_Bps=16.0, shared_Bps=1e9, cores=2,
                             transfer_cpu_s_per_byte=cpu)
        return _makespans("ring", 2, topo)[0]
    assert ring(0.0) == pytest.approx(2.0, rel=1e-9)      # transfers free of CPU: 1 s each beside block 0
    # 1/16 core-s per byte: a flow at 16 B/s would take a core. Two blocks and two flows share 2 cores, 0.5 each:
    # block 0 and the transfers (1 core-s of copying each) end at 2 s, block 1 alone at full speed: 3 s
    assert ring(1 / 16) == pytest.approx(3.0, rel=1e-9)
    # 1/32: a flow is held to 16 B/s = 0.5 core by its link; all four at 0.5 until the transfers end at 1 s
    # (0.5 core-s each); block 0 then has 0.5 s of work left at full speed: 1.5 s; block 1: 2.5 s
    assert ring(1 / 32) == pytest.approx(2.5, rel=1e-9)
    # off a pool (GPUs: every device computes on its own) the cost is not used
    gpu = unit_topology(2, port_Bps=16.0)
    assert _makespans("ring", 2, gpu)[0] == pytest.approx(2.0, rel=1e-9)


@pytest.mark.timeout(30)
def test_fair_rates_with_weights_of_very_different_sizes_terminate():
    # flows solved in core-seconds weigh 1/c (~1.2e9) on their links: sums of such weights leave rounding
    # residues, which once kept a resource "loaded" with no unfrozen user and looped for ever
    from meshplan.cost.maxmin import fair_rates

    c = 5.5e-10
    link, pool = 0, 1
    acts = {a: [0, 0, 0, 0, [(link, 1 / c), (pool, 1.0)], 0.8, None] for a in range(3)}       # three flows
    acts |= {3 + k: [0, 0, 0, 0, [(pool, 1.0)], 1.0, None] for k in range(4)}                  # four kernels
    rates = fair_rates(acts, [1.0e9, 1.926], lambda a, act: act[5])
    # the link holds each flow to 1e9 / 3 B/s = 0.1833 core; the kernels share the rest of the pool
    assert [rates[a] for a in range(3)] == pytest.approx([1e9 / 3 * c] * 3, rel=1e-9)
    assert [rates[a] for a in range(3, 7)] == pytest.approx([(1.926 - 1e9 * c) / 4] * 4, rel=1e-9)


def test_pass_q_all_to_all_contention():
    # Q (8 B) crosses in 1/3 s; blocks end at 1, 2, 3; the final all-to-all sends 2 partials (24 B) per port
    # at 12 B/s each: 2 s -> 5 s
    assert _makespans("pass-q", 3, unit_topology(3, port_Bps=24.0))[0] == pytest.approx(5.0, rel=1e-9)


def test_ring_backward_hand_computed():
    # T_kv = 2, T_dkv = 4 (fp32), bwd block 2.5 s: compute 0-2.5, dKV 2.5-6.5, compute 2.5-5,
    # accumulate at 6.5, dKV 6.5-10.5
    assert _makespans("ring", 2, unit_topology(2, port_Bps=8.0), passes="bwd")[1] == pytest.approx(10.5, rel=1e-9)


@pytest.mark.parametrize("topo_name,n,seq", [("h100x32", 32, "128K"), ("dgx-h100", 64, "256K"), ("l20x8", 16, "64K")])
@pytest.mark.parametrize("name", ["ring", "pass-q"])
def test_symmetric_simulation_equals_full(topo_name, n, seq, name):
    topo = Topology.load(topo_name, gpus=n)
    w = resolve(seq_len=seq)
    alg = get(name)
    sched = alg.schedule(alg.plan(w, topo, n, alg.normalize({})), topo)
    fast, full = simulate(sched, topo), simulate(sched, topo, reduce=False)
    assert fast.reps < n and full.reps == n
    np.testing.assert_allclose(fast.end, full.end, rtol=1e-12, atol=1e-15)
    np.testing.assert_allclose(fast.start, full.start, rtol=1e-12, atol=1e-15)


@pytest.mark.parametrize("u", [2, 4, 8, 16])
def test_usp_ring_first_reduces_and_equals_full(u):
    """USP with rings on consecutive ranks: R = 32, 16 (rings over several nodes: the declared ring turns and ring
    moves), 8 (one ring a node: the node shift, the owner's final dK/dV waiting on its own column of a batch whose
    order is absolute — the same item), 4 (two rings a node) — reduced to one node's ranks, equal to every rank."""
    topo = Topology.load("h100x32", gpus=64)
    w = resolve(seq_len="256K", heads=32, kv_heads=8)
    alg = get("usp")
    sched = alg.schedule(alg.plan(w, topo, 64, alg.normalize({"ulysses_degree": u, "rank_order": "ring-first"})), topo)
    fast, full = simulate(sched, topo), simulate(sched, topo, reduce=False)
    assert fast.reps == topo.gpus_per_node and fast.exact and full.reps == 64
    np.testing.assert_allclose(fast.end, full.end, rtol=1e-12, atol=1e-15)
    np.testing.assert_allclose(fast.start, full.start, rtol=1e-12, atol=1e-15)


@pytest.mark.parametrize("topo_name,n", [("h100x16", 16), ("l20x8", 8), ("dgx-h100", 8), ("cpu-local", 3)])
@pytest.mark.parametrize("name,hops", [("ring", "n"), ("ring", "n-1"), ("pass-q", "n"), ("pass-q", "n-1")])
@pytest.mark.parametrize("layout,mask", [("zigzag", "causal"), ("contiguous", "full"), ("striped", "window:2000")])
def test_closed_form_bound_below_simulation(topo_name, n, name, hops, layout, mask):
    w = resolve(seq_len=6144 * n // 3 if n == 3 else "64K", layout=layout, mask=mask, heads=8, kv_heads=2, head_dim=64)
    knob = "dkv_hops" if name == "ring" else "dq_hops"
    cand = predict(name, w, Topology.load(topo_name, gpus=n), n, {knob: hops})
    for part, timing in cand.timing.items():
        sim = cand.predicted.passes[part].makespan_s
        assert timing.makespan_s <= timing.bound_s <= sim * (1 + 1e-9)


def test_vectorised_max_min_matches_the_reference():
    rng = np.random.default_rng(7)
    for _ in range(30):
        n_links, n_flows = 12, 40
        routes = [sorted(rng.choice(n_links, size=rng.integers(1, 4), replace=False).tolist()) for _ in range(n_flows)]
        caps = rng.uniform(1, 10, n_links).tolist()
        fcap = rng.uniform(0.05, 3, n_flows).tolist()
        rates = max_min_fair(routes, caps, fcap)            # > 16 flows: the numpy path
        # a max-min allocation is feasible and every flow is blocked by its cap or a saturated link where it
        # has a largest rate
        load = np.zeros(n_links)
        for f, r in enumerate(routes):
            load[r] += rates[f]
        assert (load <= np.asarray(caps) * (1 + 1e-9)).all()
        for f, r in enumerate(routes):
            if rates[f] >= fcap[f] * (1 - 1e-9):
                continue
            assert any(load[link] >= caps[link] * (1 - 1e-9)
                       and rates[f] >= max(rates[g] for g, rr in enumerate(routes) if link in rr) * (1 - 1e-9)
                       for link in r)


def test_numpy_and_python_max_min_agree(monkeypatch):
    import meshplan.cost.maxmin as sim
    rng = np.random.default_rng(3)
    for _ in range(20):
        routes = [sorted(rng.choice(10, size=rng.integers(1, 4), replace=False).tolist()) for _ in range(30)]
        caps = rng.uniform(1, 10, 10).tolist()
        fcap = rng.uniform(0.05, 3, 30).tolist()
        fast = max_min_fair(routes, caps, fcap)
        monkeypatch.setattr(sim, "NUMPY_MAXMIN_FROM", 10**9)
        slow = max_min_fair(routes, caps, fcap)
        monkeypatch.setattr(sim, "NUMPY_MAXMIN_FROM", 16)
        np.testing.assert_allclose(fast, slow, rtol=1e-9)


@pytest.mark.parametrize("name", ["ring", "mesh"])
def test_approximate_reduction_for_striped_layouts(name):
    """Striped blocks differ by c pairs in c²: the reduction uses each orbit's largest duration."""
    topo = Topology.load("h100x32", gpus=32)
    w = resolve(seq_len="128K", layout="striped")
    alg = get(name)
    sched = alg.schedule(alg.plan(w, topo, 32, alg.normalize({})), topo)
    approx, full = simulate(sched, topo), simulate(sched, topo, reduce=False)
    assert not approx.exact and approx.reps == 8
    assert simulate(sched, topo, exact=True).reps == 32
    for p in full.pass_makespan:
        assert approx.pass_makespan[p] == pytest.approx(full.pass_makespan[p], rel=2e-3)


def test_a_ring_steps_concurrent_hops_share_where_they_meet():
    """Ring's CCR counts a step's transfers all running at once: on cpu-local the two hops of a 2-rank ring share
    the loopback pool (each gets shared_GBps / 2); on NVSwitch ports each keeps the single-flow rate."""
    from meshplan.algorithms.rotate_timing import Rotation
    ring = get("ring")
    size = 8e6
    topo = Topology.load("cpu-local", gpus=2)
    w = resolve(seq_len=2048, heads=2, kv_heads=2, head_dim=64, passes="fwd")
    rot = Rotation(ring.plan(w, topo, 2, ring.normalize({})), topo, rows=True)
    shared = topo.spec.node.fabric.shared_GBps * 1e9
    link = topo.spec.node.fabric.link.usable_GBps * 1e9
    alpha = topo.spec.p2p_overhead_us * 1e-6
    assert rot.hop_concurrent(size) == pytest.approx(alpha + size / min(link, shared / 2))
    assert rot.hop(size) == pytest.approx(alpha + size / min(link, shared))          # one flow alone
    nv = Topology.load("h100x8", gpus=8)
    rot8 = Rotation(ring.plan(w.with_(seq_len=8192), nv, 8, ring.normalize({})), nv, rows=True)
    assert rot8.hop_concurrent(size) == pytest.approx(rot8.hop(size))


@pytest.mark.parametrize("layout,mask", [("zigzag", "causal"), ("striped", "window:3000"), ("contiguous", "full")])
def test_block_time_matrix_equals_the_per_block_formula(layout, mask):
    """The matrix of block times (interpolated on its few distinct kernel shapes, then gathered) equals the cost
    formula applied block by block, bit for bit."""
    from meshplan.cost.cost import CostModel
    from meshplan.model.matrix import attn_matrix
    topo = Topology.load("h100x32", gpus=64)
    w = resolve(seq_len="64K", layout=layout, mask=mask)
    m, cost = attn_matrix(w, 64), CostModel(topo)
    for pass_, chunks in (("fwd", (1, 1)), ("bwd", (2, 8))):
        g = np.sqrt(chunks[0] * chunks[1])
        ref = cost.block_time_s(m.flops(pass_), m.s_q * g, m.s_kv * g, m.elementwise, pass_, w.dtype, w.head_dim)
        assert np.array_equal(cost.matrix_block_times(m, pass_, chunks), ref)


def test_an_op_the_executor_runs_block_by_block_is_priced_as_its_blocks():
    """A striped Mesh 2 x 2 op (one query chunk x two KV chunks, e.g. 1 x {0, 2}: not alternate residues) costs
    the sum of its blocks' own times, each with its launch (the executor runs it block by block); a zigzag one
    the blocks' FLOPs at the efficiency of the op's shape grown by √(a·b), one launch (docs/cost-model.md)."""
    from meshplan.cost.cost import CostModel
    from meshplan.model.matrix import attn_matrix
    from meshplan.plan.schedule import COMPUTE, expand_blocks
    topo = Topology.load("cpu-local", gpus=4)
    cost = CostModel(topo)
    for layout, by_block in (("striped", True), ("zigzag", False)):
        w = resolve(seq_len=4096, heads=2, kv_heads=2, head_dim=64, mask="causal", dtype="fp32", passes="fwd",
                    layout=layout)
        sched = predict("mesh", w, topo, 4, {"tile": "2x2"}).schedule
        o, m = sched.ops, attn_matrix(w, 4)
        multi = np.flatnonzero((o.kind == COMPUTE) & (np.diff(o.qc_ptr) * np.diff(o.kvc_ptr) > 1))
        assert len(multi)
        dur = np.zeros(len(o))
        dur[multi] = cost._one_kernel(sched, multi, "fwd")       # the kernels alone (no merge into an output)
        for op in multi:
            _, qi, kj = expand_blocks(o, np.array([op]))
            g = 1.0 if by_block else np.sqrt(len(np.unique(qi)) * len(np.unique(kj)))
            t = cost.block_time_s(m.flops("fwd")[qi, kj], m.s_q[qi, kj] * g, m.s_kv[qi, kj] * g,
                                  m.elementwise[qi, kj], "fwd", w.dtype, w.head_dim)
            launch = cost.kernel.launch_s
            expect = t.sum() if by_block else t.sum() - (len(t) - 1) * launch
            assert dur[op] == pytest.approx(expect, rel=1e-12)
