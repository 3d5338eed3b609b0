"""``meshplan run`` and ``meshplan compare`` from the command line: refusals before any communication (exit
2, one line, no output file), a failing rank (exit 1, one line naming rank and op), and a full run whose
files have the contract's keys."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import numpy as np
import pytest
from helpers import one_line_error, run

pytest.importorskip("torch")

from exec_cases import Case  # noqa: E402

from meshplan.executor.program import Program, load_program, sequential_ok  # noqa: E402


@pytest.fixture(scope="module")
def ring2(tmp_path_factory):
    return Case("ring2", "ring", 2, workload={"seq_len": 256, "heads": 2, "kv_heads": 2, "head_dim": 16}).write(
        tmp_path_factory.mktemp("cli"))


def _edited(src, tmp_path, edit):
    doc = json.loads(src.read_text())
    edit(doc)
    path = tmp_path / "edited.json"
    path.write_text(json.dumps(doc))
    return path


def _drop_compute(doc):
    ops = doc["ranks"][0]["ops"]
    i = next(i for i, op in enumerate(ops) if op["kind"] == "compute")
    gone = ops.pop(i)["id"]
    for op in (op for r in doc["ranks"] for op in r["ops"]):
        op["deps"] = [d for d in op["deps"] if d != gone]
    for t in doc["tensors"]:
        t["free_after"] = [o for o in t["free_after"] if o != gone]


def test_a_dropped_compute_op_is_refused_by_validate_and_run(ring2, tmp_path):
    bad = _edited(ring2, tmp_path, _drop_compute)
    assert run("validate", bad).exit_code == 1
    out = tmp_path / "m.json"
    t0 = time.perf_counter()
    one_line_error(run("run", bad, "--out", out), "never computed")
    assert time.perf_counter() - t0 < 10 and not out.exists()


@pytest.mark.parametrize("edit,needles", [
    (lambda d: d.update(schema_version="0.9"), ["schema_version", "regenerate"]),
    (lambda d: d.update(device_of_rank=[0, 7]), ["device_of_rank"]),
    (lambda d: d["tensors"][0].update(size_bytes=d["tensors"][0]["size_bytes"] + 2), ["bytes", "workload needs"]),
])
def test_bad_files_are_refused_before_running(ring2, tmp_path, edit, needles):
    out = tmp_path / "m.json"
    one_line_error(run("run", _edited(ring2, tmp_path, edit), "--out", out), *needles)
    assert not out.exists()


def test_world_size_and_backend_are_checked_first(ring2):
    one_line_error(run("run", ring2, "--nproc", 3), "--nproc", "2 ranks")
    import torch
    if not torch.cuda.is_available():
        one_line_error(run("run", ring2, "--backend", "nccl"), "--backend", "gloo")
    one_line_error(run("run", ring2, "--out", "m.txt"), "--out")
    one_line_error(run("run", ring2, "--dump", ring2), "--dump", "not a folder")    # refused before running


def test_a_schedule_of_more_ranks_than_this_host_spawns_is_refused_at_once(tmp_path, monkeypatch):
    """A 72-rank schedule run as CPU ranks: refused from the file's header (exit 2, one line naming the file, the
    limit and torchrun), before the whole file is read and checked (seconds and GBs at 256 ranks) or its memory
    checked — not with the topology's ``--gpus``."""
    import meshplan.executor.launch as launch
    from meshplan.algorithms import get
    from meshplan.model.topology import Topology
    from meshplan.model.workload import resolve
    from meshplan.plan.json.io import write_schedule

    topo = Topology.load("h100x32", gpus=72)
    alg = get("ring")
    path = write_schedule(alg.schedule(alg.plan(resolve(seq_len=4608), topo, 72, alg.normalize({})), topo),
                          tmp_path / "ring72.json")
    monkeypatch.setattr(launch, "load_program", lambda path: pytest.fail("read whole before the refusal"))
    result = run("run", path, "--backend", "gloo")
    one_line_error(result, "ring72.json", "72 ranks", "at most 64 CPU ranks", "torchrun")
    assert "--gpus" not in result.stderr


def test_run_without_torch_is_one_line(ring2, monkeypatch):
    """Installed without the exec extra: one line naming what to install (no ModuleNotFoundError traceback)."""
    import importlib.util

    find = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "torch" else find(name, *a))
    monkeypatch.setitem(sys.modules, "torch", None)              # `import torch` fails, as without the extra
    for name in [m for m in sys.modules if m.startswith("meshplan.executor")]:
        monkeypatch.delitem(sys.modules, name)                  # imported afresh: nothing cached hides the import
    one_line_error(run("run", ring2), "needs torch", "[exec]")


