"""The statistics of ``validate_cpu.py``: Kendall τ over pairs measurably apart, top-1 regret, and the race that
measures the regret of the planner's pick without the winner's curse (docs/cost-model.md, "Validation").

**Why a race.** Top-1 regret = (measured time of the predicted best − measured best) / measured best. With ~30
candidates whose medians each carry a few percent of noise, the smallest measured median is the luckiest one,
about 2σ below its true time, so plain regret is biased upwards even for a perfect model (and the candidate it
names is often not the fastest). The race re-measures the candidates that stage 1 could not tell from the
fastest (not slower than it by more than 2σ, at most ``MAX_CONTENDERS``), plus the pick, in more interleaved
rounds, and compares them **paired by round** (a round's times share the host's speed at that moment, so the
drift between rounds cancels in a ratio). Its regret is given two ways:

- ``regret_pct``: the pick against the contender it loses to most, median over rounds of the paired log ratio —
  still the maximum of several noisy estimates, so biased upwards;
- ``heldout_regret_pct``: split the rounds in halves; the fastest contender on one half is timed against the pick
  on the other half; the mean over splits. Choosing and timing on different rounds removes the selection bias
  (the estimate's expectation is the pick's true excess over the candidate a noisy choice would select, which is
  at most the true regret), the standard remedy for a winner's curse (cross-fitting). It can be negative: the
  pick measured faster than the held-out choice.

Inputs are plain dicts and lists as ``validate_cpu.py`` stores them (times in seconds).
"""

from __future__ import annotations

import itertools

import numpy as np

MAX_CONTENDERS = 8      # stage 2 races at most this many candidates (the fastest by stage-1 median) plus the pick
HELDOUT_SPLITS = 200    # random half-splits of the rounds when there are more than that many


def ranking(rows: list[dict], key: str = "measured_s", sigma: str = "sigma_s") -> dict:
    """Kendall τ's concordant and discordant pairs over the pairs whose measured ``key`` differ by more than 2σ
    (``sigma``, the larger of the two), top-1 regret against the fastest ``key`` and against only the
    candidates faster than the pick by more than 2σ."""
    agree = disagree = 0
    for i in range(len(rows)):
        for j in range(i + 1, len(rows)):
            a, b = rows[i], rows[j]
            if abs(a[key] - b[key]) <= 2 * max(a[sigma], b[sigma]):
                continue
            same = (a[key] < b[key]) == (a["predicted_s"] < b["predicted_s"])
            agree, disagree = agree + same, disagree + (not same)
    pick = rows[pick_index(rows)]
    best = min(r[key] for r in rows)
    faster = [r[key] for r in rows if pick[key] - r[key] > 2 * max(pick[sigma], r[sigma])]
    return {"pairs": agree + disagree, "concordant": agree, "discordant": disagree,
            "regret_pct": 100 * (pick[key] - best) / best,
            "regret_2sigma_pct": 100 * (pick[key] - min(faster)) / min(faster) if faster else 0.0}


def pick_index(rows: list[dict]) -> int:
    """The planner's pick: the smallest predicted time (ties: the first, as ``search`` orders them)."""
    return min(range(len(rows)), key=lambda i: rows[i]["predicted_s"])


def contenders(rows: list[dict], limit: int = MAX_CONTENDERS) -> list[int]:
    """Row indices to race: every candidate whose stage-1 median is within 2σ (the larger of the two) of the
    fastest median, at most ``limit`` of them (the fastest first), and the pick whatever its time; sorted."""
    best = min(range(len(rows)), key=lambda i: rows[i]["measured_s"])
    b = rows[best]
    near = [i for i in sorted(range(len(rows)), key=lambda i: rows[i]["measured_s"])
            if rows[i]["measured_s"] - b["measured_s"] <= 2 * max(rows[i]["sigma_s"], b["sigma_s"])][:limit]
    return sorted(set(near) | {pick_index(rows)})


def paired_regret(times_s, pick: int, splits: int = HELDOUT_SPLITS, seed: int = 0) -> dict:
    """Regret of candidate ``pick`` from paired rounds.

    Args:
        times_s: [C, R] seconds, candidate c's time in round r (every candidate runs once per round).
        pick: the row of the planner's pick.
    Returns:
        ``regret_pct``: 100 · (exp(max_c median_r(log t[pick, r] − log t[c, r])) − 1), ≥ 0;
        ``heldout_regret_pct``: the mean over half-splits (A, B) of the rounds of
        100 · (exp(median_{r∈B}(log t[pick, r] − log t[a, r])) − 1), a = the fastest candidate on A by median
        of round-normalised log times; None with fewer than 4 rounds;
        ``heldout_choice``: how often each candidate was the choice on A (row -> fraction).
    Raises:
        ValueError: fewer than one round, or a non-positive time.
    """
    t = np.asarray(times_s, dtype=np.float64)
    if t.ndim != 2 or t.shape[1] < 1 or (t <= 0).any():
        raise ValueError("times_s must be [candidates, rounds] of positive seconds")
    log_t = np.log(t)
    diff = log_t[pick][None, :] - log_t                  # [C, R]: the pick over each candidate, per round
    plain = float(np.expm1(np.median(diff, axis=1).max()))
    n_rounds = t.shape[1]
    out = {"regret_pct": 100 * plain, "heldout_regret_pct": None, "heldout_choice": {}, "rounds": n_rounds}
    if n_rounds < 4:
        return out
    norm = log_t - log_t.mean(axis=0, keepdims=True)     # each round's drift taken out
    regrets, chosen = [], []
    for a_half in _halves(n_rounds, splits, seed):
        b_half = np.setdiff1d(np.arange(n_rounds), a_half)
        choice = int(np.argmin(np.median(norm[:, a_half], axis=1)))
        regrets.append(np.expm1(np.median(diff[choice, b_half])))
        chosen.append(choice)
    out["heldout_regret_pct"] = float(100 * np.mean(regrets))
    out["heldout_choice"] = {int(c): chosen.count(c) / len(chosen) for c in sorted(set(chosen))}
    return out


