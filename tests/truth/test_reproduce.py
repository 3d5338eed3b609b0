"""Reproduction of the CHARM+ tables: data loading, the micro fits against closed forms, the shipped
H100 parameters against a fresh fit, and the reported errors (docs/cost-model.md targets)."""

from __future__ import annotations

import json
from importlib import resources

import numpy as np
import pytest
from typer.testing import CliRunner

from meshplan.algorithms import get
from meshplan.cli.app import app
from meshplan.core.errors import UserError
from meshplan.model.topology import Topology
from meshplan.truth.published import H100Row, kv_step_bytes, load_rows, ring_block_flops
from meshplan.truth.reproduce import reproduce_ablation, reproduce_h100
from meshplan.truth.reproduce_fit import DECLARED, FittedParams, fit_kernel, fit_transfer, is_declared, topology_values

runner = CliRunner()


def _row(**kw) -> H100Row:
    base = {"gpus": 16, "pass": "forward", "B": 1, "S": 16 * 1024, "S_per_gpu": 1024, "T_comm_ring_ms": 1.0,
            "T_comp_ring_ms": 1.0, "ring_ms": 1.0, "tasp_ms": "", "charm_ms": 1.0}
    return H100Row.model_validate({**base, **kw})


def test_shipped_table_has_every_row_and_declared_subset():
    rows = load_rows("charm-h100")
    assert len(rows) == 54 and sum(r.pass_name == "fwd" for r in rows) == 27
    assert sum(is_declared(r) for r in rows) == len(DECLARED) == 4
    assert sum(r.tasp_ms is not None for r in rows) == 27


def test_step_bytes_and_flops_closed_forms():
    r = _row(B=2, S_per_gpu=1680)
    assert kv_step_bytes(r) == 2 * 1680 * 2 * 12 * 192 * 2
    assert kv_step_bytes(_row(B=2, S_per_gpu=1680, **{"pass": "backward"})) == 3 * kv_step_bytes(r)
    assert ring_block_flops(r) == 4 * 2 * 12 * 1680 ** 2 * 192


def test_fit_transfer_recovers_synthetic_alpha_and_bandwidth():
    alpha, bw = 50e-6, 30e9
    rows = []
    for b in (1, 2, 4, 8, 32):
        for p in ("forward", "backward"):
            r = _row(B=b, **{"pass": p})
            kv = kv_step_bytes(r) if p == "forward" else kv_step_bytes(r) / 3
            t = 15 * (alpha + kv / bw) if p == "forward" else 16 * alpha + (47 * kv) / bw
            rows.append(_row(B=b, T_comm_ring_ms=t * 1e3, **{"pass": p}))
    a, b = fit_transfer(rows)
    assert a == pytest.approx(alpha, rel=1e-6) and b == pytest.approx(bw, rel=1e-6)


def test_fit_kernel_recovers_synthetic_parameters():
    truth = {"launch_s": 80e-6, "e_fwd": 0.3, "e_bwd": 0.25, "s_half": 700.0, "exponent": 0.5}
    peak, rows = 989e12, []
    for s in (210, 420, 840, 1680, 3360, 6720, 13440):
        for b in (1, 8):
            for p in ("forward", "backward"):
                r = _row(B=b, S_per_gpu=s, **{"pass": p})
                e = (truth["e_fwd"] if p == "forward" else truth["e_bwd"]) * (s / (s + 700.0)) ** 1.0
                t = 16 * (truth["launch_s"] + ring_block_flops(r) / (peak * e))
                rows.append(_row(B=b, S_per_gpu=s, T_comp_ring_ms=t * 1e3, **{"pass": p}))
    got = fit_kernel(rows, peak)
    for k, v in truth.items():
        assert got[k] == pytest.approx(v, rel=1e-3), k


def test_bad_data_file_is_one_line(tmp_path):
    f = tmp_path / "bad.csv"
    f.write_text("gpus,pass,B\n16,forward,1\n")
    with pytest.raises(UserError, match="missing column 'S'"):
        load_rows("charm-h100", f)
    shipped = resources.files("meshplan").joinpath("data/charm_plus_h100_2x8.csv").read_text()
    f.write_text(shipped.replace("16,forward,1,215040", "16,sideways,1,215040"))
    with pytest.raises(UserError, match="line 2.*pass"):
        load_rows("charm-h100", f)
    r = runner.invoke(app, ["reproduce", "charm-h100", "--data", str(f)])
    assert r.exit_code == 2 and r.stderr.count("\n") == 1 and "Traceback" not in r.stderr


@pytest.fixture(scope="module")
def fresh_fit():
    return reproduce_h100(fit=True)


