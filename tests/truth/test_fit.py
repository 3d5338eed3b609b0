"""meshplan.truth.fit: every fit recovers the parameters synthetic measurements were generated from, and the
fitted forms are the simulator's (κ and the compute pool checked against simulate())."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import unit_topology, unit_workload

from meshplan.algorithms import get
from meshplan.cost.simulate import simulate
from meshplan.plan.schedule import COMPUTE, SEND
from meshplan.truth import fit

SIZES = [1 << k for k in range(10, 27, 2)]          # 1 KiB .. 64 MiB, as the benchmark sweeps


def _noisy(x, rel: float, seed: int = 0):
    """``x`` times (1 + U(0, rel)): other processes only ever slow a measurement down."""
    x = np.asarray(x, dtype=np.float64)
    return x * (1 + np.random.default_rng(seed).uniform(0, rel, x.shape))


def test_alpha_beta_recovered_exactly_and_with_noise():
    alpha, bw = 80e-6, 4e9
    t = alpha + np.asarray(SIZES) / bw
    a, b = fit.fit_alpha_beta(SIZES, t)
    assert a == pytest.approx(alpha, rel=1e-9) and b == pytest.approx(bw, rel=1e-9)
    a, b = fit.fit_alpha_beta(SIZES, _noisy(t, 0.03))
    assert a == pytest.approx(alpha, rel=0.05) and b == pytest.approx(bw, rel=0.05)   # stated tolerance: 5%


def test_alpha_beta_needs_both_regimes():
    with pytest.raises(ValueError):
        fit.fit_alpha_beta([1 << 20, 4 << 20], [1e-3, 2e-3])          # no small message
    with pytest.raises(ValueError):
        fit.fit_alpha_beta([1024, 1 << 20], [1e-4, 1e-3])             # one large size only


def test_shared_bandwidth_of_concurrent_flows():
    alpha, agg = 50e-6, 5e9
    t = alpha + 2 * np.asarray(SIZES) / agg                           # two flows share the pool
    assert fit.fit_shared_bandwidth(SIZES, t, 2, alpha) == pytest.approx(agg, rel=1e-9)


TOKENS = [64, 128, 256, 512]
PEAK, LAUNCH = 2e11, 8e-6


def _g(s):
    return s / (s + 100.0)


def _timings(e_of, shapes, heads=4, head_dim=64):
    flops = [4.0 * heads * head_dim * a * b for a, b in shapes]
    times = [LAUNCH + f / (PEAK * e_of(a, b)) for f, (a, b) in zip(flops, shapes)]
    return flops, times


def test_efficiency_table_recovered_on_the_grid():
    e_true = lambda a, b: 0.3 * _g(a) * _g(b)  # noqa: E731
    shapes = [(a, b) for a in TOKENS for b in TOKENS]
    flops, times = _timings(e_true, shapes)
    tokens, table = fit.fit_efficiency_table(shapes, times, flops, PEAK, LAUNCH)
    assert tokens == TOKENS
    want = [[e_true(a, b) for b in TOKENS] for a in TOKENS]
    np.testing.assert_allclose(table, want, rtol=1e-9)


def test_efficiency_table_symmetric_from_one_triangle_or_mean_of_both():
    e_true = lambda a, b: 0.3 * _g(a) * _g(b)  # noqa: E731
    upper = [(a, b) for i, a in enumerate(TOKENS) for b in TOKENS[i:]]
    flops, times = _timings(e_true, upper)
    _, table = fit.fit_efficiency_table(upper, times, flops, PEAK, LAUNCH)
    t = np.asarray(table)
    assert np.array_equal(t, t.T)                                     # bit-symmetric (the simulator needs it)
    np.testing.assert_allclose(t, [[e_true(a, b) for b in TOKENS] for a in TOKENS], rtol=1e-9)
    # a kernel slower one way round: the symmetric cell has the efficiency of the mean time
    skew = lambda a, b: e_true(a, b) * (0.5 if a > b else 1.0)  # noqa: E731
    both = [(a, b) for a in TOKENS for b in TOKENS]
    flops, times = _timings(skew, both)
    _, table = fit.fit_efficiency_table(both, times, flops, PEAK, LAUNCH)
    f, t_ab, t_ba = flops[1], times[1], times[len(TOKENS)]            # (64, 128) and (128, 64)
    assert table[0][1] == table[1][0] == pytest.approx(f / ((0.5 * (t_ab + t_ba) - LAUNCH) * PEAK), rel=1e-9)
    _, raw = fit.fit_efficiency_table(both, times, flops, PEAK, LAUNCH, symmetric=False)
    assert raw[1][0] == pytest.approx(skew(128, 64), rel=1e-9)


def test_efficiency_table_refuses_a_hole():
    shapes = [(64, 64), (128, 128)]
    flops, times = _timings(lambda a, b: 0.2, shapes)
    with pytest.raises(ValueError, match="s_q=64, s_kv=128"):
        fit.fit_efficiency_table(shapes, times, flops, PEAK, LAUNCH)


def test_kappa_recovered_for_partial_and_full_overlap():
    alone, kappa = 0.05, 0.2
    overlap = np.array([0.01, 0.03, 0.05])
    assert fit.fit_kappa([alone] * 3, alone + kappa * overlap, overlap) == pytest.approx(kappa, rel=1e-9)
    with_s = alone / (1 - kappa)                                      # transfers all along: rate 1 − κ
    assert fit.fit_kappa([alone], [with_s], [with_s]) == pytest.approx(kappa, rel=1e-9)


def test_kappa_form_is_the_simulators():
    """test_simulate's ring: T = 1.5 s, κ = 0.5, block 0 (1 s alone) ends at 1.75 s; fitting the simulated
    spans gives back the κ the simulator was given."""
    topo = unit_topology(2, port_Bps=16 / 1.5, kappa=0.5)
    alg = get("ring")
    sched = alg.schedule(alg.plan(unit_workload(2), topo, 2, alg.normalize({})), topo)
    sim = simulate(sched, topo)
    o = sched.ops
    block = np.flatnonzero((o.kind == COMPUTE) & (o.rank == 0))[0]
    send = np.flatnonzero((o.kind == SEND) & (o.rank == 0))[0]
    with_s = sim.end[block] - sim.start[block]
    overlap = min(sim.end[block], sim.end[send]) - max(sim.start[block], sim.start[send])
    assert fit.fit_kappa([1.0], [with_s], [overlap]) == pytest.approx(0.5, rel=1e-9)


@pytest.mark.parametrize("capacity", [1.0, 1.5, 2.0, 3.2])
def test_pool_capacity_recovered(capacity):
    k = np.array([1, 2, 3, 4])
    t = 0.01 * np.maximum(1.0, k / capacity)
    assert fit.fit_pool_capacity(k, t) == pytest.approx(capacity, abs=2e-3)
    assert fit.fit_pool_capacity(k, _noisy(t, 0.02, seed=3)) == pytest.approx(capacity, rel=0.05)


def test_pool_without_slowdown_gives_the_most_ranks_measured():
    assert fit.fit_pool_capacity([1, 2], [0.01, 0.01]) == pytest.approx(2.0)


def test_pool_form_is_the_simulators():
    """Two ranks on one core (test_simulate): each 1 s block takes 2 s, which fits a pool of one rank."""
    topo = unit_topology(2, kind="loopback", port_Bps=1e9, shared_Bps=1e9, cores=1)
    alg = get("ring")
    sched = alg.schedule(alg.plan(unit_workload(2), topo, 2, alg.normalize({})), topo)
    sim = simulate(sched, topo)
    block = np.flatnonzero(sched.ops.kind == COMPUTE)[0]
    shared_s = sim.end[block] - sim.start[block]
    assert fit.fit_pool_capacity([1, 2], [1.0, shared_s]) == pytest.approx(topo.pool_capacity, abs=2e-3)


def test_throughput_and_ratio():
    b = np.array([1e6, 4e6, 16e6])
    assert fit.fit_throughput(b, b / 6e9) == pytest.approx(6e9, rel=1e-9)
    assert fit.fit_throughput(b, b / 6e9 * [1.0, 1.0, 3.0]) == pytest.approx(6e9, rel=1e-9)   # one size slowed
    assert fit.fit_ratio([0.1, 0.2, 0.3], [0.2, 0.4, 0.6]) == pytest.approx(0.5)
    assert fit.fit_ratio([2.0], [1.0]) == 1.0                        # clipped: a factor never speeds up


def test_fit_transfer_kappa_recovers_the_slowdown():
    from meshplan.truth.fit import fit_transfer_kappa
    # work W alone; O of it beside a kernel at rate 1 − k: comm_s = O + (W − (1 − k) O) = W + k O
    k, work, over = 0.6, np.array([3.0, 2.0, 4.0]), np.array([1.0, 1.5, 2.0])
    assert fit_transfer_kappa(work + k * over, work, over) == pytest.approx(k)
    with pytest.raises(ValueError, match="no sample"):
        fit_transfer_kappa([1.0], [1.0], [0.0])
