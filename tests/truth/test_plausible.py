"""Implausible measurements are flagged (issue 22, part 3): a pass implying more FLOP/s than the device's peak, or
more bytes per second over a link than it carries, is named on one line by ``compare`` (exit 1, ``implausible`` in
``--json``); an honest measurement is not. No torch: measurements are the simulator's times, scaled."""

from __future__ import annotations

import json

import numpy as np
import pytest
from helpers import fake_measurement, run

from meshplan.model.topology import Topology
from meshplan.plan.json.io import read_schedule
from meshplan.truth.compare import compare_files, read_measurement
from meshplan.truth.plausible import DATASHEET_HEADROOM, MEASURED_HEADROOM, ceilings, implausible


@pytest.fixture(scope="module")
def h100(tmp_path_factory):
    path = tmp_path_factory.mktemp("plaus") / "ring16.json"
    r = run("simulate", "--algo", "ring", "--gpus", 16, "--topo", "h100x16", "--seq-len", "256K", "--out", path)
    assert r.exit_code == 0, r.stderr
    return path


def test_an_honest_measurement_is_plausible(h100, tmp_path):
    m = fake_measurement(h100, tmp_path / "m.json", scale=1.0)       # exactly what the model predicts
    r = run("compare", h100, m, "--json")
    assert r.exit_code == 0, r.stderr
    assert json.loads(r.stdout)["implausible"] == [] and "implausible" not in r.stderr


def test_times_scaled_down_are_flagged_per_pass(h100, tmp_path):
    honest = compare_files(str(h100), str(fake_measurement(h100, tmp_path / "m.json", scale=1.0)))
    assert honest["implausible"] == []
    m = fake_measurement(h100, tmp_path / "fast.json", scale=0.3)
    r = run("compare", h100, m, "--json")
    assert r.exit_code == 1
    reasons = json.loads(r.stdout)["implausible"]
    assert [x.split(":")[0] for x in reasons if "TFLOP/s" in x] == ["fwd", "bwd"]
    lines = r.stderr.strip().splitlines()
    assert all(line.startswith("implausible: ") for line in lines) and len(lines) == len(reasons)
    assert "the device's bf16 peak, 989 TFLOP/s" in reasons[0]
    human = run("compare", h100, m)
    assert human.exit_code == 1 and "implausible: fwd:" in human.stderr


def test_the_compute_bound_is_the_peak_with_timer_headroom(h100, tmp_path):
    """Flagged exactly when the busiest rank's FLOPs over the pass makespan pass 1.05 x the peak."""
    sched = read_schedule(h100)
    topo = Topology.load("h100x16", 16)
    meas = read_measurement(fake_measurement(h100, tmp_path / "m.json", scale=1.0))
    flops, link, _ = ceilings(topo, meas, "bf16", False, None)
    assert flops == pytest.approx(989e12 * DATASHEET_HEADROOM) and link == DATASHEET_HEADROOM
    o = sched.ops
    fwd = (o.phase == 0) & (o.kind == 0)
    rate = np.bincount(o.rank[fwd], weights=o.flops[fwd]).max() / meas.passes["fwd"].makespan_s
    for scale, flagged in ((rate / flops * 1.01, False), (rate / flops * 0.99, True)):
        m = read_measurement(fake_measurement(h100, tmp_path / "s.json", scale=scale))
        assert any(x.startswith("fwd:") and "TFLOP/s" in x for x in implausible(sched, topo, m, (flops, link, ""))) \
            is flagged


def test_a_link_carrying_more_than_its_capacity_is_flagged(h100, tmp_path):
    sched = read_schedule(h100)
    topo = Topology.load("h100x16", 16)
    no_compute_bound = (float("inf"), 1.0, "")
    meas = read_measurement(fake_measurement(h100, tmp_path / "m.json", scale=1.0))
    assert implausible(sched, topo, meas, no_compute_bound) == []
    meas = read_measurement(fake_measurement(h100, tmp_path / "f.json", scale=1e-3))
    links = implausible(sched, topo, meas, no_compute_bound)
    assert links and all("GB/s over" in x and "which carries" in x for x in links)


def test_cpu_ceilings_take_the_runs_own_kernel_and_threads():
    topo = Topology.load("cpu-local", 2)
    peak = topo.peak_flops("bf16")

    class M:
        env = {"backend": "gloo", "threads_per_rank": 2, "kernel_flops_per_s": 10 * peak}
    flops, link, how = ceilings(topo, M, "bf16", True, 0.5)
    assert flops == pytest.approx(10 * peak * MEASURED_HEADROOM) and "this run's own bf16 kernel" in how
    assert link == pytest.approx(2.0 * MEASURED_HEADROOM * 2.0)        # twice as fast now, another host's capacity
    M.env = {"backend": "gloo"}
    assert ceilings(topo, M, "bf16", False, None)[:2] == (pytest.approx(peak * MEASURED_HEADROOM), MEASURED_HEADROOM)
