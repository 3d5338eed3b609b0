"""plan-batch: the doc-place plan beside per-document Ring and the best fixed method, the cache, the CLI."""

from __future__ import annotations

import json

import numpy as np
import pytest
from helpers import one_line_error, run

from meshplan.core.errors import UserError
from meshplan.model.doc_lengths import document_lengths
from meshplan.model.topology import Topology
from meshplan.model.workload import resolve
from meshplan.plan.json.io import read_schedule
from meshplan.plan.verify import verify
from meshplan.search import batch
from meshplan.search.batch import plan_batch

CU = [0, 1000, 3000, 3500, 6000, 6100, 8192]


def _shape():
    return resolve(seq_len=8192, heads=8, kv_heads=2, head_dim=64, dtype="bf16")


def test_plan_and_both_references_with_roles():
    topo = Topology.load("h100x8", gpus=4)
    got = plan_batch(CU, topo, 4, _shape(), cache=False)
    assert got.roles == ["plan", "per_doc_ring", "best_fixed"]
    plan, ring, fixed = got.candidates
    assert plan.algorithm == "doc-place" and plan.workload.layout == "doc-place"
    assert ring.algorithm == "ring" and ring.workload.layout == "zigzag"
    assert ring.workload.seq_len % 8 == 0 and ring.workload.mask.doc_real_lens() == tuple(np.diff(CU))
    assert got.best.predicted.makespan_s == min(c.predicted.makespan_s for c in got.candidates)
    assert verify(plan.schedule).ok and plan.workload.mask.doc_lens == tuple(np.diff(CU))
    assert 0 < got.plan_s and not got.cached


def test_the_plan_is_estimated_unless_asked_to_simulate():
    # 16 ranks over two nodes, a document split across them: the estimate is the contended closed form, within the
    # tolerance tests/cost/test_estimate.py holds it to against the simulator
    topo = Topology.load("h100x32", gpus=16)
    cu = [0, 40_000, 41_000, 45_000, 52_000, 65_536]
    shape = resolve(model="llama3-8b", seq_len=cu[-1])
    est = plan_batch(cu, topo, 16, shape, references=False, cache=False)
    sim = plan_batch(cu, topo, 16, shape, references=False, cache=False, simulate=True)
    (e,), (s,) = est.candidates, sim.candidates
    assert (e.model_level, s.model_level) == ("estimated", "simulated")
    assert e.predicted.makespan_s == pytest.approx(s.predicted.makespan_s, rel=0.08)
    assert e.predicted.makespan_s >= e.bound_s
    assert est.json()["candidates"][0]["model_level"] == "estimated"


def test_a_plan_that_does_not_fit_the_device_is_refused(monkeypatch):
    topo = Topology.load("h100x8", gpus=4)
    monkeypatch.setattr(type(topo), "memory_bytes", property(lambda self: 1e6))     # a 1 MB device
    with pytest.raises(UserError, match="does not fit the device"):
        plan_batch(CU, topo, 4, _shape(), references=False, cache=False)


def test_same_documents_come_from_the_cache():
    topo = Topology.load("h100x8", gpus=4)
    batch._CACHE.clear()
    first = plan_batch(CU, topo, 4, _shape(), references=False)
    again = plan_batch(CU, topo, 4, _shape(), references=False)
    fresh = plan_batch(CU, topo, 4, _shape(), references=False, cache=False)
    assert again.cached and again.candidates[0] is first.candidates[0]
    assert not fresh.cached and fresh.candidates[0] is not first.candidates[0]
    other = plan_batch([0, 4096, 8192], topo, 4, _shape(), references=False)
    assert not other.cached


@pytest.mark.parametrize("cu,says", [([1, 5], "starts at 1"), ([0], "at least two"), ([0, 5, 5], "at least one token"),
                                     ([0, 7, 3], "does not rise"), ([0, 10.5, 20], "whole-number"),
                                     ("0,10,20", "is a string")])
def test_bad_boundaries(cu, says):
    with pytest.raises(UserError, match=says):
        document_lengths(cu)


def test_rank_count_must_be_the_topologys():
    with pytest.raises(UserError, match="n_ranks.*gpus=16"):
        plan_batch(CU, Topology.load("h100x8", gpus=8), 16, _shape())


def test_cli_json_carries_plan_s_best_and_every_role(tmp_path):
    out = tmp_path / "plan.json"
    r = run("plan-batch", "--gpus", 4, "--topo", "h100x8", "--heads", 8, "--kv-heads", 2, "--head-dim", 64,
            "--cu-seqlens", ",".join(map(str, CU)), "--no-cache", "--out", str(out), "--json")
    assert r.exit_code == 0, r.stderr
    d = json.loads(r.stdout)
    assert {"plan_s", "best", "candidates"} <= set(d) and d["plan_s"] > 0
    assert {c["role"] for c in d["candidates"]} >= {"plan", "per_doc_ring", "best_fixed"}
    for c in d["candidates"]:
        assert {"algorithm", "knobs", "role"} <= set(c) and c["predicted"]["makespan_s"] > 0
        assert c["model_level"] == ("estimated" if c["role"] == "plan" else "simulated")
    assert d["best"] in d["candidates"]
    assert verify(read_schedule(out)).ok


