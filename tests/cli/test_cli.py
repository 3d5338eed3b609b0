"""The CLI contract through typer's CliRunner: commands, JSON keys, one-line errors with exit 2."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers import one_line_error, run
from typer.testing import CliRunner

runner = CliRunner()
PRED = ("makespan_s", "compute_s", "exposed_comm_s", "comm_busy_s", "comm_bytes_per_gpu_max",
        "inter_node_bytes_per_gpu_max", "ring_ccr", "compute_to_comm", "bytes_per_flop", "peak_memory_bytes")


def test_simulate_json_keys_single_pass():
    r = run("simulate", "--algo", "ring", "--gpus", 8, "--topo", "h100x8", "--seq-len", "128K", "--pass", "fwd",
            "--json")
    assert r.exit_code == 0, r.stderr
    d = json.loads(r.stdout)
    assert {"algorithm", "knobs", "workload", "pass", "model_level", "predicted"} <= set(d)
    assert all(k in d["predicted"] for k in PRED) and d["model_level"] == "simulated"


def test_simulate_fwd_bwd_has_parts_and_flat_total():
    r = run("simulate", "--algo", "pass-q", "--gpus", 4, "--topo", "h100x8", "--seq-len", "64K", "--json")
    d = json.loads(r.stdout)["predicted"]
    assert {"fwd", "bwd", "total"} <= set(d)
    assert d["makespan_s"] == pytest.approx(d["fwd"]["makespan_s"] + d["bwd"]["makespan_s"])


def test_simulate_human_table_on_stdout():
    r = run("simulate", "--algo", "ring", "--gpus", 2, "--topo", "cpu-local", "--seq-len", "4K")
    assert r.exit_code == 0 and "makespan" in r.stdout and "bytes received" in r.stdout


def test_simulate_writes_and_reads_back(tmp_path, monkeypatch):
    monkeypatch.delenv("COLUMNS", raising=False)                    # piped output: 100 columns
    out, trace = tmp_path / "r.json", tmp_path / "r.trace.json"
    r = run("simulate", "--algo", "ring", "--gpus", 4, "--topo", "h100x8", "--seq-len", "16K", "--out", out,
            "--trace", trace, "--json")
    assert r.exit_code == 0, r.stderr
    first = json.loads(r.stdout)["predicted"]["makespan_s"]
    assert "traceEvents" in json.loads(trace.read_text())
    valid = run("validate", out)
    assert valid.exit_code == 0 and "no deadlock" in " ".join(valid.stdout.split())
    assert max(map(len, valid.stdout.splitlines())) <= 100         # piped: wrapped at 100 columns, not 170
    again = run("simulate", out, "--json")
    assert again.exit_code == 0, again.stderr
    assert json.loads(again.stdout)["predicted"]["makespan_s"] == pytest.approx(first)
    sim, sim_file = json.loads(r.stdout)["simulation"], json.loads(again.stdout)["simulation"]   # the same object
    assert set(sim) == set(sim_file) == {"ranks_simulated", "exact", "events", "wall_s"}
    assert (sim["ranks_simulated"], sim["events"]) == (sim_file["ranks_simulated"], sim_file["events"])


def test_search_json_and_written_schedule(tmp_path):
    r = run("search", "--gpus", 8, "--topo", "h100x8", "--seq-len", "128K", "--pass", "fwd", "--top", 5,
            "--write", 2, "--out", tmp_path / "s", "--json")
    assert r.exit_code == 0, r.stderr
    d = json.loads(r.stdout)
    assert {"workload", "topology", "wall_s", "counts", "candidates"} <= set(d)
    assert {"enumerated", "pruned", "simulated", "skipped"} <= set(d["counts"])
    assert "not implemented yet" not in d["counts"]["skipped"]
    c = d["candidates"]
    from meshplan.algorithms import NAMES
    assert set(NAMES) - {"charm", "tasp"} <= {x["algorithm"] for x in c}   # one node; 128K is not 56·k
    assert c[0]["model_level"] == "simulated" and c[0]["schedule_path"] and c[1]["schedule_path"]
    assert all({"requested", "kept", "status", "objective_s", "bound_s", "gap", "solve_s"} <= set(x["scheduler"])
               for x in c)
    times = [x["predicted"]["makespan_s"] for x in c if x["model_level"] == "simulated"]
    assert times == sorted(times)
    assert run("validate", c[0]["schedule_path"]).exit_code == 0


def test_search_layout_pin_and_algos_filter(tmp_path):
    r = run("search", "--gpus", 4, "--topo", "h100x8", "--seq-len", "16K", "--layout", "striped", "--algos", "ring",
            "--write", 0, "--json")
    d = json.loads(r.stdout)
    assert {c["layout"] for c in d["candidates"]} == {"striped"}
    assert {c["algorithm"] for c in d["candidates"]} == {"ring"}


def test_search_flags_a_near_tie_at_the_top():
    """#1's predicted lead over #2 is printed under the table ("at least" when #2 kept its closed-form lower
    bound), with a near-tie warning below NEAR_TIE (a margin smaller than the model's error does not say which is
    faster); no line without a simulated #1 and a #2."""
    from meshplan.show.search_table import NEAR_TIE, _lead_text

    args = ("search", "--gpus", 4, "--topo", "h100x8", "--seq-len", "16K", "--layout", "zigzag", "--algos",
            "ring,merge,rmplus", "--write", 0)
    cands = json.loads(run(*args, "--json").stdout)["candidates"]
    a, b = (c["predicted"]["makespan_s"] for c in cands[:2])
    text = _lead_text(cands, 4)
    at_least = "at least " if cands[1]["model_level"] != "simulated" else ""
    assert text.startswith(f"#1 leads #2 by {at_least}{(b - a) / a:.1%}")
    assert ("near-tie" in text) == ((b - a) / a < NEAR_TIE)
    same = {**cands[0]}
    assert _lead_text([cands[0], same], 4).startswith("#1 and #2 take the same time (predicted)")   # no "lead"
    assert "near-tie" in _lead_text([cands[0], same], 4)
    # the way to run both: CPU ranks here up to cpu-local's 64, else on the cluster (a 256-rank run cannot start here)
    assert "then meshplan run each)" in _lead_text([cands[0], same], 64)
    assert "(both are written below, then" in _lead_text([cands[0], same | {"schedule_path": "s/02.json"}], 64)
    cluster = _lead_text([cands[0], same], 256)
    assert "torchrun" in cluster and "meshplan run each" not in cluster
    assert "(this search again with --write 2, then run each" in cluster
    # above 256 ranks a search does not build a USP pick whole: --write 2 names the command that writes each
    assert "names the `meshplan simulate … --out` that does" in _lead_text([cands[0], same], 512)
    far = {**cands[0], "predicted": {**cands[0]["predicted"], "makespan_s": 2 * a}}
    assert _lead_text([cands[0], far], 4) == "#1 leads #2 by 100.0% (predicted)"
    # #2 a lower bound under #1's time, within the prune slack (left unsimulated): how far it could be ahead
    under = {**cands[0], "model_level": "closed-form", "predicted": {**cands[0]["predicted"], "makespan_s": 0.993 * a}}
    text = _lead_text([cands[0], under], 4, 0.01)
    assert text.startswith("#2's lower bound is 0.7% under #1's time: within the prune slack (1%)")
    assert "near-tie" in text and "proven only that far" not in text
    assert _lead_text([cands[0], under], 4, 0.01, unproven=(2,)) is None      # the not-proven line says it
    bounded = {**far, "model_level": "closed-form"}
    assert _lead_text([cands[0], bounded], 4).startswith("#1 leads #2 by at least 100.0%")
    from meshplan.show.search_table import why_lines  # equal times: nothing "beats" anything

    def beats(two):
        return [line for line in why_lines({"candidates": [cands[0], two], "topology": {}}) if "beats" in line]
    assert beats(same) == [] and beats(far)[0].startswith("#1 beats #2")
    assert _lead_text(cands[:1], 4) is None and _lead_text([bounded, cands[0]], 4) is None
    shown = run(*args)
    assert shown.exit_code == 0 and "#1 leads #2 by" in shown.stdout


