"""Fitting the cost model's parameters from micro-benchmarks (docs/cost-model.md, Calibration). No torch here.

Every function takes plain measurements (seconds, bytes, FLOPs) and returns the parameter the model uses,
in the model's own form, so a fitted value means what :mod:`meshplan.cost.cost` and :mod:`meshplan.cost.simulate`
do with it:

* transfers: ``T(S) = alpha + S / bw`` (:func:`fit_alpha_beta`); bandwidth from large messages, alpha from
  small ones (≤ 64 KB), as docs/cost-model.md says;
* concurrent flows through one shared pool: aggregate bytes/s = flows · S / (T − alpha)
  (:func:`fit_shared_bandwidth`);
* attention kernels: ``t = t_launch + FLOPs / (peak · e(s_q, s_kv))`` (:func:`fit_efficiency_table`);
* overlap: the simulator runs a rank's compute at rate (1 − κ) while one of its transfers is active, so a
  kernel that overlaps transfers for ``T_overlap`` seconds takes ``t_alone + κ · T_overlap``
  (:func:`fit_kappa`);
* a shared compute pool: k ranks on a pool worth C ranks each run at rate min(1, C / k), so a kernel takes
  ``t_1 · max(1, k / C)`` (:func:`fit_pool_capacity`);
* merges: ``t = bytes / rate`` (:func:`fit_throughput`).
"""

from __future__ import annotations

import numpy as np

SMALL_MAX_BYTES = 64 * 1024         # docs/cost-model.md: alpha from messages ≤ 64 KB
# bandwidth from messages ≥ 1 MiB (docs/cost-model.md asks ≥ 64 MB; see fit_alpha_beta)
LARGE_MIN_BYTES = 1 << 20


def _as_float(*xs) -> list[np.ndarray]:
    return [np.asarray(x, dtype=np.float64).ravel() for x in xs]


def fit_line(x, y) -> tuple[float, float]:
    """Ordinary least squares ``y = a + b·x``; returns (a, b). Needs two distinct x."""
    x, y = _as_float(x, y)
    if len(np.unique(x)) < 2:
        raise ValueError("a line needs at least two distinct x values")
    b, a = np.polyfit(x, y, 1)
    return float(a), float(b)


def fit_alpha_beta(sizes_bytes, times_s, small_max_bytes: float = SMALL_MAX_BYTES,
                   large_min_bytes: float = LARGE_MIN_BYTES) -> tuple[float, float]:
    """Fit ``T(S) = alpha + S / bw`` to one-way transfer times; returns (alpha_s, bw_bytes_per_s).

    Two steps, each on the sizes where its term dominates: ``bw`` = 1 / slope of the least-squares line
    through the messages of at least ``large_min_bytes`` (two sizes at least), then ``alpha`` = the median
    over messages of at most ``small_max_bytes`` of ``T − S / bw`` (≥ 0). A single least-squares line over
    all sizes would let the few large messages set alpha from their noise. docs/cost-model.md puts "large" at
    ≥ 64 MB; the sweep goes to 64 MB, so the line starts at 1 MiB to have several points.
    """
    s, t = _as_float(sizes_bytes, times_s)
    large, small = s >= large_min_bytes, s <= small_max_bytes
    if len(np.unique(s[large])) < 2 or not small.any():
        raise ValueError(f"need two sizes ≥ {large_min_bytes:g} B and one ≤ {small_max_bytes:g} B")
    _, slope = fit_line(s[large], t[large])
    if slope <= 0:
        raise ValueError("transfer times do not grow with the size")
    bw = 1.0 / slope
    alpha = float(np.median(t[small] - s[small] / bw))
    return max(alpha, 0.0), bw


def fit_shared_bandwidth(sizes_bytes, times_s, flows: int, alpha_s: float,
                         large_min_bytes: float = LARGE_MIN_BYTES) -> float:
    """Aggregate bytes/s of ``flows`` equal concurrent flows of ``S`` bytes that all end by ``T``:
    the median over large messages of ``flows · S / (T − alpha)``."""
    s, t = _as_float(sizes_bytes, times_s)
    big = s >= large_min_bytes
    if not big.any():
        raise ValueError(f"need a size ≥ {large_min_bytes:g} B")
    return float(np.median(flows * s[big] / np.maximum(t[big] - alpha_s, 1e-12)))


def efficiencies(flops, times_s, peak_flops_per_s: float, launch_s: float = 0.0) -> np.ndarray:
    """``e = FLOPs / ((t − t_launch) · peak)`` (the cost model's kernel time solved for e), clipped to (0, 1]."""
    f, t = _as_float(flops, times_s)
    busy = np.maximum(t - launch_s, 1e-3 * t)
    return np.clip(f / (busy * peak_flops_per_s), 1e-6, 1.0)