@pytest.mark.heavy
def test_shipped_h100_topologies_carry_the_fitted_values(fresh_fit):
    fitted = FittedParams(**{k: v for k, v in fresh_fit["fitted"].items() if k in FittedParams.__dataclass_fields__})
    want = topology_values(fitted)
    # the declared CHARM+ order is the algorithm's default, so the shipped prediction uses it
    assert fitted.query_order == get("charm").knobs["query_order"].default
    for name in ("h100x16", "h100x32"):
        spec = Topology.load(name).spec
        nics = spec.node.nics
        assert spec.node.device.kernel == want["kernel"]
        assert nics.port.usable_GBps == want["nics.port.usable_GBps"] == nics.per_flow_GBps
        assert nics.node_aggregate_GBps == want["nics.node_aggregate_GBps"]
        assert spec.p2p_overhead_us == want["p2p_overhead_us"]
        assert spec.overlap_kappa.nvlink == spec.overlap_kappa.net == want["overlap_kappa"]["net"]
    # the shipped kernel table is the fitted one: its efficiency at one shape matches the formula
    e = Topology.load("h100x16").kernel.efficiency(2048, 2048, "fwd", False)
    g = 2048 / (2048 + fitted.s_half)
    assert float(e) == pytest.approx(fitted.e_fwd / (1 - fitted.kappa) * (g * g) ** fitted.exponent, abs=1e-4)


@pytest.mark.heavy
def test_shipped_parameters_give_the_fitted_errors_and_meet_ring_target(fresh_fit):
    shipped = reproduce_h100()
    for m in ("ring", "charm"):
        assert shipped["summary"][m]["mape_pct"] == pytest.approx(fresh_fit["summary"][m]["mape_pct"], abs=0.5)
        assert shipped["summary"][m]["rows"] == 50          # 54 rows less the 4 declared
    assert shipped["summary"]["ring"]["mape_pct"] <= 10.0   # docs/cost-model.md target
    assert shipped["summary"]["charm"]["mape_pct"] <= 10.0
    # TASP: no parameter of its own; the node-aware rings are the mechanism (issue 27's target: forward ≤ 25%)
    assert shipped["summary"]["tasp"]["rows"] == 25 and shipped["summary"]["tasp"]["mape_pct"] <= 25.0
    # declared rows are listed but never counted
    declared = [r for r in shipped["rows"] if r["declared"]]
    assert {r["row"] for r in declared} == {f"{p} B={b} S={s}" for p, b, s in DECLARED}
    errs = [abs(r["error_pct"]) for r in shipped["rows"] if r["method"] == "ring" and not r["declared"]]
    assert np.mean(errs) == pytest.approx(shipped["summary"]["ring"]["mape_pct"])


def test_ablation_directions_and_cli_json():
    body = reproduce_ablation()
    assert body["directions_total"] == 14 and body["directions_right"] >= 12
    r = runner.invoke(app, ["reproduce", "charm-ablation", "--json"])
    assert r.exit_code == 0, r.stderr
    assert json.loads(r.stdout)["directions_total"] == 14


def test_charm_memory_table():
    """Peak memory of the CHARM+ table: every row predicts CHARM+ above Ring (as measured); the published file is
    read with its source; a file without a column is refused with one line."""
    from meshplan.truth.reproduce import reproduce_memory

    body = reproduce_memory()
    assert body["directions_right"] == body["directions_total"] == 8
    for r in body["rows"]:
        assert r["ratio"]["measured"] == pytest.approx(r["measured_MB"]["charm"] / r["measured_MB"]["ring"])
        assert r["difference_MB"]["predicted"] > 0


def test_charm_memory_bad_file(tmp_path):
    bad = tmp_path / "m.csv"
    bad.write_text("B,S,heads,ring_MB\n16,1024,32,2179\n")
    res = CliRunner().invoke(app, ["reproduce", "charm-memory", "--data", str(bad)])
    assert res.exit_code == 2 and "charm_MB" in res.output and "Traceback" not in res.output


def test_tasp_rows_are_padded_to_its_granularity_with_the_padding_masked():
    """On two h100x16 nodes TASP cuts KV into 8 pieces (node-aware rings): a published S = 6720 (not a multiple of
    16 · 8) is predicted at 6784 tokens with 6720 valid — within 1% of the bytes, no padding computed."""
    from meshplan.truth.published import load_rows
    from meshplan.truth.reproduce import _workload, tasp_unit

    topo = Topology.load("h100x16", gpus=16)
    assert tasp_unit(topo, 16) == 128
    row = next(r for r in load_rows("charm-h100") if r.S == 6720)
    w = _workload(row, "fwd", unit=128)
    assert (w.seq_len, w.n_valid) == (6784, 6720)
    assert _workload(row, "fwd").seq_len == 6720