def test_validate_exit_codes(tmp_path):
    bad = tmp_path / "old.json"
    bad.write_text('{"schema_version": "0"}')
    assert run("validate", bad).exit_code == 2
    good = tmp_path / "g.json"
    run("simulate", "--algo", "ring", "--gpus", 2, "--topo", "h100x8", "--seq-len", "4K", "--out", good)
    d = json.loads(good.read_text())
    first_compute = next(op for op in d["ranks"][0]["ops"] if op["kind"] == "compute")
    d["ranks"][0]["ops"].remove(first_compute)
    broken = tmp_path / "broken.json"
    broken.write_text(json.dumps(d))
    r = run("validate", broken)
    assert r.exit_code == 1 and "invalid" in r.stdout
    one_line_error(run("simulate", broken), "invalid schedule")


def test_schema_and_topo_show():
    r = run("schema")
    assert r.exit_code == 0 and json.loads(r.stdout)["title"] == "ScheduleJSON"
    r = run("topo", "show", "l20x8", "--json")
    d = json.loads(r.stdout)
    assert {row["class"] for row in d["link_classes"]} == {"pcie", "socket"}
    assert run("topo", "show", "h100x32", "--gpus", 64).exit_code == 0


@pytest.mark.parametrize("args,needles", [
    (["simulate", "--algo", "ring", "--gpus", 12, "--topo", "h100x32", "--seq-len", "96K"], ["--gpus", "divisor of 8"]),
    (["simulate", "--algo", "no-such-algo", "--gpus", 8, "--topo", "h100x8"], ["--algo", "ring"]),
    (["simulate", "--algo", "startrail", "--gpus", 8, "--topo", "h100x8", "--team-size", 3], ["--team-size", "8"]),
    (["simulate", "--algo", "ulysses", "--gpus", 2, "--topo", "cpu-local", "--seq-len", 1023, "--heads", 8,
      "--kv-heads", 8, "--head-dim", 64, "--layout", "contiguous"], ["--seq-len", "--valid-len 1023"]),   # C6
    (["simulate", "--algo", "usp", "--ulysses-degree", 2, "--gpus", 4, "--topo", "cpu-local", "--heads", 6,
      "--kv-heads", 3, "--seq-len", "4K"], ["--ulysses-degree", "3 KV heads"]),                        # C7
    (["simulate", "--algo", "tasp", "--gpus", 8, "--topo", "h100x8", "--seq-len", 1000, "--pass", "fwd"],
     ["--algo", "multiple of 112"]),
    (["simulate", "--algo", "charm", "--gpus", 12, "--topo", "cpu-local", "--domains", 2], ["--domains"]),
    (["simulate", "--algo", "charm", "--gpus", 8, "--topo", "h100x8"], ["--algo", "NUMA domains", "--domains"]),
    (["simulate", "--algo", "ring", "--gpus", 8, "--topo", "h100x8", "--kv-heads", 5], ["--kv-heads", "1, 2, 4"]),
    (["simulate", "--algo", "ring", "--gpus", 4, "--topo", "h100x8", "--seq-len", 2999],
     ["2·N = 8", "--seq-len 3000 --valid-len 2999"]),
    (["simulate", "--algo", "ring", "--gpus", 4, "--topo", "h100x8", "--model", "gpt5"], ["--model", "llama3-8b"]),
    (["simulate", "--algo", "ring", "--gpus", 4, "--topo", "h100x8", "--tile", "2x2"], ["--tile", "ring takes"]),
    (["simulate", "--algo", "ring", "--gpus", 4, "--topo", "h100x8", "--dkv-dtype", "fp8"], ["--dkv-dtype", "fp32"]),
    (["simulate", "--algo", "ring", "--gpus", 4, "--topo", "h100x8", "--knob", "oops"], ["--knob", "name=value"]),
    (["simulate", "--algo", "ring", "--gpus", 4, "--topo", "h100x8", "--mask", "diagonal"], ["--mask"]),
    (["simulate", "--algo", "ring", "--gpus", 4, "--topo", "h100x8", "--seq-len", "lots"], ["--seq-len"]),
    (["simulate", "--algo", "ring", "--gpus", 4, "--topo", "nowhere"], ["--topo", "h100x32"]),
    (["simulate", "--algo", "ring", "--gpus", 4], ["--topo"]),
    (["search", "--topo", "h100x8"], ["--gpus"]),
    (["search", "--gpus", 8, "--topo", "h100x8", "--algos", "rng"], ["--algos:", "doc-place"]),
    (["search", "--gpus", 8, "--topo", "h100x8", "--memory-limit", "lots"], ["--memory-limit"]),
    (["search", "--gpus", 8, "--topo", "h100x8", "--memory-limit", "16"], ["--memory-limit", "16GB or 16GiB"]),
    (["simulate", "--algo", "ring", "--gpus", 4, "--topo", "h100x8", "--bogus"], ["--bogus"]),
])
def test_bad_input_is_one_line_exit_2(args, needles):
    one_line_error(run(*args), *needles)