def fit_efficiency_table(shapes, times_s, flops, peak_flops_per_s: float, launch_s: float = 0.0,
                         symmetric: bool = True) -> tuple[list[int], list[list[float]]]:
    """An efficiency table (:class:`meshplan.model.kernel_tables.KernelTableSpec` form) from kernel timings.

    Args:
        shapes: (s_q, s_kv) of each timing; the grid is the sorted distinct sizes of both.
        times_s, flops: each timing's seconds and FLOPs (repeated shapes: their median time is used).
        symmetric: the table is made symmetric, ``e(a, b) = e(b, a)`` (the simulator's symmetry reduction
            needs it, :mod:`meshplan.model.kernel_tables`): a cell and its mirror share the efficiency of their mean
            time, and one triangle measured is enough.
    Returns:
        (tokens, table): ``table[i][j]`` the efficiency at s_q = tokens[i], s_kv = tokens[j].
    Raises:
        ValueError: a grid cell (and, when symmetric, its mirror) has no timing.
    """
    sh = np.asarray(shapes, dtype=np.int64).reshape(-1, 2)
    t, f = _as_float(times_s, flops)
    tokens = sorted(set(sh.ravel().tolist()))
    idx = {s: k for k, s in enumerate(tokens)}
    n = len(tokens)
    time_of, flop_of = np.full((n, n), np.nan), np.full((n, n), np.nan)
    for i, j in {(idx[a], idx[b]) for a, b in sh.tolist()}:
        sel = (sh[:, 0] == tokens[i]) & (sh[:, 1] == tokens[j])
        time_of[i, j], flop_of[i, j] = np.median(t[sel]), np.median(f[sel])
    if symmetric:
        mirror = time_of.T
        time_of = np.where(np.isnan(time_of), mirror, np.where(np.isnan(mirror), time_of, (time_of + mirror) / 2))
        flop_of = np.where(np.isnan(flop_of), flop_of.T, flop_of)
    if np.isnan(time_of).any():
        i, j = np.argwhere(np.isnan(time_of))[0]
        raise ValueError(f"no timing for s_q={tokens[i]}, s_kv={tokens[j]}")
    e = efficiencies(flop_of, time_of, peak_flops_per_s, launch_s).reshape(n, n)
    return tokens, [[float(x) for x in row] for row in e]


def fit_ratio(num, den) -> float:
    """The median of ``num / den`` clipped to (0, 1] (e.g. masked over full efficiency: elementwise_factor)."""
    a, b = _as_float(num, den)
    return float(np.clip(np.median(a / b), 1e-6, 1.0))


def fit_kappa(alone_s, with_s, overlap_s) -> float:
    """κ of ``t_with = t_alone + κ · T_overlap`` (the simulator's compute at rate 1 − κ while a transfer is
    active): the median over samples of ``(t_with − t_alone) / T_overlap`` (robust to a sample another process
    slowed), clipped to [0, 0.99]. Samples without overlap are ignored.
    """
    a, w, o = _as_float(alone_s, with_s, overlap_s)
    live = o > 0
    if not live.any():
        raise ValueError("no sample overlapped a transfer")
    return float(np.clip(np.median((w[live] - a[live]) / o[live]), 0.0, 0.99))


def fit_transfer_kappa(comm_s, comm_alone_s, overlap_s) -> float:
    """κ_t of the simulator's slowed transfers (rate × (1 − κ_t) while an end rank computes): transfers of
    ``comm_alone_s`` work took ``comm_s``, ``overlap_s`` of it beside a kernel, so
    ``comm_s = overlap_s + (comm_alone_s − (1 − κ_t) · overlap_s)`` ⇒ ``κ_t = (comm_s − comm_alone_s) / overlap_s``;
    the median over samples, clipped to [0, 0.99]. Samples without overlap are ignored.
    """
    c, a, o = _as_float(comm_s, comm_alone_s, overlap_s)
    live = o > 0
    if not live.any():
        raise ValueError("no sample overlapped a kernel")
    return float(np.clip(np.median((c[live] - a[live]) / o[live]), 0.0, 0.99))


def fit_transfer_cpu(size_bytes, exchanges, cpu_s, min_bytes: int = 1 << 20) -> float | None:
    """Core-seconds per byte moved: the median over samples of ``size_bytes`` ≥ ``min_bytes`` (smaller messages
    are dominated by per-message costs) of ``cpu_s / (2 · size_bytes · exchanges)`` (an exchange moves a message
    each way); None without such a sample."""
    s, n, c = _as_float(size_bytes, exchanges, cpu_s)
    live = (s >= min_bytes) & (n > 0)
    if not live.any():
        return None
    return float(np.median(c[live] / (2.0 * s[live] * n[live])))


def fit_pool_capacity(ranks, times_s) -> float:
    """C of ``t_k = t_1 · max(1, k / C)``: k ranks running one kernel each on a pool worth C ranks (in the
    simulator they share it max-min fairly and end together; on a host, give the slowest rank's time).

    ``t_1`` is the median time with one rank; C minimises the squared log error over all samples (a scan
    of [0.25, max k] in steps of about 0.001; no slowdown at all gives C = the most ranks measured, a lower
    bound).
    """
    k, t = _as_float(ranks, times_s)
    if not (k == 1).any() or not (k > 1).any():
        raise ValueError("need timings with one rank and with several")
    t1 = float(np.median(t[k == 1]))
    grid = np.linspace(0.25, k.max(), int(1000 * k.max()) + 1)
    pred = np.log(np.maximum(1.0, k[None, :] / grid[:, None]))
    err = ((np.log(t / t1)[None, :] - pred) ** 2).sum(axis=1)
    return float(grid[np.flatnonzero(err <= err.min() * (1 + 1e-9) + 1e-15)[0]])


def fit_throughput(sizes_bytes, times_s) -> float:
    """Bytes/s of a memory-bound op charged ``t = bytes / rate`` (the cost model's merge term, no fixed part):
    the median over sizes of bytes / t, so each size counts once (a line fit would follow the largest, whose
    buffers leave the caches and fault in fresh pages)."""
    b, t = _as_float(sizes_bytes, times_s)
    return float(np.median(b / t))
