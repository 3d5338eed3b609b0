"""Simulating packed documents: ``meshplan simulate`` of Ring, USP, Ulysses, LoongTrain and Mesh over a pack of
~250 documents at 64 ranks, and Ring over ~1,000 documents at 256 ranks, wall time and peak memory per run.

Budgets (issue 24, part 3, on a 2-core host): <= 5 s and <= 2 GB each at 64 ranks over 512K tokens; <= 30 s at
256 ranks over 2M tokens (8K per rank). The packs are synthetic: document lengths drawn log-normal (sigma 1,
seed 0) and scaled to the pack (not a dataset's distribution: this measures the planner, not accuracy), each
document padded to a multiple of 2N for the per-document zigzag layout (the padding ``meshplan`` suggests).
Each run is its own process (``python -m meshplan``), timed from outside; its peak RSS is its own. The 64-rank
rows also carry their makespan priced as before documents were (``makespan_one_kernel_s``: every op one kernel of
its block's shape; docs/cost-model.md, Documents), to show what pricing the segments changes.

    python benchmarks/doc_masks.py            # writes benchmarks/results/doc_masks.json
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results" / "doc_masks.json"
HEADS = ["--heads", "64", "--kv-heads", "8", "--head-dim", "128"]      # 64 heads: Ulysses fits 64 ranks
METHODS_64 = ("ring", "usp", "ulysses", "loongtrain", "mesh")
# the child reports its own peak RSS (KiB on Linux) as its last stderr line
PROBE = ("import atexit, resource, runpy, sys\n"
         "atexit.register(lambda: sys.stderr.write(f\"\\nmaxrss_kb {resource.getrusage(resource.RUSAGE_SELF)"
         ".ru_maxrss}\\n\"))\n"
         "sys.argv = ['meshplan'] + sys.argv[1:]\n"
         "runpy.run_module('meshplan', run_name='__main__')\n")


def pack(tokens: int, docs: int, ranks: int, seed: int = 0) -> tuple[str, int]:
    """(``--mask docs:...`` with each document padded to a multiple of 2·ranks, the padded length)."""
    x = np.random.default_rng(seed).lognormal(0.0, 1.0, docs)
    lens = np.maximum(1, np.floor(x / x.sum() * tokens)).astype(int)
    lens[-1] += tokens - lens.sum()
    unit = 2 * ranks
    pads = (-lens) % unit
    spec = ",".join(f"{n}+{p}" if p else str(n) for n, p in zip(lens, pads))
    return f"docs:{spec}", int((lens + pads).sum())


def run(method: str, ranks: int, tokens: int, docs: int) -> dict:
    """One ``meshplan simulate`` in its own process: wall seconds, peak RSS, the predicted makespan."""
    mask, seq = pack(tokens, docs, ranks)
    args = ["simulate", "--algo", method, "--gpus", str(ranks), "--topo", "h100x32", "--seq-len", str(seq),
            "--mask", mask, *HEADS, "--json"]
    t0 = time.perf_counter()
    p = subprocess.run([sys.executable, "-c", PROBE, *args], capture_output=True, text=True, timeout=1800)
    wall = time.perf_counter() - t0
    rss = [int(line.split()[1]) for line in p.stderr.splitlines() if line.startswith("maxrss_kb")]
    row = {"method": method, "ranks": ranks, "tokens": seq, "tokens_unpadded": tokens, "documents": docs,
           "wall_s": round(wall, 2),
           "peak_rss_MB": round(rss[-1] / 1024, 1) if rss else None, "exit": p.returncode}
    if p.returncode == 0:
        row["makespan_s"] = json.loads(p.stdout)["predicted"]["makespan_s"]
    else:
        row["error"] = p.stderr.strip().splitlines()[0][:200] if p.stderr.strip() else ""
    print(f"{method:10s} {ranks:4d} ranks {docs:5d} docs: {row['wall_s']:6.2f} s, {row['peak_rss_MB']} MB",
          file=sys.stderr)
    return row


def as_one_kernel(rows: list[dict]) -> None:
    """Each 64-rank row's makespan as it was priced before documents were (every op one kernel of its block's
    shape, FLOPs of its permitted pairs): the segment pricing's effect, in this process."""
    sys.path.insert(0, str(HERE.parent))
    from meshplan.cost.cost import CostModel
    from meshplan.model.topology import Topology
    from meshplan.model.workload import resolve
    from meshplan.search.candidate import predict

    topo = Topology.load("h100x32", gpus=64)
    own = CostModel._doc_compute
    for row in rows:
        if row["ranks"] != 64 or row["exit"]:
            continue
        mask, seq = pack(row["tokens_unpadded"], row["documents"], 64)
        w = resolve(seq_len=seq, mask=mask, heads=64, kv_heads=8, head_dim=128)
        try:
            CostModel._doc_compute = lambda self, sched, dur: None
            row["makespan_one_kernel_s"] = predict(row["method"], w, topo, 64, {}).predicted.makespan_s
        finally:
            CostModel._doc_compute = own


def main() -> None:
    rows = [run(m, 64, 512 * 1024, 250) for m in METHODS_64] + [run("ring", 256, 2 * 1024 * 1024, 1000)]
    as_one_kernel(rows)
    body = {"date": time.strftime("%Y-%m-%d %H:%M"), "cores": 2, "topology": "h100x32",
            "budget": {"64": {"wall_s": 5, "peak_MB": 2048}, "256": {"wall_s": 30}}, "rows": rows}
    RESULTS.write_text(json.dumps(body, indent=1) + "\n")
    print(f"wrote {RESULTS}", file=sys.stderr)


if __name__ == "__main__":
    main()