def test_bad_yaml_keys_and_bandwidths(tmp_path):
    text = Path(__file__).resolve().parents[1].joinpath("data", "unit-nvswitch.yaml").read_text()
    bad_key = tmp_path / "k.yaml"
    bad_key.write_text(text.replace("nodes: 1", "nodes: 1\nnodess: 2"))
    one_line_error(run("topo", "show", bad_key), "nodess", "unknown key")
    zero = tmp_path / "z.yaml"
    zero.write_text(text.replace("usable_GBps: 24.0e-9", "usable_GBps: 0"))
    one_line_error(run("simulate", "--algo", "ring", "--gpus", 2, "--topo", zero), "usable_GBps")


def test_nothing_written_on_error(tmp_path):
    out = tmp_path / "never.json"
    one_line_error(run("simulate", "--algo", "ring", "--gpus", 12, "--topo", "h100x32", "--out", out), "--gpus")
    assert not out.exists()
    one_line_error(run("simulate", "--algo", "ring", "--gpus", 2, "--topo", "h100x8", "--seq-len", "4K",
                       "--out", tmp_path / "x.txt"), "--out")


def test_simulate_refuses_unmatched_sends(tmp_path):
    good = tmp_path / "g.json"
    run("simulate", "--algo", "ring", "--gpus", 2, "--topo", "h100x8", "--seq-len", "4K", "--pass", "fwd",
        "--out", good)
    d = json.loads(good.read_text())
    ops = d["ranks"][1]["ops"]
    recv = next(op for op in ops if op["kind"] == "recv")
    ops.remove(recv)
    for op in ops:
        op["deps"] = [x for x in op["deps"] if x != recv["id"]]
    for t in d["tensors"]:
        t["free_after"] = [x for x in t["free_after"] if x != recv["id"]]
        if t["alloc_op"] == recv["id"]:
            t["alloc_op"] = None
    bad = tmp_path / "unmatched.json"
    bad.write_text(json.dumps(d))
    one_line_error(run("simulate", bad), "no matching partner")
    assert run("validate", bad).exit_code == 1


