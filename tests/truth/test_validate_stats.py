"""benchmarks/validate_stats.py: τ over pairs apart by 2σ, the race's contenders, and the paired regret estimators
against closed forms and against synthetic rounds with a known true regret."""

import sys
from pathlib import Path

import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import validate_stats as vs  # noqa: E402


def _rows(pred, meas, sigma):
    return [{"predicted_s": p, "measured_s": m, "sigma_s": s} for p, m, s in zip(pred, meas, sigma)]


def test_ranking_counts_only_pairs_apart_by_2_sigma():
    # pairs: (0,1) 0.1 apart, 2σ = 0.2 -> skipped; (0,2) and (1,2) 1.0 apart -> counted
    rows = _rows(pred=[1.0, 2.0, 3.0], meas=[1.1, 1.0, 2.0], sigma=[0.1, 0.1, 0.1])
    got = vs.ranking(rows)
    assert (got["pairs"], got["concordant"], got["discordant"]) == (2, 2, 0)
    # the pick (row 0) is 10% slower than the fastest median, but within 2σ of it
    assert got["regret_pct"] == pytest.approx(10.0)
    assert got["regret_2sigma_pct"] == 0.0


def test_contenders_are_the_near_fastest_and_always_the_pick():
    rows = _rows(pred=[5, 1, 2, 3, 4], meas=[1.00, 1.60, 1.05, 1.15, 1.30], sigma=[0.05] * 5)
    # fastest 1.00; within 2σ = 0.1: rows 0 and 2; row 1 (the pick) is 0.6 slower but raced anyway
    assert vs.contenders(rows) == [0, 1, 2]
    assert vs.contenders(rows, limit=1) == [0, 1]


def test_paired_regret_is_exact_when_every_round_has_the_same_ratios():
    rng = np.random.default_rng(1)
    drift = np.exp(rng.normal(0.0, 0.3, size=12))            # the host's speed per round, large
    base = 0.2 * drift
    times = np.stack([1.1 * base, base, 1.2 * base])          # the pick (row 0) is 10% slower than row 1
    got = vs.paired_regret(times, pick=0)
    assert got["regret_pct"] == pytest.approx(10.0, rel=1e-9)
    assert got["heldout_regret_pct"] == pytest.approx(10.0, rel=1e-9)
    assert got["heldout_choice"] == {1: 1.0}
    assert vs.paired_regret(times, pick=1)["regret_pct"] == pytest.approx(0.0, abs=1e-9)


def test_heldout_regret_removes_the_winners_curse():
    # ten identical computations (true regret 0) with 6% noise per run and a drifting host: the plain estimate
    # takes the luckiest of them and is biased upwards; the held-out one is centred on 0
    rng = np.random.default_rng(7)
    drift = np.exp(rng.normal(0.0, 0.2, size=15))
    times = 0.5 * drift[None, :] * np.exp(rng.normal(0.0, 0.06, size=(10, 15)))
    got = vs.paired_regret(times, pick=3)
    assert got["regret_pct"] > 2.0
    assert abs(got["heldout_regret_pct"]) < 1.5
    assert got["heldout_regret_pct"] < got["regret_pct"]


def test_paired_regret_needs_four_rounds_for_the_heldout_estimate_and_positive_times():
    assert vs.paired_regret([[1.0, 1.1, 1.0], [1.2, 1.2, 1.3]], pick=0)["heldout_regret_pct"] is None
    with pytest.raises(ValueError, match="positive"):
        vs.paired_regret([[1.0, 0.0]], pick=0)


def test_race_regret_uses_the_race_when_the_pick_ran_in_it_else_stage_one():
    rows = [{"predicted_s": p, "rounds_s": r} for p, r in
            [(1.0, [1.1, 1.1]), (2.0, [1.0, 1.0]), (3.0, [2.0, 2.0])]]
    race = {"candidates": [0, 1], "rounds_s": [[1.1, 1.1, 1.1], [1.0, 1.0, 1.0]]}
    got = vs.race_regret(rows, race)
    assert got["raced"] and got["rounds"] == 5 and got["regret_pct"] == pytest.approx(10.0)
    assert got["heldout_choice"] == {1: 1.0}
    rows[0]["predicted_s"] = 2.5                  # a changed model picks row 1, which raced too
    assert vs.race_regret(rows, race)["regret_pct"] == pytest.approx(0.0, abs=1e-9)
    rows[2]["predicted_s"] = 0.5                  # ... or row 2, which did not: stage 1's rounds
    got = vs.race_regret(rows, race)
    assert not got["raced"] and got["rounds"] == 2 and got["regret_pct"] == pytest.approx(100.0)
