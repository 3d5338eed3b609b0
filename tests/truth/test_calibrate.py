"""Calibration files: the fit from raw measurements, the YAML round trip, a topology taking a calibration's
values, one-line refusals, and ``meshplan calibrate --quick`` end to end."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import yaml
from typer.testing import CliRunner

from meshplan.cli.app import app
from meshplan.core.errors import UserError
from meshplan.model.calibration_file import (
    CalibrationSpec,
    HostFacts,
    Raw,
    dump_yaml,
    load_calibration,
)
from meshplan.model.topology import Topology
from meshplan.truth.calibration_fit import fit_calibration

MODEL = "CPU rank (torch CPU attention, 1 thread)"       # cpu-local's device.model
TOKENS = [64, 128, 256]
PEAK_BF16, PEAK_FP32, LAUNCH = 2e11, 5e10, 10e-6
ALPHA, BW, SHARED, KAPPA, POOL = 80e-6, 4e9, 5e9, 0.2, 1.5
TRANSFER_CPU = 8e-10                  # core-seconds per byte moved (800 core-us per MB)


def _e(a, b, p):
    return (0.2 if p == "fwd" else 0.3) * a / (a + 100) * b / (b + 100)


CAUSAL = {64: 0.3, 128: 0.5, 256: 0.8}          # causal-piece efficiency over full, by size
HEAD_DIM = {32: (0.8, 0.7), 64: (1.0, 1.0), 128: (1.2, 1.25)}   # (fwd, bwd) multipliers by head dim


def synthetic_raw() -> Raw:
    """Measurements generated from the known parameters above (merges at 6 GB/s)."""
    kernels = []
    for a, b, causal in [(a, b, False) for a in TOKENS for b in TOKENS] + [(s, s, True) for s in TOKENS]:
        pairs = a * (a + 1) // 2 if causal else a * b
        for p, mult in (("fwd", 1.0), ("bwd", 2.5)):
            flops = mult * 4.0 * 4 * 64 * pairs
            e = _e(a, b, p) * (CAUSAL[a] if causal else 1.0)
            kernels.append({"pass": p, "s_q": a, "s_kv": b, "causal": causal, "batch": 1, "heads": 4, "head_dim": 64,
                            "flops": flops, "time_s": LAUNCH + flops / (PEAK_BF16 * e)})
    head_dim = []
    for d, (f_fwd, f_bwd) in HEAD_DIM.items():
        for s_ in (64, 256):
            for p, mult, f in (("fwd", 1.0, f_fwd), ("bwd", 2.5, f_bwd)):
                flops = mult * 4.0 * 4 * d * s_ * s_
                head_dim.append((p, d, s_, flops, LAUNCH + flops / (PEAK_BF16 * _e(s_, s_, p) * f)))
    sizes = [1 << k for k in range(10, 27, 2)]
    p2p = [{"size_bytes": s, "flows": 1, "time_s": ALPHA + s / BW} for s in sizes]
    p2p += [{"size_bytes": s, "flows": 2, "time_s": ALPHA + 2 * s / SHARED} for s in sizes]
    overlap = [{"rank": r, "alone_s": 0.05, "with_s": 0.05 + KAPPA * o, "overlap_s": o}
               for r, o in ((0, 0.05), (1, 0.06))]
    # sharing: a row per rank; one of the 3 ran alone (the OS lets some finish early): the fit takes the slowest
    sharing = [(k, 0.01 * max(1.0, k / POOL)) for k in (1, 2, 3, 4)] + [(3, 0.01)]
    # CPU of the exchanges: per byte, plus 50 us per message (only messages >= 1 MiB enter the fit)
    transfer_cpu = [(s, 20, 20 * (2 * s * TRANSFER_CPU + 50e-6)) for s in sizes if s >= 1 << 20]
    transfer_cpu += [(s, 200, 200 * 2 * 50e-6) for s in sizes if s < 1 << 20]
    return Raw.model_validate({
        "gemm": [("bf16", 1000, 2e9 / PEAK_BF16), ("fp32", 1000, 2e9 / PEAK_FP32)], "launch_s": [LAUNCH] * 3,
        "kernels": kernels, "merges": [(b, b / 6e9) for b in (1e6, 4e6, 16e6)], "link_class": "loopback",
        "p2p": p2p, "overlap": overlap, "sharing": sharing, "head_dim_kernels": head_dim, "transfer_cpu": transfer_cpu})


def facts(model: str = MODEL) -> HostFacts:
    return HostFacts(model=model, cpu="test CPU", cores=2, torch="0", backend="gloo", threads_per_rank=1)


@pytest.fixture
def calib() -> CalibrationSpec:
    return fit_calibration(synthetic_raw(), facts(), "cpu-local")


def test_fit_recovers_the_generating_parameters(calib):
    rel = 1e-3                                          # the file keeps 4 significant digits
    assert calib.peak_bf16_tflops == pytest.approx(PEAK_BF16 / 1e12, rel=rel)
    assert calib.peak_fp32_tflops == pytest.approx(PEAK_FP32 / 1e12, rel=rel)
    assert calib.hbm_GBps == pytest.approx(6.0 / 0.8, rel=rel)
    k = calib.kernel
    assert k.launch_us == pytest.approx(LAUNCH * 1e6, rel=rel) and k.tokens == TOKENS
    assert k.fwd[1][2] == pytest.approx(_e(128, 256, "fwd"), rel=rel)
    assert k.bwd[0][0] == pytest.approx(_e(64, 64, "bwd"), rel=rel)
    assert k.elementwise == pytest.approx([CAUSAL[t] for t in TOKENS], rel=rel)
    assert k.head_dims == list(HEAD_DIM)
    assert k.head_dim_fwd == pytest.approx([f for f, _ in HEAD_DIM.values()], rel=rel)
    assert k.head_dim_bwd == pytest.approx([b for _, b in HEAD_DIM.values()], rel=rel)
    assert calib.links["loopback"].usable_GBps == pytest.approx(BW / 1e9, rel=rel)
    assert calib.p2p_overhead_us == pytest.approx(ALPHA * 1e6, rel=rel)
    assert calib.shared_GBps == pytest.approx(SHARED / 1e9, rel=rel)
    assert calib.overlap_kappa["loopback"] == pytest.approx(KAPPA, rel=rel)
    assert calib.compute_pool.capacity_ranks == pytest.approx(POOL, abs=2e-3)
    # the median over >= 1 MiB messages: 2·s·c + 50 us per exchange, so within 50e-6 / (2 · 1 MiB · c) = 3%
    assert calib.transfer_cpu_us_per_MB["loopback"] == pytest.approx(TRANSFER_CPU * 1e12, rel=0.03)
    assert k.stage_inputs                   # timed on the executor, whose ops copy their inputs before the kernels


def test_dtype_multipliers_by_head_dim_and_size_recovered(tmp_path):
    """A sweep of s × s kernels in another dtype at two head dims (fp32 against the tables' bf16, whose matmul
    peak is 0.25 of bf16's here), two rounds each, gives a multiplier per pass, head dim and size: the median
    measured speed ratio over the peak ratio; the kernel table interpolates it by √(s_q·s_kv) and log2 D, holds
    the edges, takes each row's running max as the envelope, and leaves the tables' own dtype alone."""
    from meshplan.model.kernel_tables import KernelTable

    m = {("fwd", 64): [0.8, 1.0, 1.2], ("bwd", 64): [0.5, 1.0, 1.5],
         ("fwd", 128): [1.0, 1.1, 1.2], ("bwd", 128): [1.0, 1.25, 1.5]}
    t_ref = {64: 1e-3, 128: 3e-3, 256: 9e-3}
    noise = (0.9, 1.1, 1.0)        # a round's host speed scales both times: the paired ratio keeps the multiplier
    sweep = [("fp32", p, d, s, x * t_ref[s] / (0.25 * m[(p, d)][i]), x * t_ref[s])
             for (p, d) in m for i, s in enumerate(TOKENS) for x in noise]
    calib = fit_calibration(synthetic_raw().model_copy(update={"dtype_sweep": sweep}), facts(), "cpu-local")
    k = calib.kernel
    assert k.dtype_tokens == TOKENS and k.dtype_head_dims == [64, 128]
    assert k.dtype_fwd["fp32"] == [pytest.approx(m[("fwd", d)], rel=1e-3) for d in (64, 128)]
    assert k.dtype_bwd["fp32"] == [pytest.approx(m[("bwd", d)], rel=1e-3) for d in (64, 128)]
    table = KernelTable(k)
    f = table.dtype_factor
    assert f("fp32", "bwd", 64, 256, head_dim=64) == pytest.approx(1.0, rel=1e-3)      # √(64·256) = 128
    assert f("fp32", "fwd", 32, 32, head_dim=64) == pytest.approx(0.8, rel=1e-3)       # the size edge holds
    assert f("fp32", "bwd", 64, 64, head_dim=90.50967) == pytest.approx(0.75, rel=1e-3)   # halfway in log2 D
    assert f("fp32", "bwd", 64, 64, head_dim=512) == pytest.approx(1.0, rel=1e-3)      # the head-dim edge holds
    assert f("fp32", "bwd", 64, 64) == pytest.approx(0.5, rel=1e-3)                   # no head dim: the first row
    assert f("bf16", "fwd", 64, 64, head_dim=64) == 1.0
    base = table.efficiency(128, 128, "bwd", False, head_dim=128)
    assert table.efficiency(128, 128, "bwd", False, head_dim=128, dtype="fp32") == pytest.approx(base * 1.25, rel=1e-3)
    low = KernelTable(k.model_copy(update={"dtype_bwd": {"fp32": [[1.5, 1.0, 0.5], [1.0, 1.0, 1.0]]}}))
    assert low.dtype_factor("fp32", "bwd", 256, 256, envelope=True, head_dim=64) == pytest.approx(1.5)  # envelope
    with pytest.raises(ValueError, match="together"):
        type(k).model_validate(k.model_dump() | {"dtype_bwd": None})
    with pytest.raises(ValueError, match="one per dtype_head_dims"):
        type(k).model_validate(k.model_dump() | {"dtype_head_dims": [64]})
    from meshplan.cost.cost import CostModel

    topo = Topology.load(str(_calibrated_topology(tmp_path, calib)), gpus=2)    # the cost model prices with it
    cost, flops = CostModel(topo), 1e9
    t = {dt: float(cost.block_time_s(flops, 256, 256, False, "bwd", dt, head_dim=64)) - topo.kernel.launch_s
         for dt in ("bf16", "fp32")}
    assert t["fp32"] / t["bf16"] == pytest.approx(topo.peak_flops("bf16") / (topo.peak_flops("fp32") * 1.5), rel=1e-3)


def test_backward_from_d_factor_by_dtype(tmp_path):
    """The D-carrying backward's factor in the tables' dtype (``recurrence``) and per other dtype
    (``dtype_recurrence``, the median ratio; at least 1): the cost model stretches exactly the backward blocks
    whose query side carries D (pass-Q's) by the workload dtype's factor, and nothing else."""
    from meshplan.cost.cost import CostModel
    from meshplan.model.kernel_tables import KernelTable
    from meshplan.model.workload import resolve
    from meshplan.search.candidate import predict

    raw = synthetic_raw().model_copy(update={
        "recurrence": [(128, 1.05e-3, 1e-3), (256, 4.2e-3, 4e-3)],
        "dtype_recurrence": [("fp32", 128, 1.6e-3, 1e-3), ("fp32", 256, 6.4e-3, 4e-3), ("fp16", 128, 0.9e-3, 1e-3)]})
    calib = fit_calibration(raw, facts(), "cpu-local")
    k = calib.kernel
    assert k.bwd_delta_factor == pytest.approx(1.05) and k.bwd_delta_dtype == {"fp16": 1.0, "fp32": 1.6}
    table = KernelTable(k)
    assert (table.bwd_delta("fp32"), table.bwd_delta("bf16"), table.bwd_delta(None)) == (1.6, 1.05, 1.05)
    w = resolve(seq_len=1024, heads=4, kv_heads=4, head_dim=64, mask="causal", dtype="fp32", passes="fwd+bwd")

    def durations(update: dict, sub: str):
        topo = Topology.load(str(_calibrated_topology(
            tmp_path / sub, calib.model_copy(update={"kernel": k.model_copy(update=update)}))), gpus=2)
        sched = predict("pass-q", w, topo, 2, {}).schedule
        return CostModel(topo).op_durations(sched), CostModel._bwd_without_out(sched)

    (tmp_path / "a").mkdir(), (tmp_path / "b").mkdir(), (tmp_path / "c").mkdir()
    none, carrying = durations({"bwd_delta_factor": 1.0, "bwd_delta_dtype": None}, "a")
    fp32_only, _ = durations({"bwd_delta_dtype": None}, "b")
    by_dtype, _ = durations({}, "c")
    assert len(carrying) > 0
    others = np.setdiff1d(np.arange(len(none)), carrying)
    kernel = (fp32_only - none)[carrying] / 0.05                       # the stretched part: the kernel time
    assert np.all(kernel > 0)
    assert (by_dtype - none)[carrying] == pytest.approx(0.6 * kernel)  # 1.6x fp32's kernels, merges untouched
    assert by_dtype[others] == pytest.approx(none[others])


def test_yaml_round_trip(tmp_path, calib):
    path = tmp_path / "c.yaml"
    path.write_text(dump_yaml(calib))
    back = load_calibration(path)
    assert back == calib
    again = fit_calibration(back.raw, back.device, back.name, back.wall_s, back.measured_at)   # re-fit from raw
    assert again == calib


def _calibrated_topology(tmp_path: Path, calib: CalibrationSpec, extra: str = "") -> Path:
    (tmp_path / "cal").mkdir(exist_ok=True)
    (tmp_path / "cal" / "c.yaml").write_text(dump_yaml(calib) + extra)
    text = Path(Topology.load("cpu-local").source).read_text()
    text = "\n".join(line for line in text.splitlines() if not line.startswith("calibration:"))
    topo = tmp_path / "t.yaml"
    topo.write_text(text + "\ncalibration: cal/c.yaml\n")
    return topo


def test_topology_takes_the_calibrations_values(tmp_path, calib):
    topo = Topology.load(str(_calibrated_topology(tmp_path, calib)), gpus=2)
    assert topo.calibration == calib
    lat, bw = topo.pair_stats(0, 1)
    assert bw == pytest.approx(BW)                                  # min(link 4 GB/s, shared 5 GB/s)
    assert lat == pytest.approx(ALPHA, rel=1e-3)                    # p2p_overhead_us + 2 hops of 0 us
    assert topo.link_capacity.max() == pytest.approx(SHARED)
    assert topo.kernel.efficiency(128, 256, "fwd", False) == pytest.approx(calib.kernel.fwd[1][2])
    assert topo.kernel.launch_s == pytest.approx(LAUNCH, rel=1e-3)
    assert topo.peak_flops("bf16") == pytest.approx(PEAK_BF16, rel=1e-3)
    assert topo.kappa()[0] == pytest.approx(KAPPA, rel=1e-3)        # loopback is LINK_CLASSES[0]
    assert topo.pool_capacity == pytest.approx(POOL, abs=2e-3)
    assert topo.transfer_cpu_s_per_byte()[0] == pytest.approx(calib.transfer_cpu_us_per_MB["loopback"] * 1e-12)
    assert topo.file_spec.p2p_overhead_us != topo.spec.p2p_overhead_us
    plain = Topology(topo.file_spec.model_copy(update={"calibration": None}), gpus=2)
    assert plain.content_hash != topo.content_hash


def test_shipped_cpu_local_is_calibrated():
    topo = Topology.load("cpu-local")
    c = topo.calibration
    assert c is not None and c.device.model == topo.spec.node.device.model
    assert topo.kernel.spec.name == "calibrated" and topo.spec.p2p_overhead_us == c.p2p_overhead_us
    assert fit_calibration(c.raw, c.device, c.name, c.wall_s, c.measured_at) == c     # today's fit of its raw data


def _one_line_error(fn) -> str:
    with pytest.raises(UserError) as err:
        fn()
    msg = str(err.value)
    assert "\n" not in msg
    return msg


def test_calibration_of_another_device_is_refused(tmp_path):
    other = fit_calibration(synthetic_raw(), facts("H100 SXM"), "cpu-local")
    path = _calibrated_topology(tmp_path, other)
    msg = _one_line_error(lambda: Topology.load(str(path)))
    assert msg.startswith("calibration:") and "H100 SXM" in msg and MODEL in msg


@pytest.mark.parametrize("edit,field", [
    (lambda d: d.update(shared_GBps=-1), "shared_GBps"),
    (lambda d: d.update(colour="blue"), "colour"),
    (lambda d: d["kernel"].pop("tokens"), "kernel.tokens"),
    (lambda d: d["overlap_kappa"].update(loopback=1.5), "overlap_kappa.loopback"),
])
def test_malformed_calibration_names_the_field(tmp_path, calib, edit, field):
    body = yaml.safe_load(dump_yaml(calib))
    edit(body)
    path = _calibrated_topology(tmp_path, calib)
    (tmp_path / "cal" / "c.yaml").write_text(yaml.safe_dump(body))
    msg = _one_line_error(lambda: Topology.load(str(path)))
    assert "c.yaml" in msg and field in msg


def test_missing_calibration_file_is_refused(tmp_path, calib):
    path = _calibrated_topology(tmp_path, calib)
    (tmp_path / "cal" / "c.yaml").unlink()
    assert "no calibration file" in _one_line_error(lambda: Topology.load(str(path)))


def _cli(*args):
    return CliRunner().invoke(app, [str(a) for a in args])


def test_cli_refusals_are_one_line(tmp_path, monkeypatch):
    r = _cli("calibrate", "--out", tmp_path / "c.json")
    assert r.exit_code == 2 and "--out" in r.stderr and r.stderr.count("\n") == 1
    r = _cli("calibrate", "--topo", "h100x8", "--backend", "gloo", "--out", tmp_path / "c.yaml")
    assert r.exit_code == 2 and "--topo" in r.stderr and r.stderr.count("\n") == 1
    import importlib.util
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "torch" else real(name, *a))
    r = _cli("calibrate", "--out", tmp_path / "c.yaml")
    assert r.exit_code == 2 and "[exec]" in r.stderr and r.stderr.count("\n") == 1
    assert not (tmp_path / "c.yaml").exists()


def test_refit_fits_the_files_raw_data_again(tmp_path, calib):
    """--refit rewrites a file's fitted values from its raw measurements (here: a hand-edited launch, κ and pool),
    measuring nothing; a missing file and two modes at once are refused in one line."""
    body = yaml.safe_load(dump_yaml(calib))
    body["kernel"]["launch_us"] = 999.0
    body["overlap_kappa"]["loopback"] = 0.9
    body["compute_pool"]["capacity_ranks"] = 7.0
    out = tmp_path / "old.yaml"
    out.write_text(yaml.safe_dump(body))
    r = _cli("calibrate", "--refit", "--out", out, "--json")
    assert r.exit_code == 0, r.stderr
    assert load_calibration(out) == calib and json.loads(r.stdout)["refit"] is True
    for args in (["--refit", "--out", tmp_path / "none.yaml"], ["--refit", "--memory-only", "--out", out]):
        r = _cli("calibrate", *args)
        assert r.exit_code == 2 and r.stderr.count("\n") == 1, r.stderr
    assert "--refit" in r.stderr and "--memory-only" in r.stderr


@pytest.mark.heavy
@pytest.mark.timeout(120)
def test_calibrate_quick_end_to_end(tmp_path):
    out = tmp_path / "cal.yaml"
    r = _cli("calibrate", "--quick", "--out", out, "--json")
    assert r.exit_code == 0, r.stderr
    body = json.loads(r.stdout)
    assert body["calibration"] == str(out) and body["topology"] == "cpu-local"
    calib = load_calibration(out)
    assert calib.device.model == MODEL and calib.device.backend == "gloo"
    numbers = [calib.peak_bf16_tflops, calib.peak_fp32_tflops, calib.hbm_GBps, calib.kernel.launch_us,
               calib.links["loopback"].usable_GBps, calib.shared_GBps, calib.p2p_overhead_us,
               calib.compute_pool.capacity_ranks]
    assert all(x > 0 for x in numbers), numbers
    assert 0 <= calib.overlap_kappa["loopback"] < 1
    assert np.all(np.asarray(calib.kernel.fwd) > 0) and np.all(np.asarray(calib.kernel.bwd) > 0)
    assert {row["name"] for row in body["fitted"]} >= {"p2p_overhead_us", "overlap_kappa.loopback",
                                                       "transfer_cpu_us_per_MB.loopback"}
    from meshplan.executor.calibrate.common import QUICK
    # the exchanges' CPU, both ranks' processes over their timed rounds, per size: a transfer is CPU work here
    assert sorted(s for s, _, _ in calib.raw.transfer_cpu) == sorted(QUICK.p2p_sizes)
    assert all(n > 0 and cpu > 0 for _, n, cpu in calib.raw.transfer_cpu)
    assert calib.transfer_cpu_us_per_MB["loopback"] > 0
    dims = sorted(set(QUICK.head_dims) | {QUICK.head_dim})      # the dtype sweep: one row per round and shape
    assert calib.kernel.dtype_head_dims == dims and calib.kernel.dtype_tokens == sorted(QUICK.dtype_tokens)
    counts = Counter((d, p, hd, s) for d, p, hd, s, _, _ in calib.raw.dtype_sweep)
    assert set(counts.values()) == {QUICK.dtype_rounds}
    assert {(d, hd) for d, _, hd, _ in counts} == {(d, hd) for d in ("bf16", "fp16") for hd in dims}


def test_kernel_table_applies_the_head_dim_and_size_dependent_mask_multipliers(calib):
    from meshplan.model.kernel_tables import KernelTable
    table = KernelTable(calib.kernel)
    base = table.efficiency(128, 128, "fwd", False)
    assert table.efficiency(128, 128, "fwd", False, head_dim=128) == pytest.approx(1.2 * base, rel=1e-3)
    assert table.efficiency(128, 128, "bwd", False, head_dim=32) == pytest.approx(
        0.7 * table.efficiency(128, 128, "bwd", False), rel=1e-3)
    mid = float(np.interp(np.log2(96), [6, 7], [1.0, 1.2]))         # linear in log2 D between 64 and 128
    assert table.efficiency(128, 128, "fwd", False, head_dim=96) == pytest.approx(mid * base, rel=1e-3)
    assert table.efficiency(128, 128, "fwd", False, head_dim=512) == pytest.approx(1.2 * base, rel=1e-3)  # edge
    assert table.efficiency(128, 128, "fwd", True) == pytest.approx(0.5 * base, rel=1e-3)
    assert table.efficiency(64, 256, "fwd", True) == pytest.approx(0.5 * table.efficiency(64, 256, "fwd", False),
                                                                    rel=1e-3)     # √(64·256) = 128


def test_p2p_error_on_the_calibrations_own_transfers(calib):
    """The micro-level transfer error (docs/cost-model.md: <= 8% for messages >= 1 MB): 0 on transfers the model
    generated; one large transfer 10% slower than the model shows as 1 - 1/1.1 = 9.09%."""
    from meshplan.cli.calibrate import p2p_error_pct
    assert p2p_error_pct(calib) == pytest.approx(0.0, abs=0.01)
    raw = synthetic_raw().model_dump(mode="json", by_alias=True)
    big = max(range(len(raw["p2p"])), key=lambda i: (raw["p2p"][i]["flows"] == 1, raw["p2p"][i]["size_bytes"]))
    raw["p2p"][big]["time_s"] *= 1.1
    slow = calib.model_copy(update={"raw": Raw.model_validate(raw)})        # the same fit, one sample off
    assert p2p_error_pct(slow) == pytest.approx(100 * (1 - 1 / 1.1), abs=0.01)


def test_merge_factor_by_dtype_from_the_merge_timings():
    """merge_dtype = the median over sizes of a merge's time in that dtype over its bytes / the merge rate (here a
    bf16 merge taking 3x its bytes' worth, fp16 1.5x): recovered exactly; none measured -> no merge_dtype."""
    raw = synthetic_raw().model_dump(mode="json", by_alias=True)
    rate = 6e9                                               # synthetic_raw's merges
    raw["dtype_merges"] = [[dt, b, f * b / rate] for dt, f in (("bf16", 3.0), ("fp16", 1.5)) for b in (5e5, 2e6)]
    calib = fit_calibration(Raw.model_validate(raw), facts(), "cpu-local")
    assert calib.kernel.merge_dtype == {"bf16": 3.0, "fp16": 1.5}
    from meshplan.cli.calibrate import summary
    from meshplan.model.topology import Topology
    rows = {r["name"]: r["fitted"] for r in summary(calib, Topology.load("cpu-local"))}
    assert rows["kernel merge_dtype, bf16"] == 3.0 and rows["kernel merge_dtype, fp16"] == 1.5
    assert fit_calibration(synthetic_raw(), facts(), "cpu-local").kernel.merge_dtype is None
