"""Contention or a wrong model: the verdict from a rank's compute time alone, simulated, measured wall and CPU."""

from __future__ import annotations

import pytest

from meshplan.truth.contention import diagnose


def test_waiting_the_model_did_not_expect_is_contention():
    """Issue 26's case: the same CPU time in a fast and a slow run, the slow one's threads waiting for a
    core — the kernels are as predicted (kernel error 0), 45 of 100 ms wall were unexpected waiting."""
    d = diagnose(pred_alone_s=0.050, pred_wall_s=0.055, meas_wall_s=0.100, meas_cpu_s=0.050)
    assert d["verdict"] == "contention"
    assert d["kernel_error_pct"] == pytest.approx(0.0)
    assert d["waited_s"] == pytest.approx(0.050) and d["expected_wait_s"] == pytest.approx(0.005)
    assert d["unexpected_wait_share"] == pytest.approx(0.45)


def test_kernels_off_the_prediction_on_a_quiet_host_is_the_compute_model():
    d = diagnose(pred_alone_s=0.030, pred_wall_s=0.030, meas_wall_s=0.052, meas_cpu_s=0.050)
    assert d["verdict"] == "compute model" and d["kernel_error_pct"] == pytest.approx(-40.0)


def test_waiting_the_model_expected_is_not_contention():
    """Four ranks on two cores: the model's pool already stretches the kernels; that waiting is no surprise."""
    d = diagnose(pred_alone_s=0.050, pred_wall_s=0.100, meas_wall_s=0.104, meas_cpu_s=0.052)
    assert d["verdict"] == "consistent"
    assert d["unexpected_wait_share"] == pytest.approx((0.052 - 0.050) / 0.104)


def test_a_busy_host_and_kernels_off_the_model_are_both_said():
    """Waiting beyond the model's and a kernel CPU time 60% off it (a calibration that does not fit this host): the
    CPU time does not wait for a core, so the model is off too — not "the host was busy, the model is fine"."""
    d = diagnose(pred_alone_s=0.020, pred_wall_s=0.020, meas_wall_s=0.100, meas_cpu_s=0.050)
    assert d["verdict"] == "contention and compute model" and d["kernel_error_pct"] == pytest.approx(-60.0)
