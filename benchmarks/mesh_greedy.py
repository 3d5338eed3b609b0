"""Mesh in-tile scheduler quality (issue 3), run by hand: ``python benchmarks/mesh_greedy.py``.

1. On many small random tiles (a, b <= 4, random costs), the one-rank model's makespan of the pure greedy
   rule and of ``auto`` (best of greedy and the naive orders) against the brute-force optimum over fetch
   orders: mean and worst gap.
2. On real tiles (256 H100s of dgx-h100, 1M tokens, MHA, causal zigzag, forward), the simulated makespan of
   ``auto`` (the simulator keeps the best candidate order) against the greedy and each naive order alone.
Writes ``benchmarks/results/mesh_greedy.json``.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np

from meshplan.algorithms.mesh.order import TileCosts, brute_force, evaluate, greedy_order, plan_order
from meshplan.model.topology import Topology
from meshplan.model.workload import resolve
from meshplan.search.candidate import make_candidate, simulate_candidate


def random_tiles(count: int = 2000, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    gaps = {"greedy": [], "auto": []}
    for _ in range(count):
        a, b = int(rng.integers(2, 5)), int(rng.integers(2, 5))
        c = TileCosts(*rng.uniform(0.1, 4.0, 4))
        best = brute_force(a, b, c).makespan
        gaps["greedy"].append(evaluate(a, b, greedy_order(a, b, c), c).makespan / best - 1)
        gaps["auto"].append(plan_order(a, b, c).makespan / best - 1)
    return {k: {"mean_gap": float(np.mean(v)), "worst_gap": float(np.max(v)),
                "optimal_share": float(np.mean(np.asarray(v) < 1e-12))} for k, v in gaps.items()}


def real_tiles() -> list[dict]:
    topo = Topology.load("dgx-h100", gpus=256)
    w = resolve(heads=32, kv_heads=32, head_dim=128, passes="fwd")
    rows = []
    for tile in ("16x16", "32x8", "8x32"):
        times = {}
        for order in ("auto", "greedy", "q-first", "kv-first", "alternate"):
            c = simulate_candidate(make_candidate("mesh", w, topo, 256, {"tile": tile, "order": order}), topo, None)
            times[order] = c.predicted.makespan_s
        naive = min(times[k] for k in ("q-first", "kv-first", "alternate"))
        rows.append({"tile": tile, **{k: round(v * 1e3, 2) for k, v in times.items()},
                     "gain_over_greedy_pct": round(100 * (times["greedy"] / times["auto"] - 1), 2),
                     "gain_over_best_naive_pct": round(100 * (naive / times["auto"] - 1), 2)})
    return rows


def main() -> None:
    t0 = time.time()
    out = {"date": time.strftime("%Y-%m-%d %H:%M"), "random_tiles": random_tiles(), "real_tiles_ms": real_tiles()}
    out["wall_s"] = round(time.time() - t0, 1)
    print(json.dumps(out, indent=1))
    (Path(__file__).parent / "results").mkdir(exist_ok=True)
    (Path(__file__).parent / "results" / "mesh_greedy.json").write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
