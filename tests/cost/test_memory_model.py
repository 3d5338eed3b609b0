"""The memory model: per-op workspace (closed forms), its place in the peak, the fit, the calibration file,
search --memory-limit, and predicted against measured peak memory on CPU runs."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import unit_topology, unit_workload
from typer.testing import CliRunner

from meshplan.cli.app import app
from meshplan.cost.memory import kernel_workspace_bytes, op_workspace_bytes
from meshplan.model.memory_spec import MemorySpec, OpCoefficients
from meshplan.model.topology import Topology
from meshplan.model.workload import resolve
from meshplan.plan.peaks import peak_memory
from meshplan.plan.schedule import COMPUTE, KIND, RECV, SEND
from meshplan.search import run_search
from meshplan.search.candidate import predict
from meshplan.truth.memory_fit import fit_memory

ROOT = Path(__file__).resolve().parents[2]
# the band the CPU runs are held to. Under-prediction is the dangerous side (a plan passes a memory limit it
# breaks): at most 15% or the model's own stated tolerance (memory.tolerance_pct, the largest error of its fit on
# the calibration's samples), whichever is wider. Over, the model is conservative and one run's rise varies:
# the 2-rank bf16 Ring measured 208-251 MB against 328 MB predicted on an AVX2 host (+31 .. +58%), 175-196 MB
# against 302 MB on an AVX512-BF16 host (+54 .. +73%; pass-Q and Ulysses -17% .. -22% there, tolerance 34.5%):
# at most twice the measured. And the model must beat the buffers alone on average over the runs.
UNDER_PCT, OVER_PCT = -15.0, 100.0


def _spec(**kw) -> MemorySpec:
    c = OpCoefficients(fwd_q_bytes_per_elem=2.0, fwd_kv_bytes_per_elem=3.0, bwd_q_bytes_per_elem=7.0,
                       bwd_kv_bytes_per_elem=11.0, fixed_bytes=5.0)
    return MemorySpec(source="test", compute={"bf16": c}, merge_bytes_per_byte=kw.get("merge", 0.25),
                      transfer_bytes_per_byte=kw.get("transfer", 0.5), runtime_bytes=kw.get("runtime", 0.0))


def test_workspace_of_each_op_kind_by_hand():
    """Unit ring on 2 ranks (B = H = D = 1, 4-token chunks, KV chunk 16 B): a forward block is 5 + 2·4 + 3·4 = 25 B,
    a backward block 5 + 7·4 + 11·4 = 77 B, a send or recv of a KV chunk 0.5 · 16 = 8 B."""
    topo = unit_topology(2)
    sched = predict("ring", unit_workload(2, passes="fwd+bwd"), topo, 2, {}).schedule
    ws, o = op_workspace_bytes(sched, _spec()), sched.ops
    blocks = (o.kind == COMPUTE) & (o.flops > 0)
    assert set(ws[blocks & (o.phase == 0)]) == {25.0} and set(ws[blocks & (o.phase == 1)]) == {77.0}
    comm = (o.kind == SEND) | (o.kind == RECV)
    assert np.array_equal(ws[comm], 0.5 * o.size_bytes[comm]) and 8.0 in set(ws[comm & (o.phase == 0)])
    side = (o.kind == KIND["merge"]) | (o.kind == KIND["accumulate"])
    assert np.array_equal(ws[side], 0.25 * o.size_bytes[side])
    assert kernel_workspace_bytes(_spec(), "fp16", "bwd", 1, 1, 1, 4, 4) == 77.0     # fp16 takes bf16's


def test_workspace_counts_only_while_its_op_runs():
    """A huge workspace on one op lifts only its rank's peak, to the buffers live then plus it; serial ops with a
    workspace each never hold two at once."""
    topo = unit_topology(2)
    sched = predict("ring", unit_workload(2), topo, 2, {}).schedule
    o, n = sched.ops, len(sched.ops)
    start, end = np.arange(n, dtype=float), np.arange(n, dtype=float) + 0.5        # one op at a time
    base = peak_memory(sched, 0, start, end)
    big = 1e12
    one = np.zeros(n)
    k = int(np.flatnonzero((o.kind == COMPUTE) & (o.rank == 1))[0])
    one[k] = big
    lifted = peak_memory(sched, 0, start, end, one)
    assert lifted[0] == base[0] and 0 < lifted[1] - big <= base[1]
    every = peak_memory(sched, 0, start, end, np.full(n, 3.0))
    assert np.all(every <= base + 3.0) and np.all(every > base)


def test_fit_recovers_synthetic_coefficients():
    """Samples made with known coefficients (square and rectangular kernels, both passes) give them back."""
    true = dict(fq=13.0, fkv=9.0, bq=27.0, bkv=21.0, fixed=2e5)
    samples = []
    for p, cq, ckv in (("fwd", true["fq"], true["fkv"]), ("bwd", true["bq"], true["bkv"])):
        for s_q, s_kv in ((256, 256), (512, 256), (256, 512), (1024, 1024), (2048, 1024)):
            e = 1 * 4 * 64
            samples.append({"kind": "compute", "dtype": "bf16", "pass": p, "s_q": s_q, "s_kv": s_kv, "batch": 1,
                            "heads": 4, "head_dim": 64, "rise_bytes": true["fixed"] + e * (cq * s_q + ckv * s_kv)})
    samples += [{"kind": "merge", "size_bytes": 1000, "rise_bytes": 3500},
                {"kind": "transfer", "size_bytes": 4096, "rise_bytes": 4096}]
    spec = fit_memory(samples)
    c = spec.compute["bf16"]
    assert (c.fwd_q_bytes_per_elem, c.fwd_kv_bytes_per_elem, c.bwd_q_bytes_per_elem, c.bwd_kv_bytes_per_elem) == \
        pytest.approx((13.0, 9.0, 27.0, 21.0), rel=1e-3)
    assert c.fixed_bytes == pytest.approx(2e5, rel=1e-3) and spec.tolerance_pct < 0.1
    assert spec.merge_bytes_per_byte == 3.5 and spec.transfer_bytes_per_byte == 1.0
    with pytest.raises(ValueError, match="no compute-op memory samples"):
        fit_memory(samples[-2:])


def test_shipped_calibration_holds_the_fit_of_its_own_samples():
    topo = Topology.load("cpu-local", 2)
    calib = topo.calibration
    assert calib.memory is not None and topo.memory_model is calib.memory
    assert fit_memory([m.model_dump(by_alias=True) for m in calib.raw.memory]) == calib.memory
    assert Topology.load("h100x8").memory_model.source.startswith("uncalibrated default: FlashAttention-2")


def test_memory_limit_filters_on_the_model_not_the_buffers():
    """At 1M tokens on 8 H100s Ulysses' buffers (9.0 GB) would fit 12 GB, but with FlashAttention-2's workspace it
    needs 14.4 GB, the least of any plan: 12 GB is refused naming it; under 16 GB every simulated pick fits by its
    simulated total."""
    from meshplan.core.errors import UserError

    topo, w = Topology.load("h100x8"), resolve(seq_len="1M")
    free = run_search(w, topo, 8)
    uly = next(c for c in free.candidates if c.algorithm == "ulysses" and c.model_level == "simulated")
    assert uly.predicted.total.peak_memory_bytes < 12e9 < uly.predicted.total.peak_memory_total_bytes < 16e9
    with pytest.raises(UserError, match=r"no plan fits in 12 GB per GPU; the smallest needs 14.4 GB \(ulysses"):
        run_search(w, topo, 8, memory_limit=12e9)
    limited = run_search(w, topo, 8, memory_limit=16e9)
    assert limited.rejected and limited.candidates[0].algorithm == "ulysses"
    assert all(c.predicted.total.peak_memory_total_bytes <= 16e9 for c in limited.candidates
               if c.model_level == "simulated")


def test_plans_are_held_to_the_device_memory_and_written_files_to_the_limit(tmp_path):
    """Without --memory-limit the device's 80 GB holds (12M tokens on 8 H100s fits no plan: refused naming the
    smallest); with one, every written file simulates within it and so does each framework's best setting."""
    from meshplan.core.errors import UserError
    from meshplan.cost.metrics import predicted
    from meshplan.cost.simulate import simulate
    from meshplan.plan.json.io import read_schedule
    from meshplan.search.frameworks import framework_bests
    from meshplan.search.write import write_best

    topo = Topology.load("h100x8")
    with pytest.raises(UserError, match=r"^--gpus: no plan fits in the device's 80 GB; the smallest needs 1\d\d GB"):
        run_search(resolve(seq_len="12M"), topo, 8)
    result = run_search(resolve(seq_len="1M"), topo, 8, memory_limit=16e9)
    write_best(result, 4, str(tmp_path))
    files = sorted(tmp_path.iterdir())
    assert files
    for f in files:
        sched = read_schedule(str(f))
        assert predicted(sched, topo, simulate(sched, topo), None).total.peak_memory_total_bytes <= 16e9, f.name
    refused = [why for fb in framework_bests(result) for _, why in fb.refused]
    assert any(why.endswith("by the memory model, more than 16 GB") for why in refused)   # torchtitan's Ring


