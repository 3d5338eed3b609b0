"""Does per-batch planning pay at scale? (issue 25, "Measured, not assumed": the predicted target), run by hand:
``python benchmarks/batch_target.py [--packs K]``; writes ``benchmarks/results/batch_target.json``.

Predicted, on ``dgx-h100`` at 64 GPUs with 8K tokens per GPU (512K-token Pile packs, ``validate_docs.pile_pack``,
seeds 1..K), llama3-8b's shape, fwd+bwd: per pack, ``plan_batch`` with its two references — per-document zigzag
Ring and the best fixed method ``search`` picks (both on the documents padded to 2N, simulated) — and the doc-place
plan both estimated (what ``plan_batch`` reports) and simulated (``simulate=True``). The target: the per-batch pick
≥ 1.3x per-document Ring and ≥ 1.1x the best fixed method, in expected step time (the means over the packs).
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
RESULTS = HERE / "results" / "batch_target.json"
RANKS = 64


def one(seed: int) -> dict:
    from plan_batch_speed import boundaries

    import meshplan
    from meshplan.search.batch import plan_batch

    cu = boundaries(seed)
    topo = meshplan.Topology.load("dgx-h100", gpus=RANKS)
    shape = meshplan.resolve(model="llama3-8b", seq_len=int(cu[-1]))
    got = plan_batch(cu, topo, RANKS, shape, cache=False)
    by_role = dict(zip(got.roles, got.candidates))
    sim = plan_batch(cu, topo, RANKS, shape, cache=False, references=False, simulate=True).candidates[0]
    fixed = by_role["best_fixed"]
    return {"seed": seed, "documents": len(cu) - 1, "longest": int(np.diff(cu).max()),
            "doc_place_s": by_role["plan"].predicted.makespan_s, "doc_place_simulated_s": sim.predicted.makespan_s,
            "per_doc_ring_s": by_role["per_doc_ring"].predicted.makespan_s,
            "best_fixed_s": fixed.predicted.makespan_s, "best_fixed": f"{fixed.algorithm} {fixed.workload.layout}",
            "best_fixed_knobs": fixed.knobs, "pick": got.best.algorithm, "pick_s": got.best.predicted.makespan_s}


def summarize(rows: list[dict]) -> dict:
    pick, ring, fixed = (np.array([r[k] for r in rows]) for k in ("pick_s", "per_doc_ring_s", "best_fixed_s"))
    est, sim = (np.array([r[k] for r in rows]) for k in ("doc_place_s", "doc_place_simulated_s"))
    return {"packs": len(rows), "pick_mean_s": float(pick.mean()), "pick_p90_s": float(np.percentile(pick, 90)),
            "per_doc_ring_mean_s": float(ring.mean()), "best_fixed_mean_s": float(fixed.mean()),
            "vs_per_doc_ring": float(ring.mean() / pick.mean()), "vs_best_fixed": float(fixed.mean() / pick.mean()),
            "vs_best_fixed_min": float((fixed / pick).min()), "doc_place_picked": sum(r["pick"] == "doc-place"
                                                                                      for r in rows),
            "estimate_error_abs_max": float(np.abs(est / sim - 1).max())}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--packs", type=int, default=20)
    args = ap.parse_args()
    rows = []
    for seed in range(1, args.packs + 1):
        r = one(seed)
        rows.append(r)
        print(f"seed {seed:2d}: {r['documents']} docs (longest {r['longest']}): "
              f"doc-place {r['doc_place_s'] * 1e3:.2f} ms"
              f" (simulated {r['doc_place_simulated_s'] * 1e3:.2f}), per-doc Ring {r['per_doc_ring_s'] * 1e3:.1f} ms, "
              f"best fixed {r['best_fixed_s'] * 1e3:.2f} ms ({r['best_fixed']}); pick {r['pick']}", flush=True)
    s = summarize(rows)
    print(f"{s['packs']} packs: pick mean {s['pick_mean_s'] * 1e3:.2f} ms (p90 {s['pick_p90_s'] * 1e3:.2f}); "
          f"{s['vs_per_doc_ring']:.2f}x per-doc Ring, {s['vs_best_fixed']:.2f}x best fixed; doc-place picked "
          f"{s['doc_place_picked']}/{s['packs']}")
    RESULTS.write_text(json.dumps({"date": time.strftime("%Y-%m-%d %H:%M"), "host": platform.node(),
                                   "topology": "dgx-h100", "ranks": RANKS, "tokens": 524288, "model": "llama3-8b",
                                   "summary": s, "rows": rows}, indent=1) + "\n")
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
