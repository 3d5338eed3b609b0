"""Merging repeated calibration runs (``meshplan calibrate --repeat N``) into one ``raw`` before the fit. No torch.

On a shared VM one calibration is not reproducible: eight runs of one day put the compute pool at 1.59-1.94
ranks, κ at 0.22-0.48 and kernel cells 5-10% apart, because a slow spell of the host falls on some
micro-benchmarks and not on others. Run N times, a measurement taken once per run (a kernel shape, a matmul, a
transfer size) is merged as the **median over the runs**, so one run's slow spell does not move it; lists of
samples (overlap rounds, the dtype sweep's rounds, probes, memory rises) are **pooled**, since their fits
already take medians over samples. It does not remove the host's drift over minutes: two ``--repeat 3``
calibrations back to back agreed on the pool (1.905 / 1.884 ranks) and κ (0.456 / 0.426) but put the kernel
cells a median 10% apart, as far as the host-speed probe moved between them. The merged ``raw`` is an
ordinary one (``raw.repeats`` says how many runs it holds), so ``calibrate --refit`` fits it to the same numbers.
"""

from __future__ import annotations

import numpy as np

# tuple rows: field -> how many trailing entries are timings (the rest is the key)
_TUPLE_KEYED = {"gemm": 1, "merges": 1, "dtype_merges": 1, "head_dim_kernels": 1, "dtype_kernels": 2}
# dict rows: field -> the timing keys (the other keys are the key)
_DICT_KEYED = {"kernels": ("time_s",), "p2p": ("time_s",)}
_POOLED = ("launch_s", "overlap", "dtype_sweep", "recurrence", "dtype_recurrence", "probe_ms", "memory",
           "segment_mixes", "transfer_cpu")
_SAME = ("dtype", "link_class")


def merge_raws(raws: list[dict]) -> dict:
    """One raw (plain dict, :class:`meshplan.model.calibration_file.Raw` form) from the raws of ``len(raws)`` runs.

    Keyed rows take the median of their timings over the runs that have the key (in the first run's order, then
    the keys only later runs have); sample lists are concatenated; ``sharing`` keeps, per rank count, the median
    over runs of the i-th fastest rank's time (so its slowest rank, which the pool fit takes, is the median of the
    runs' slowest). Fields this module does not know are taken from the first run.

    Raises:
        ValueError: no runs, or runs that disagree on ``dtype`` or ``link_class``.
    """
    if not raws:
        raise ValueError("no calibration runs to merge")
    for key in _SAME:
        if len({r.get(key) for r in raws}) > 1:
            raise ValueError(f"the runs disagree on raw.{key}: {[r.get(key) for r in raws]}")
    out = dict(raws[0])
    for key, n_time in _TUPLE_KEYED.items():
        if key in out:
            out[key] = [(*k, *t) for k, t in _medians([[(tuple(row[:-n_time]), row[-n_time:]) for row in r.get(key, [])]
                                                       for r in raws])]
    for key, fields in _DICT_KEYED.items():
        if key in out:
            runs = [[(tuple((f, v) for f, v in row.items() if f not in fields), [row[f] for f in fields])
                     for row in r.get(key, [])] for r in raws]
            out[key] = [dict(k) | dict(zip(fields, t)) for k, t in _medians(runs)]
    for key in _POOLED:
        if key in out:
            out[key] = [row for r in raws for row in r.get(key, [])]
    if "sharing" in out:
        out["sharing"] = _merge_sharing([r.get("sharing", []) for r in raws])
    out["repeats"] = sum(int(r.get("repeats", 1)) for r in raws)
    return out


def _medians(runs: list[list[tuple[tuple, list]]]) -> list[tuple[tuple, list[float]]]:
    """(key, timings) rows of every run grouped by key (first appearance first); each key's timings the median over
    its rows."""
    groups: dict = {}
    for rows in runs:
        for key, times in rows:
            groups.setdefault(key, []).append([float(t) for t in times])
    return [(k, [float(m) for m in np.median(np.asarray(ts), axis=0)]) for k, ts in groups.items()]


def _merge_sharing(runs: list[list]) -> list:
    """(ranks at once, seconds) rows: per rank count, the median over runs of each rank position's time, ranks
    sorted fastest first within a run."""
    by_k: dict[int, list[list[float]]] = {}
    for rows in runs:
        mine: dict[int, list[float]] = {}
        for k, t in rows:
            mine.setdefault(int(k), []).append(float(t))
        for k, ts in mine.items():
            by_k.setdefault(k, []).append(sorted(ts))
    out = []
    for k, lists in by_k.items():
        width = min(len(ts) for ts in lists)
        out += [(k, float(np.median([ts[i] for ts in lists]))) for i in range(width)]
    return out