def test_cli_simulate_flag_simulates_the_plan():
    r = run("plan-batch", "--gpus", 4, "--topo", "h100x8", "--heads", 8, "--kv-heads", 2, "--head-dim", 64,
            "--cu-seqlens", ",".join(map(str, CU)), "--no-cache", "--simulate", "--json")
    assert r.exit_code == 0, r.stderr
    plan = next(c for c in json.loads(r.stdout)["candidates"] if c["role"] == "plan")
    assert plan["model_level"] == "simulated"


@pytest.mark.parametrize("args,field", [
    (["--cu-seqlens", "0,10,5"], "--cu-seqlens"),
    (["--cu-seqlens", "0,ten"], "--cu-seqlens"),
    (["--cu-seqlens", "0,4096", "--out", "plan.txt"], "--out"),
    (["--cu-seqlens", "0,4096,"], "--cu-seqlens"),
    (["--cu-seqlens", "0,0,4096"], "at least one token"),
    (["--cu-seqlens", "0,4096", "--mask", "causal"], "--mask"),
    (["--cu-seqlens", "0,4096", "--seq-len", "4096"], "--seq-len"),
])
def test_cli_errors_are_one_line(args, field):
    r = run("plan-batch", "--gpus", 4, "--topo", "h100x8", *args)
    one_line_error(r, field)


# --- search --doc-lengths ------------------------------------------------------------------------------------

def _hist(tmp_path):
    p = tmp_path / "lengths.csv"
    p.write_text('range,number\n"[16, 256]",50\n"[257, 2048]",10\n')
    return p


def test_distribution_rows_and_per_batch_is_never_slower(tmp_path):
    r = run("search", "--gpus", 4, "--topo", "h100x8", "--heads", 8, "--kv-heads", 2, "--head-dim", 64,
            "--doc-lengths", str(_hist(tmp_path)), "--batches", 2, "--seq-len", 4096, "--json")
    assert r.exit_code == 0, r.stderr
    d = json.loads(r.stdout)
    assert d["batches"] == 2 and len(d["documents_per_pack"]) == 2
    rows = d["rows"]
    assert [row["mean_s"] for row in rows] == sorted(row["mean_s"] for row in rows)
    per_batch = next(row for row in rows if row["role"] == "per_batch")
    assert any(row["algorithm"] == "ring" and row["layout"] == "zigzag" for row in rows)
    for row in rows:
        assert len(row["times_s"]) == 2 and row["p90_s"] >= row["mean_s"] - 1e-12       # two packs: p90 >= mean
        if row["role"] == "fixed":      # per pack, the plan is the best of doc-place and search's best (prune 1%)
            assert all(p <= f / 0.99 for p, f in zip(per_batch["times_s"], row["times_s"]))


@pytest.mark.parametrize("args,field", [
    (["--batches", "2", "--seq-len", "4096"], "--batches"),
    (["--doc-lengths", "HIST", "--seq-len", "4096", "--mask", "causal"], "--mask"),
    (["--doc-lengths", "HIST"], "--seq-len"),
    (["--doc-lengths", "HIST", "--seq-len", "4096", "--batches", "0"], "--batches"),
    (["--doc-lengths", "missing.csv", "--seq-len", "4096"], "--doc-lengths"),
])
def test_distribution_errors_are_one_line(tmp_path, args, field):
    args = [str(_hist(tmp_path)) if a == "HIST" else a for a in args]
    r = run("search", "--gpus", 4, "--topo", "h100x8", *args)
    one_line_error(r, field)


def test_a_token_cap_that_cannot_hold_is_said():
    # three equal documents on two ranks: one rank holds two (20 tokens > 1.25 x 15)
    got = plan_batch([0, 10, 20, 30], Topology.load("h100x8", gpus=2), 2,
                     resolve(seq_len=30, heads=8, kv_heads=2, head_dim=64), references=False, cache=False)
    assert any("token cap" in note for note in got.notes)


def test_a_doc_place_schedule_file_simulates_and_odd_documents_plan(tmp_path):
    out = tmp_path / "odd.json"
    r = run("simulate", "--algo", "doc-place", "--gpus", 4, "--topo", "cpu-local", "--seq-len", 4099,
            "--mask", "docs:1003,3096", "--out", str(out), "--json")
    assert r.exit_code == 0, r.stderr
    d = json.loads(r.stdout)
    assert d["workload"]["layout"] == "doc-place" and d["predicted"]["ring_ccr"] is None    # no Ring cuts 1003
    again = run("simulate", str(out), "--json")
    assert again.exit_code == 0, again.stderr
    assert json.loads(again.stdout)["predicted"]["makespan_s"] == pytest.approx(d["predicted"]["makespan_s"])


def test_doc_place_is_not_a_layout_to_give():
    r = run("simulate", "--algo", "ring", "--gpus", 4, "--topo", "cpu-local", "--seq-len", 4096,
            "--mask", "docs:1000,3096", "--layout", "doc-place")
    one_line_error(r, "--layout", "--algo doc-place")
