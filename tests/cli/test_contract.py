"""The CLI/JSON contract (docs/formats.md) as a user's shell sees it: the installed entry point, exit codes,
stdout/stderr discipline, the keys of every --json body, the schedule skeleton, and the executor's files.
(The project's own copy of what an outside contract checker asks; each command runs as a subprocess.)"""

from __future__ import annotations

import gzip
import json
import subprocess
import sys
from pathlib import Path

import pytest

NAMES = {"ring", "pass-q", "ulysses", "usp", "loongtrain", "startrail", "tasp", "merge", "rmplus", "charm", "mesh"}
PREDICTED = ["makespan_s", "compute_s", "exposed_comm_s", "comm_busy_s", "comm_bytes_per_gpu_max",
             "inter_node_bytes_per_gpu_max", "ring_ccr", "compute_to_comm", "bytes_per_flop", "peak_memory_bytes"]


def meshplan(*args: str, cwd: Path | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "meshplan", *args], capture_output=True, text=True, cwd=cwd,
                          timeout=timeout)


@pytest.mark.parametrize("args", [["simulate", "--algo", "ring", "--gpus", "12", "--topo", "h100x32",
                                   "--seq-len", "96K"],
                                  ["simulate", "--algo", "no-such-algo", "--gpus", "8", "--topo", "h100x8"]],
                         ids=["bad-gpus", "unknown-algo"])
def test_bad_input_is_one_short_line_exit_2_and_nothing_on_stdout(args):
    p = meshplan(*args)
    assert p.returncode == 2 and p.stdout == ""
    assert 1 <= len(p.stderr.strip().splitlines()) <= 3 and "Traceback" not in p.stderr


@pytest.mark.parametrize("passes", ["fwd", "fwd+bwd"])
def test_simulate_json_keys(passes):
    p = meshplan("simulate", "--algo", "ring", "--gpus", "8", "--topo", "h100x8", "--seq-len", "128K",
                 "--pass", passes, "--json")
    assert p.returncode == 0, p.stderr
    body = json.loads(p.stdout)
    assert {"algorithm", "knobs", "workload", "pass", "model_level", "predicted"} <= set(body)
    assert set(PREDICTED) <= set(body["predicted"])
    if passes == "fwd+bwd":
        assert {"fwd", "bwd", "total"} <= set(body["predicted"])


def test_search_json_the_written_schedule_and_validate(tmp_path):
    p = meshplan("search", "--gpus", "8", "--topo", "h100x8", "--seq-len", "128K", "--pass", "fwd", "--top", "5",
                 "--write", "1", "--out", str(tmp_path / "sched"), "--json")
    assert p.returncode == 0, p.stderr
    body = json.loads(p.stdout)
    assert {"workload", "topology", "wall_s", "counts", "candidates"} <= set(body)
    assert {"enumerated", "pruned", "simulated", "skipped"} <= set(body["counts"])
    for c in body["candidates"]:
        assert {"algorithm", "knobs", "pass", "model_level", "predicted", "scheduler", "schedule_path"} <= set(c)
        assert c["algorithm"] in NAMES and c["model_level"] in ("closed-form", "simulated")
        assert {"requested", "kept", "status", "objective_s", "bound_s", "gap", "solve_s"} <= set(c["scheduler"])
    written = sorted((tmp_path / "sched").glob("*.json*"))
    assert written and meshplan("validate", str(written[0])).returncode == 0
    opener = gzip.open if written[0].suffix == ".gz" else open
    with opener(written[0], "rt") as f:
        sched = json.load(f)
    assert {"schema_version", "algorithm", "knobs", "workload", "topology", "device_of_rank", "tensors",
            "ranks"} <= set(sched)
    assert all({"id", "kind", "stream", "deps"} <= set(op) for r in sched["ranks"][:2] for op in r["ops"][:50])
    (tmp_path / "old.json").write_text('{"schema_version": "0"}')
    assert meshplan("validate", str(tmp_path / "old.json")).returncode == 2


@pytest.mark.timeout(300)
def test_run_writes_the_measurement_and_dump_files(tmp_path):
    pytest.importorskip("torch")
    p = meshplan("simulate", "--algo", "ring", "--gpus", "2", "--topo", "cpu-local", "--seq-len", "1024",
                 "--heads", "2", "--kv-heads", "2", "--head-dim", "32", "--pass", "fwd+bwd", "--out", "r.json",
                 cwd=tmp_path)
    assert p.returncode == 0, p.stderr
    p = meshplan("run", "r.json", "--nproc", "2", "--iters", "1", "--out", "m.json", "--dump", "dump", cwd=tmp_path)
    assert p.returncode == 0, p.stdout + p.stderr
    m = json.loads((tmp_path / "m.json").read_text())
    assert {"schedule", "env", "numerics", "ranks", "makespan_s", "peak_memory_bytes"} <= set(m)
    assert isinstance(m["numerics"]["passed"], bool)
    assert all({"id", "start_s", "end_s"} <= set(op) for op in m["ranks"][0]["ops"][:5])
    dump = tmp_path / "dump"
    assert all((dump / f"{f}.npy").exists() for f in ("q", "k", "v", "dout", "out", "lse", "dq", "dk", "dv"))
    assert (dump / "meta.json").exists()
