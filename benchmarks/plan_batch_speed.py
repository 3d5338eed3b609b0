"""Per-batch planning speed and the contended estimate's error (issue 25, part 1), run by hand:
``python benchmarks/plan_batch_speed.py [--packs K]``; writes ``benchmarks/results/plan_batch_speed.json``.

Budgets on this 2-core machine: ``plan_s`` (boundaries to the verified, lowered and predicted doc-place plan, cold
cache) <= 50 ms at 8 ranks and <= 100 ms at 64 ranks for a 512K-token pack, <= 1 s at 512 ranks. The packs are
Pile packs (``validate_docs.pile_pack``: the Pile's published per-component sizes and mean document lengths, one
seed per pack) of 512K tokens (230-450 documents, some with a 100K+ document), on ``dgx-h100`` (8 GPUs a node)
and llama3-8b's shape, fwd+bwd. Each pack is planned 5 times in-process after a warm-up; its ``plan_s`` is the
median and ``plan_s_min`` the fastest. This shared host's other tenants swing a run by up to 50% minutes apart
(the same 512-rank pack: 0.72 s, then 1.1 s), so a pack is judged within its budget by its fastest of the 5 —
the machine's speed, not its neighbours' (as ``timeit`` advises) — and the summary also counts the packs whose
median is within. Then once with ``simulate=True`` (at 8 and 64 ranks) for the estimate's error against the
simulator.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
RESULTS = HERE / "results" / "plan_batch_speed.json"
BUDGET_S = {8: 0.05, 64: 0.1, 512: 1.0}
REPEATS = 5


def boundaries(seed: int, tokens: int = 524288) -> np.ndarray:
    """cu_seqlens of a Pile pack (padding folded into each document)."""
    from validate_docs import pile_pack

    parts = pile_pack(tokens, seed).removeprefix("docs:").split(",")
    lens = [sum(int(x) for x in p.split("+")) for p in parts]
    return np.concatenate([[0], np.cumsum(lens)])


def one(cu: np.ndarray, ranks: int, simulate: bool) -> dict:
    import meshplan
    from meshplan.search.batch import plan_batch

    topo = meshplan.Topology.load("dgx-h100", gpus=ranks)
    shape = meshplan.resolve(model="llama3-8b", seq_len=int(cu[-1]))
    plan_batch(cu, topo, ranks, shape, cache=False, references=False)          # warm-up (imports, tables)
    times, got = [], None
    for _ in range(REPEATS):
        got = plan_batch(cu, topo, ranks, shape, cache=False, references=False)
        times.append(got.plan_s)
    plan = got.candidates[0]
    groups = [g for _, g in plan.workload.doc_ranks]
    row = {"ranks": ranks, "documents": len(cu) - 1, "longest": int(np.diff(cu).max()), "widest_group": max(groups),
           "plan_s": statistics.median(times), "plan_s_min": min(times), "plan_s_all": times,
           "estimated_s": plan.predicted.makespan_s}
    if simulate:
        sim = plan_batch(cu, topo, ranks, shape, cache=False, references=False, simulate=True)
        row["simulated_s"] = sim.candidates[0].predicted.makespan_s
        row["simulated_plan_s"] = sim.plan_s
        row["estimate_error"] = row["estimated_s"] / row["simulated_s"] - 1
    return row


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--packs", type=int, default=10)
    args = ap.parse_args()
    rows = []
    for ranks in (8, 64, 512):
        for seed in range(1, args.packs + 1):
            row = one(boundaries(seed), ranks, simulate=ranks <= 64) | {"seed": seed}
            rows.append(row)
            err = f"  estimate {row['estimate_error']:+.1%}" if "estimate_error" in row else ""
            print(f"{ranks:4d} ranks seed {seed:2d}: {row['documents']} docs, longest {row['longest']}, widest group "
                  f"{row['widest_group']:3d}: plan_s {row['plan_s'] * 1e3:7.1f} ms (fastest "
                  f"{row['plan_s_min'] * 1e3:.1f}){err}", flush=True)
    summary = {}
    for ranks, budget in BUDGET_S.items():
        mine = [r for r in rows if r["ranks"] == ranks]
        t = np.array([r["plan_s"] for r in mine])
        fastest = np.array([r["plan_s_min"] for r in mine])
        errs = np.array([abs(r["estimate_error"]) for r in mine if "estimate_error" in r])
        summary[str(ranks)] = {"packs": len(mine), "budget_s": budget, "plan_s_median": float(np.median(t)),
                               "plan_s_max": float(t.max()), "plan_s_min_max": float(fastest.max()),
                               "within_budget": int((fastest <= budget).sum()),
                               "median_within_budget": int((t <= budget).sum()),
                               "estimate_error_abs_max": float(errs.max()) if len(errs) else None,
                               "estimate_error_abs_mean": float(errs.mean()) if len(errs) else None}
        print(f"{ranks} ranks: plan_s median {np.median(t) * 1e3:.0f} ms, max {t.max() * 1e3:.0f} ms; within "
              f"{budget * 1e3:.0f} ms: {(fastest <= budget).sum()}/{len(t)} by the fastest of {REPEATS}, "
              f"{(t <= budget).sum()}/{len(t)} by the median")
    RESULTS.write_text(json.dumps({"date": time.strftime("%Y-%m-%d %H:%M"), "host": platform.node(),
                                   "python": platform.python_version(), "topology": "dgx-h100",
                                   "tokens": 524288, "summary": summary, "rows": rows}, indent=1) + "\n")
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
