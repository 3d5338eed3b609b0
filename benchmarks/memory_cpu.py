"""The memory model against measured memory on CPU ranks: predicted peak (buffers + op workspace + runtime,
:mod:`meshplan.cost.memory`) vs each run's largest per-pass memory rise (``peak_rise_bytes``), per method.

``python benchmarks/memory_cpu.py [--quick]`` — every case is planned and simulated on ``cpu-local``, written,
run by the executor (one spawned world per rank count, one timed iteration plus the memory iteration) and
compared. The coefficients come from ``meshplan calibrate`` (each op run alone, micro-level): none of these
runs is used to fit them. Results: ``benchmarks/results/memory_cpu.json``.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results" / "memory_cpu.json"
sys.path.insert(0, str(HERE.parent))

from meshplan.core.fileio import write_atomic  # noqa: E402

# (method, ranks, knobs, workload): sequence length, heads, dtype and pass vary.
CASES = [
    ("ring", 2, {}, dict(seq_len=8192, heads=8, kv_heads=8, head_dim=64, dtype="bf16", passes="fwd+bwd")),
    ("pass-q", 2, {}, dict(seq_len=8192, heads=8, kv_heads=2, head_dim=64, dtype="bf16", passes="fwd+bwd")),
    ("ulysses", 2, {}, dict(seq_len=4096, heads=8, kv_heads=8, head_dim=64, dtype="fp32", passes="fwd+bwd")),
    ("ring", 2, {}, dict(seq_len=16384, heads=4, kv_heads=4, head_dim=64, dtype="fp32", passes="fwd")),
    ("mesh", 4, {}, dict(seq_len=8192, heads=4, kv_heads=4, head_dim=64, dtype="bf16", passes="fwd+bwd")),
    ("usp", 4, {"ulysses_degree": 2}, dict(seq_len=8192, heads=4, kv_heads=4, head_dim=64, dtype="bf16",
                                            passes="fwd+bwd")),
    ("startrail", 4, {}, dict(seq_len=8192, heads=4, kv_heads=4, head_dim=64, dtype="fp32", passes="fwd+bwd")),
    ("charm", 4, {"domains": 2}, dict(seq_len=8192, heads=4, kv_heads=4, head_dim=64, dtype="bf16", passes="fwd+bwd")),
]
QUICK = [c for c in CASES if c[1] == 2][:3]


def measure(cases, folder: Path) -> list[dict]:
    """Plan, write, run and compare every case; a row per case (predicted/measured bytes, error %)."""
    from meshplan.executor.launch import run_batch
    from meshplan.executor.worker import RunConfig
    from meshplan.model.topology import Topology
    from meshplan.model.workload import resolve
    from meshplan.plan.json.io import write_schedule
    from meshplan.search.candidate import predict
    from meshplan.truth.compare import compare_files

    by_world: dict[int, list] = {}
    for k, (algo, n, knobs, flags) in enumerate(cases):
        topo = Topology.load("cpu-local", n)
        cand = predict(algo, resolve(**flags), topo, n, knobs)
        path = folder / f"{k}-{algo}.json"
        write_schedule(cand.schedule, path)
        by_world.setdefault(n, []).append((k, algo, n, flags, path, cand))
    rows = []
    for n, items in sorted(by_world.items()):
        results = run_batch([(str(p), RunConfig(iters=1, warmup=0, check=False)) for *_, p, _ in items])
        for (k, algo, n, flags, path, _), meas in zip(items, results):
            meas_path = folder / f"{k}-meas.json"
            meas_path.write_text(json.dumps(meas))
            rise = compare_files(str(path), str(meas_path))["memory_rise"]
            rows.append({"method": algo, "ranks": n, "workload": flags, "predicted_bytes": rise["predicted_bytes"],
                         "buffers_bytes": rise["predicted_buffers_bytes"],
                         "measured_bytes": rise["measured_rise_bytes"], "error_pct": rise["error_pct"]})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="three 2-rank cases")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        rows = measure(QUICK if args.quick else CASES, Path(tmp))
    err = np.array([abs(r["error_pct"]) for r in rows])
    print("| method | ranks | S | dtype | pass | buffers MB | predicted MB | measured MB | error |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        w = r["workload"]
        print(f"| {r['method']} | {r['ranks']} | {w['seq_len']} | {w['dtype']} | {w['passes']} | "
              f"{r['buffers_bytes'] / 1e6:.1f} | {r['predicted_bytes'] / 1e6:.1f} | {r['measured_bytes'] / 1e6:.1f} | "
              f"{r['error_pct']:+.1f}% |")
    print(f"\nMAPE {err.mean():.1f}%, max {err.max():.1f}% over {len(rows)} runs")
    buffers = np.array([abs(100 * (r["buffers_bytes"] / r["measured_bytes"] - 1)) for r in rows])
    print(f"the buffers alone: MAPE {buffers.mean():.1f}%")
    if not args.quick:
        body = {"date": time.strftime("%Y-%m-%d %H:%M"), "rows": rows, "mape_pct": float(err.mean()),
                "max_pct": float(err.max()), "buffers_mape_pct": float(buffers.mean())}
        write_atomic(RESULTS, (json.dumps(body, indent=1) + "\n").encode())


if __name__ == "__main__":
    main()