def test_flags_that_would_be_ignored_are_refused(tmp_path):
    """A knob no method has names --knob (not --gpus after every method skipped it); a schedule file with flags
    that plan one by name (--algo, --gpus) names the flag; --top 0 would print no row under text about #1."""
    base = ("search", "--gpus", 8, "--topo", "h100x8", "--seq-len", "16K", "--write", 0)
    one_line_error(run(*base, "--knob", "foo=1"), "--knob", "no method has a knob 'foo'", "the knobs: ")
    one_line_error(run(*base, "--knob", "dkv_hop=n"), "--knob", "did you mean dkv_hops?")
    one_line_error(run(*base, "--top", 0), "--top", "give 1 or more")
    sched = tmp_path / "r.json"
    made = run("simulate", "--algo", "ring", "--gpus", 4, "--topo", "cpu-local", "--seq-len", "1K", "--heads", 2,
               "--kv-heads", 2, "--head-dim", 16, "--out", str(sched))
    assert made.exit_code == 0, made.stderr
    one_line_error(run("simulate", str(sched), "--algo", "ring"), "--algo", "carries its own plan")
    one_line_error(run("simulate", str(sched), "--gpus", 8), "--gpus", "carries its own plan")
    assert run("simulate", str(sched), "--topo", "cpu-local").exit_code == 0
    valid = run("validate", str(sched))
    assert valid.exit_code == 0 and " GB per rank" not in valid.stdout and " KB per rank" in valid.stdout


def test_the_charm_memory_reproduction_fits_100_columns(monkeypatch):
    """Two tables of 9 and 8 columns (not one of 14, cut to ellipses when piped) and the summary folded."""
    monkeypatch.setenv("COLUMNS", "100")
    done = run("reproduce", "charm-memory")
    assert done.exit_code == 0, done.stderr
    assert max(map(len, done.stdout.splitlines())) <= 100 and "…" not in done.stdout


def test_ctrl_c_is_said_aborted_with_exit_130(monkeypatch):
    """Ctrl-C during a command: one line ``aborted`` on stderr and exit status 130 (typer alone exits silently)."""
    import meshplan.search.pipeline as pipeline

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt
    monkeypatch.setattr(pipeline, "run_pipeline", interrupted)
    r = run("search", "--gpus", 8, "--topo", "h100x8", "--seq-len", "16K", "--write", 0)
    assert r.exit_code == 130 and r.stderr.strip() == "aborted" and r.stdout == ""