def _halves(n: int, splits: int, seed: int) -> list[np.ndarray]:
    """Half of ``n`` rounds (the smaller half when odd) per split: every such subset when there are at most
    ``splits``, else ``splits`` random ones (seeded, so a re-run of the statistics gives the same numbers)."""
    k = n // 2
    every = list(itertools.combinations(range(n), k)) if n <= 16 else []
    if every and len(every) <= splits:
        return [np.asarray(c) for c in every]
    rng = np.random.default_rng(seed)
    return [np.sort(rng.permutation(n)[:k]) for _ in range(splits)]


def race_regret(rows: list[dict], race: dict | None) -> dict:
    """The pick's paired regret: over the race's candidates and rounds (stage 1's and stage 2's) when the pick was
    raced, else over every candidate's stage-1 rounds (a pick stage 1 found measurably slow; also after
    ``--repredict`` moved the pick outside the race)."""
    p = pick_index(rows)
    if race and p in race["candidates"]:
        idx = race["candidates"]
        times = [rows[i]["rounds_s"] + race["rounds_s"][k] for k, i in enumerate(idx)]
        got = paired_regret(times, idx.index(p))
        got["heldout_choice"] = {idx[c]: f for c, f in got["heldout_choice"].items()}
        return got | {"raced": True, "pick": p}
    got = paired_regret([r["rounds_s"] for r in rows], p)
    return got | {"raced": False, "pick": p}


def summary(results: list[dict]) -> dict:
    """Per rank count: MAPE and max of makespan, τ over the pooled pairs, worst and mean regret, the race's regret,
    CCR errors, the host's drift (probe kernel, max over min); ``adjusted``: the same against the measurements
    rescaled to the calibration's host speed (each round × calibration probe / that round's probe); ``best``:
    against each candidate's fastest round (best of R, timeit's estimator: a shared host's interference only ever
    slows a run down), the pairs' 2σ still from the rounds' spread."""
    out = {}
    for n in sorted({r["ranks"] for r in results}):
        sub = [r for r in results if r["ranks"] == n]
        ccr = [100 * (r["ring_ccr"]["predicted"] / r["ring_ccr"]["measured"] - 1) for r in sub
               if r["ring_ccr"] and np.isfinite(r["ring_ccr"]["measured"])]
        probes = [p for r in sub for row in r["rows"] for p in row["probe_ms"]]
        out[str(n)] = _accuracy(sub, "error_pct", lambda r: r) | _race_summary(sub) | {
            "ccr_mape_pct": float(np.mean(np.abs(ccr))) if ccr else None,
            "ccr_max_abs_error_pct": float(np.max(np.abs(ccr))) if ccr else None,
            "probe_ms_min": min(probes), "probe_ms_max": max(probes),
            "adjusted": _accuracy(sub, "adjusted_error_pct", lambda r: r["adjusted"]),
            "best": _accuracy(sub, "best_error_pct", lambda r: r["best"])}
    return out


def _race_summary(sub: list[dict]) -> dict:
    got = [r["race_regret"] for r in sub if r.get("race_regret")]
    held = [g["heldout_regret_pct"] for g in got if g["heldout_regret_pct"] is not None]
    if not got:
        return {}
    return {"race_regret_pct_max": max(g["regret_pct"] for g in got),
            "race_regret_pct_mean": float(np.mean([g["regret_pct"] for g in got])),
            "heldout_regret_pct_max": max(held) if held else None,
            "heldout_regret_pct_mean": float(np.mean(held)) if held else None}


def _accuracy(sub: list[dict], err_key: str, rank_of) -> dict:
    errs = np.abs([row[err_key] for r in sub for row in r["rows"]])
    c, d = sum(rank_of(r)["concordant"] for r in sub), sum(rank_of(r)["discordant"] for r in sub)
    return {"pairs_run": int(len(errs)), "mape_pct": float(errs.mean()), "max_abs_error_pct": float(errs.max()),
            "kendall_tau": (c - d) / (c + d) if c + d else None, "tau_pairs": c + d,
            "regret_pct_max": max(rank_of(r)["regret_pct"] for r in sub),
            "regret_pct_mean": float(np.mean([rank_of(r)["regret_pct"] for r in sub])),
            "regret_2sigma_pct_max": max(rank_of(r)["regret_2sigma_pct"] for r in sub),
            "regret_2sigma_pct_mean": float(np.mean([rank_of(r)["regret_2sigma_pct"] for r in sub]))}