@pytest.mark.heavy
def test_calibrate_memory_only_updates_the_memory_model_and_keeps_the_rest(tmp_path):
    import yaml
    src = ROOT / "meshplan" / "topologies" / "calibration" / "cpu-local.yaml"
    out = tmp_path / "cpu-local.yaml"
    pytest.importorskip("torch")
    from meshplan.core.host import cpu_name
    from meshplan.executor.host import cpu_isa
    raw = yaml.safe_load(src.read_text())
    raw["device"] |= {"cpu": cpu_name(), "isa": cpu_isa()}      # as if this host had been calibrated
    out.write_text(yaml.safe_dump(raw, sort_keys=False))
    before = yaml.safe_load(out.read_text())
    r = CliRunner().invoke(app, ["calibrate", "--memory-only", "--quick", "--out", str(out), "--json"])
    assert r.exit_code == 0, r.output
    after = yaml.safe_load(out.read_text())
    assert {k: v for k, v in after.items() if k not in ("memory", "raw")} == \
        {k: v for k, v in before.items() if k not in ("memory", "raw")}
    assert after["raw"]["memory"] != before["raw"]["memory"] and after["memory"]["compute"]["bf16"]
    missing = CliRunner().invoke(app, ["calibrate", "--memory-only", "--out", str(tmp_path / "none.yaml")])
    assert missing.exit_code == 2 and "run meshplan calibrate without --memory-only first" in missing.output
    both = CliRunner().invoke(app, ["calibrate", "--memory-only", "--from-nccl-tests", "x", "--out", str(out)])
    assert both.exit_code == 2 and "cannot be combined with --from-nccl-tests" in both.output
    folder = CliRunner().invoke(app, ["calibrate", "--memory-only", "--out", str(tmp_path)])
    assert folder.exit_code == 2 and "is not a file" in folder.output
    out.write_text(out.read_text().replace(f"cpu: {before['device']['cpu']}", "cpu: Another CPU"))
    other = CliRunner().invoke(app, ["calibrate", "--memory-only", "--out", str(out)])
    assert other.exit_code == 2 and "was measured on Another CPU" in other.output and "calibrate afresh" in other.output


