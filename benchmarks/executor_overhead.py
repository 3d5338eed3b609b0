"""Executor overhead benchmark (issue 4 target), run by hand: ``python benchmarks/executor_overhead.py``.

Target: with ranks ≤ cores, the executor's overhead — the measured makespan minus the critical path of the
measured op durations (:func:`meshplan.truth.compare.executor_overhead`) — under 10% of the makespan for blocks
of 1K+ tokens. Runs Ring and pass-Q (2 ranks, zigzag chunks of ``S/2`` tokens, halves of ``S/4``) and
Mesh 1×2 on CPU ranks with gloo, normal and ``--serialize``, and writes
``benchmarks/results/executor_overhead.json``.
"""

from __future__ import annotations

import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "tests"))

CASES = [("ring", {}, 4096), ("ring", {}, 8192), ("pass-q", {}, 4096), ("mesh", {"tile": "1x2"}, 4096)]


def main() -> None:
    from exec_cases import Case

    from meshplan.core.fileio import write_atomic
    from meshplan.executor.launch import run
    from meshplan.executor.worker import RunConfig
    from meshplan.truth.compare import compare_files

    ranks = 2
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for algo, knobs, S in CASES:
            case = Case(f"{algo}-{S}", algo, ranks, knobs=knobs,
                        workload={"seq_len": S, "heads": 8, "kv_heads": 8, "head_dim": 64, "dtype": "bf16"})
            path = case.write(Path(tmp))
            for serialize in (False, True):
                t0 = time.perf_counter()
                meas = run(str(path), None, RunConfig(iters=5, warmup=2, check=False, serialize=serialize,
                                                      memory=False))
                m = Path(tmp, "m.json")
                m.write_text(json.dumps(meas))
                body = compare_files(str(path), str(m))
                for p, o in body["executor_overhead"].items():
                    rows.append({"algorithm": algo, "seq_len": S, "chunk_tokens": S // ranks,
                                 "serialize": serialize, "pass": p, "makespan_ms": round(1e3 * o["makespan_s"], 2),
                                 "critical_path_ms": round(1e3 * o["critical_path_s"], 2),
                                 "overhead_pct": round(o["overhead_pct"], 1),
                                 "predicted_ms": round(1e3 * body["end_to_end"][p]["predicted_s"], 2),
                                 "wall_s": round(time.perf_counter() - t0, 1)})
                    print(rows[-1], flush=True)
    out = {"date": time.strftime("%Y-%m-%d %H:%M"), "host": platform.processor() or platform.machine(),
           "cores": os.cpu_count(), "ranks": ranks, "target": "overhead < 10% of makespan for 1K+ token blocks",
           "rows": rows, "worst_overhead_pct": max(r["overhead_pct"] for r in rows)}
    write_atomic(HERE / "results" / "executor_overhead.json", json.dumps(out, indent=1).encode())
    print(f"worst overhead {out['worst_overhead_pct']}% (target < 10%)")


if __name__ == "__main__":
    main()