@pytest.mark.heavy
def test_a_lost_message_times_out_naming_rank_op_and_peer(ring2, tmp_path):
    """Rank 0's first send is never posted (fault injection): rank 1's recv times out; the job stops."""
    doc = json.loads(ring2.read_text())
    send = next(op["id"] for op in doc["ranks"][0]["ops"] if op["kind"] == "send")
    recv = next(op["id"] for op in doc["ranks"][1]["ops"] if op["kind"] == "recv" and op["peer"] == 0)
    out = tmp_path / "m.json"
    t0 = time.perf_counter()
    env = os.environ | {"MESHPLAN_EXEC_DROP_OP": str(send)}
    r = subprocess.run([sys.executable, "-m", "meshplan", "run", str(ring2), "--timeout-s", "3", "--out", str(out)],
                       capture_output=True, text=True, timeout=120, env=env)
    assert r.returncode == 1, r.stderr
    line = r.stderr.strip().splitlines()[-1]
    assert line.startswith(f"error: run failed: rank 1: recv op {recv} with peer 0 did not complete in 3 s"), line
    assert time.perf_counter() - t0 < 60 and not out.exists()


def test_run_then_compare_writes_the_contracts_files(ring2, tmp_path):
    """What a new user runs: measurement, trace and dump files; compare against the prediction."""
    m, tr, dump = tmp_path / "m.json", tmp_path / "t.json", tmp_path / "dump"
    r = subprocess.run([sys.executable, "-m", "meshplan", "run", str(ring2), "--nproc", "2", "--iters", "2",
                        "--out", str(m), "--trace", str(tr), "--dump", str(dump)], capture_output=True, text=True,
                       timeout=240)
    assert r.returncode == 0, r.stderr
    assert "numerics passed" in r.stdout
    meas = json.loads(m.read_text())
    assert {"schedule", "env", "numerics", "ranks", "makespan_s", "peak_memory_bytes"} <= set(meas)
    assert meas["numerics"]["passed"] is True and meas["env"]["backend"] == "gloo"
    assert all({"id", "start_s", "end_s"} <= set(op) for op in meas["ranks"][0]["ops"])
    for name in ("q", "k", "v", "dout", "out", "lse", "dq", "dk", "dv"):
        assert (dump / f"{name}.npy").exists()
    assert np.load(dump / "q.npy").shape == (1, 256, 2, 16) and np.load(dump / "lse.npy").shape == (1, 2, 256)
    assert json.loads((dump / "meta.json").read_text())["softmax_scale"] == pytest.approx(0.25)
    assert any(e.get("ph") == "X" for e in json.loads(tr.read_text())["traceEvents"])
    both = tmp_path / "both.json"
    c = run("compare", ring2, m, "--json", "--trace", both)
    assert c.exit_code == 0, c.stderr
    ev = [e for e in json.loads(both.read_text())["traceEvents"] if e.get("ph") == "X"]
    measured_ops = sum(len(r["ops"]) for r in meas["ranks"])
    assert sum(e["pid"] >= 2 for e in ev) == measured_ops and {e["pid"] for e in ev} == {0, 1, 2, 3}
    durations = sorted(e["dur"] for e in ev if e["pid"] == 2)   # rank 0, measured (shift-invariant)
    assert durations == pytest.approx(sorted((o["end_s"] - o["start_s"]) * 1e6 for o in meas["ranks"][0]["ops"]))
    body = json.loads(c.stdout)
    assert body["comparable"] and body["end_to_end"]["total"]["measured_s"] == pytest.approx(meas["makespan_s"])
    assert body["implausible"] == [] and meas["env"]["kernel_flops_per_s"] > 0      # an honest run is plausible
    assert meas["numerics"]["checked"] == "full"                                     # cheap: the full check
    assert {r["kind"] for r in body["per_kind"]} >= {"compute", "transfer"}
    assert body["peak_memory"]["predicted_bytes"] == pytest.approx(body["peak_memory"]["measured_bytes"], rel=0.05)
    rise = body["memory_rise"]                   # the process's RSS rise: the buffers are a lower bound of it
    assert rise["kind"] == "rss" and rise["measured_rise_bytes"] >= rise["predicted_buffers_bytes"] > 0
    assert rise["measured_rise_bytes"] == max(r["peak_rise_bytes"] for r in meas["ranks"])
    assert meas["env"]["cpu"] and meas["env"]["isa"]                    # the host, for the calibration's match
    cpu = meas["ranks"][0]["stream_cpu_s"]                             # each stream thread's CPU per iteration
    assert set(cpu) == {s["name"] for s in json.loads(ring2.read_text())["streams"]} and cpu["compute"] > 0
    assert body["stream_cpu_s"] == pytest.approx({s: float(np.median([r["stream_cpu_s"][s] for r in meas["ranks"]]))
                                                  for s in cpu})
    probe, speed = meas["env"]["probe_ms"], body["host_speed"]        # the host-speed probe against calibration's
    from meshplan.model.topology import Topology
    calibrated = Topology.load("cpu-local").calibration.host_probe_ms
    assert probe > 0 and speed == {"probe_ms": probe, "calibrated_probe_ms": calibrated, "ratio": probe / calibrated}
    tot = body["end_to_end"]["total"]
    assert tot["speed_adjusted_error_pct"] == pytest.approx(
        100 * (tot["predicted_s"] * speed["ratio"] / tot["measured_s"] - 1))
    why = body["contention"]                   # contention or a wrong model, from the compute thread's CPU time
    assert why["verdict"] in ("contention", "compute model", "contention and compute model", "consistent")
    assert why["ranks"] == 2
    assert why["waited_s"] == pytest.approx(max(why["measured_wall_s"] - why["measured_cpu_s"], 0.0))
    assert why["measured_cpu_s"] == pytest.approx(float(np.median([r["stream_cpu_s"]["compute"]
                                                                   for r in meas["ranks"]])))