@pytest.mark.heavy
@pytest.mark.timeout(600)
def test_predicted_peak_memory_within_tolerance_on_cpu_runs(tmp_path):
    """Ring (bf16), pass-Q (GQA, bf16) and Ulysses (fp32) on 2 gloo ranks: the model's peak within -15% (or the
    calibration's stated tolerance) .. +100% of each run's measured memory (its largest pass), and closer to it
    on average than the buffers alone; skipped when the calibration is another host's."""
    pytest.importorskip("torch")
    from meshplan.core.host import cpu_name
    from meshplan.executor.host import cpu_isa

    calib = Topology.load("cpu-local").calibration
    if (calib.device.cpu, calib.device.isa) != (cpu_name(), cpu_isa()):
        pytest.skip(f"cpu-local's calibration was measured on {calib.device.cpu} ({calib.device.isa}), this host is "
                    f"{cpu_name()} ({cpu_isa()}): its memory model says nothing about this host's runs")
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from memory_cpu import QUICK, measure

    under = -max(-UNDER_PCT, calib.memory.tolerance_pct or 0.0)
    rows = measure(QUICK, tmp_path)
    assert len(rows) == 3
    for r in rows:
        assert under <= r["error_pct"] <= OVER_PCT, r
    model = np.mean([abs(r["predicted_bytes"] / r["measured_bytes"] - 1) for r in rows])
    buffers = np.mean([abs(r["buffers_bytes"] / r["measured_bytes"] - 1) for r in rows])
    assert model < buffers, (model, buffers, rows)
