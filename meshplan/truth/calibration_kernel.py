"""The kernel table's fit from a calibration's raw samples (:func:`kernel_table`, used by
:func:`meshplan.truth.calibration_fit.fit_calibration`): every form is :mod:`meshplan.truth.fit`'s or a median ratio
of timings,
written to 4 significant digits."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from meshplan.core.units import round_sig
from meshplan.model.kernel_tables import KernelTableSpec
from meshplan.truth import fit

if TYPE_CHECKING:
    from meshplan.model.calibration_file import Raw


def kernel_table(raw: Raw, peak: float, launch_s: float, peak_ratios: dict[str, float],
                 segments: str = "per_call") -> KernelTableSpec:
    """The calibrated kernel table of ``raw`` (a :class:`~meshplan.model.calibration_file.Raw`): efficiencies of the
    full
    s_q × s_kv kernels relative to ``peak`` (FLOP/s of raw.dtype) after ``launch_s``, the causal-piece multiplier
    by size, the head-dim multipliers, the D-carrying backward's factor, and per other dtype the multipliers by
    size (``peak_ratios``: each dtype's peak over raw.dtype's, as the topology will use them)."""
    tables = {}
    for p in ("fwd", "bwd"):
        full = [s for s in raw.kernels if s.pass_ == p and not s.causal]
        tokens, tables[p] = fit.fit_efficiency_table([(s.s_q, s.s_kv) for s in full], [s.time_s for s in full],
                                                     [s.flops for s in full], peak, launch_s)
    index = {s: i for i, s in enumerate(tokens)}
    masked = [s for s in raw.kernels if s.causal and s.s_q in index and s.s_q == s.s_kv]
    ratio, by_size = 1.0, None
    if masked:
        e = fit.efficiencies([s.flops for s in masked], [s.time_s for s in masked], peak, launch_s)
        full_e = [tables[s.pass_][index[s.s_q]][index[s.s_q]] for s in masked]
        ratio = fit.fit_ratio(e, full_e)
        per = {}                        # per size: the median over passes of causal over full efficiency
        for s, a, b in zip(masked, e, full_e):
            per.setdefault(s.s_q, []).append(a / b)
        if set(per) == set(tokens):
            by_size = [min(1.5, round_sig(float(np.median(per[t])))) for t in tokens]
    spec = KernelTableSpec(
        name="calibrated", source=f"meshplan calibrate: {raw.dtype} kernels timed on this host; efficiency = "
        "FLOPs / ((time − launch) · peak), symmetric (a cell and its mirror share their mean time)",
        launch_us=round_sig(launch_s * 1e6), tokens=tokens, fwd=_table(tables["fwd"]), bwd=_table(tables["bwd"]),
        elementwise_factor=round_sig(ratio), elementwise=by_size, **_head_dim_factors(raw, peak, launch_s),
        **_dtype_factors(raw, peak_ratios),
        bwd_delta_factor=max(1.0, round_sig(float(np.median([a / b for _, a, b in raw.recurrence])))) if raw.recurrence
        else 1.0, bwd_delta_dtype=_delta_by_dtype(raw), segments=segments, stage_inputs=True,
        **({} if segments == "per_call" else {"tile_fwd": (128, 64), "tile_bwd": (64, 128)}))
    return spec.model_copy(update={"segment_us": segment_cost_us(raw, spec, peak)})


def segment_cost_us(raw: Raw, spec: KernelTableSpec, peak: float) -> float:
    """``segment_us``: the median over ``raw.segment_mixes`` of (measured time − the table's price of the block's
    kernels, one per document at its own shape with its launch) per document, microseconds (at least 0; 0 without
    samples). Per-call tables only (varlen tables price tiles, which one CPU block cannot time)."""
    from meshplan.model.kernel_tables import KernelTable

    if spec.segments != "per_call" or not raw.segment_mixes:
        return 0.0
    table, extra = KernelTable(spec), []
    for s in raw.segment_mixes:
        lens = np.asarray(s.doc_lens, dtype=np.float64)
        if s.kind == "causal":
            rows, cols, pairs = lens, lens, lens * (lens + 1) / 2
        else:
            cols = np.floor(lens / 2)
            rows = lens - cols
            pairs = rows * cols
        flops = 4.0 * s.batch * s.heads * s.head_dim * pairs * (2.5 if s.pass_ == "bwd" else 1.0)
        e = table.efficiency(rows, cols, s.pass_, s.kind == "causal", s.head_dim, dtype=raw.dtype)
        model = float((table.launch_s + flops / (peak * e)).sum())
        extra.append((s.time_s - model) / len(lens))
    return max(0.0, round_sig(float(np.median(extra)) * 1e6))


def _delta_by_dtype(raw: Raw) -> dict[str, float] | None:
    """``bwd_delta_dtype``: per dtype of ``raw.dtype_recurrence``, the median ratio of the backward from D over
    the backward from O (at least 1); None without samples."""
    ratios: dict[str, list[float]] = {}
    for dt, _, t_rec, t_flash in raw.dtype_recurrence:
        ratios.setdefault(dt, []).append(t_rec / t_flash)
    return {dt: max(1.0, round_sig(float(np.median(r)))) for dt, r in sorted(ratios.items())} or None


def merge_by_dtype(raw: Raw, merge_rate: float) -> dict[str, float] | None:
    """``merge_dtype``: per dtype of ``raw.dtype_merges``, the median over sizes of the merge's time over its bytes /
    ``merge_rate`` (bytes/s, the raw.dtype merges' fit); None without samples."""
    ratios: dict[str, list[float]] = {}
    for dt, size, t in raw.dtype_merges:
        ratios.setdefault(dt, []).append(t * merge_rate / size)
    return {dt: round_sig(float(np.median(r))) for dt, r in sorted(ratios.items())} or None


def _head_dim_factors(raw: Raw, peak: float, launch_s: float) -> dict:
    """``head_dims``, ``head_dim_fwd``, ``head_dim_bwd`` of the kernel table: per pass and head dim, the median over
    sizes of the efficiency there over the efficiency at the table's own head dim (the same sizes); {} without
    samples at the table's head dim and another."""
    own = {s.head_dim for s in raw.kernels}
    rows = raw.head_dim_kernels
    dims = sorted({d for _, d, *_ in rows})
    if len(own) != 1 or len(dims) < 2 or next(iter(own)) not in dims:
        return {}
    d0 = next(iter(own))
    eff = {(p, d, s): float(fit.efficiencies([f], [t], peak, launch_s)[0]) for p, d, s, f, t in rows}
    out = {"head_dims": dims}
    for p in ("fwd", "bwd"):
        out[f"head_dim_{p}"] = [round_sig(float(np.median([eff[(p, d, s)] / eff[(p, d0, s)] for q, dd, s, *_ in rows
                                                     if q == p and dd == d and (p, d0, s) in eff]))) for d in dims]
    return out


def _dtype_factors(raw: Raw, peak_ratios: dict[str, float]) -> dict:
    """``dtype_tokens``, ``dtype_head_dims``, ``dtype_fwd``, ``dtype_bwd`` of the kernel table: per dtype, pass,
    head dim and size, the median over the sweep's rounds of (seconds in raw.dtype / seconds in that dtype) over
    that dtype's peak ratio, so ``peak × e × head-dim multiplier × this`` gives the measured time there; {} without
    sweep samples.

    Raises:
        ValueError: a dtype, pass and head dim without a sample at one of the sweep's sizes.
    """
    rows = [r for r in raw.dtype_sweep if r[0] != raw.dtype and r[0] in peak_ratios]
    if not rows:
        return {}
    sizes, dims = sorted({r[3] for r in rows}), sorted({r[2] for r in rows})
    out: dict = {"dtype_tokens": sizes, "dtype_head_dims": dims, "dtype_fwd": {}, "dtype_bwd": {}}
    for dt in sorted({r[0] for r in rows}):
        for p in ("fwd", "bwd"):
            table = []
            for d in dims:
                got = [[t_ref / t for n, q, hd, s, t, t_ref in rows if (n, q, hd, s) == (dt, p, d, size)]
                       for size in sizes]
                if any(not g for g in got):
                    raise ValueError(f"dtype sweep: {dt} {p} at head dim {d} lacks a size of {sizes}")
                table.append([round_sig(float(np.median(g)) / peak_ratios[dt]) for g in got])
            out[f"dtype_{p}"][dt] = table
    return out


def _table(t: list[list[float]]) -> list[list[float]]:
    return [[max(round_sig(x), 1e-4) for x in row] for row in t]


# ------------------------------------------------------------------------------------------------ files