def test_compare_notes_a_calibration_from_another_host():
    """A CPU run on a host other than the calibration's (CPU, vector unit, cores) gets a one-line note; the same
    host, a GPU run or a run that does not record its host get none."""
    from types import SimpleNamespace

    from meshplan.model.topology import Topology
    from meshplan.truth.compare import host_match

    topo = Topology.load("cpu-local")
    dev = topo.calibration.device
    env = {"backend": "gloo", "cpu": dev.cpu, "isa": dev.isa, "cpu_count": dev.cores}
    assert host_match(topo, SimpleNamespace(env=env)) == ""
    other = SimpleNamespace(env=env | {"isa": "amx", "cpu_count": 64})
    note = host_match(topo, other)
    assert f"measured on {dev.cpu} ({dev.isa}, {dev.cores} cores)" in note and "(amx, 64 cores)" in note
    assert "meshplan calibrate" in note and "\n" not in note
    assert host_match(topo, SimpleNamespace(env=env | {"cpu": None, "isa": "amx"})) == ""
    assert host_match(topo, SimpleNamespace(env=env | {"backend": "nccl", "isa": "amx"})) == ""


def test_transfer_spans_count_from_when_both_sides_posted(ring2):
    """A recv's span is its end less the later of its own post and its send's post; other ops 0."""
    from meshplan.plan.json.io import from_json, read_document
    from meshplan.plan.schedule import OP_KINDS
    from meshplan.truth.compare import transfer_spans

    sched = from_json(read_document(ring2)[0])
    n = len(sched.ops)
    start, end = np.arange(n) * 1.0, np.arange(n) * 1.0 + 10.0
    partner, _, _ = sched.match_transfers()
    spans = transfer_spans(sched, start, end)
    recv = np.flatnonzero(sched.ops.kind == OP_KINDS.index("recv"))
    assert len(recv) and np.all(spans[recv] == np.maximum(end[recv] - np.maximum(start[recv], start[partner[recv]]), 0))
    others = np.setdiff1d(np.arange(n), recv)
    assert np.all(spans[others] == 0)


def test_compare_refuses_a_measurement_of_another_schedule(ring2, tmp_path):
    m = tmp_path / "m.json"
    m.write_text(json.dumps({"schedule": "0" * 64}))
    one_line_error(run("compare", ring2, m), "m.json")


def test_sequential_order_check_finds_a_deadlock(ring2):
    prog = load_program(ring2)
    assert all(sequential_ok(prog, p) for p in prog.passes)
    for r in prog.doc.ranks:            # each rank: its first recv alone, then its send: both wait forever
        ops = [op for op in r.ops if op.pass_ == "fwd"]
        send = next(op for op in ops if op.kind == "send")
        recv = next(op for op in ops if op.kind == "recv")
        send.step, recv.step = 101, 100
        r.ops.remove(recv)
        r.ops.insert(r.ops.index(send), recv)
    assert not sequential_ok(Program(prog.doc, prog.workload, prog.sha256, prog.positions), "fwd")
