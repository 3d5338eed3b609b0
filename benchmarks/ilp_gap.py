"""Greedy vs CP-SAT stream orders (issue 7), run by hand: ``python benchmarks/ilp_gap.py [--time-limit-s S]``.

For Mesh tiles and CHARM+ on ``l20x8`` (PCIe switches, shared uplinks) and ``h100x16`` (NVSwitch nodes, shared
NICs) at several sizes (GQA 8/2 × 64, causal zigzag, forward + backward): the greedy order's simulated makespan,
CP-SAT's order re-simulated, the solver's status, its objective and proven bound in its own model (the greedy
order timed in that model beside them), the gap and the solve time. Writes ``benchmarks/results/ilp_gap.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

from meshplan.core.fileio import write_atomic
from meshplan.cost.simulate import simulate
from meshplan.model.topology import Topology
from meshplan.model.workload import resolve
from meshplan.plan.verify import verify
from meshplan.search.candidate import make_candidate, simulate_candidate
from meshplan.search.ilp import model as ilp

CASES = [  # (topology, GPUs, sequence, algorithm, knobs)
    ("l20x8", 4, "16K", "mesh", {"tile": "2x2"}),
    ("l20x8", 8, "32K", "mesh", {"tile": "2x4"}),
    ("l20x8", 8, "32K", "mesh", {"tile": "4x2"}),
    ("l20x8", 8, "32K", "charm", {}),
    ("h100x16", 8, "32K", "mesh", {"tile": "2x4"}),
    ("h100x16", 16, "64K", "mesh", {"tile": "4x4"}),
    ("h100x16", 16, "64K", "charm", {}),
]


def one(topo_name: str, n: int, seq: str, alg: str, knobs: dict, limit_s: float) -> dict:
    topo = Topology.load(topo_name, gpus=n)
    w = resolve(seq_len=seq, heads=8, kv_heads=2, head_dim=64, layout="zigzag", mask="causal", passes="fwd+bwd")
    c = simulate_candidate(make_candidate(alg, w, topo, n, knobs), topo, None)
    r = ilp.solve(c.schedule, topo, time_limit_s=limit_s, workers=0)
    row = {"topology": topo_name, "gpus": n, "seq": seq, "algorithm": alg, "knobs": c.knobs,
           "intervals": r.n_intervals, "greedy_sim_s": c.predicted.makespan_s, "closed_form_bound_s": c.bound_s,
           "status": r.status, "objective_s": r.objective_s, "bound_s": r.bound_s, "gap": r.gap,
           "greedy_model_s": r.greedy_s, "solve_s": r.solve_s, "ilp_sim_s": None}
    if r.start_s is not None:
        new = ilp.apply_order(c.schedule, r.start_s, r.orders)
        assert verify(new, topo.memory_bytes).ok
        row["ilp_sim_s"] = sum(simulate(new, topo).pass_makespan.values())
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--time-limit-s", type=float, default=10.0)
    args = ap.parse_args()
    rows = []
    for case in CASES:
        row = one(*case, args.time_limit_s)
        rows.append(row)
        kept = min(row["greedy_sim_s"], row["ilp_sim_s"] or float("inf"))
        print(f"{row['topology']} {row['gpus']} {row['algorithm']} {row['knobs'].get('tile', '')}: greedy "
              f"{row['greedy_sim_s'] * 1e3:.3f} ms, kept {kept * 1e3:.3f} ms, {row['status']}, gap {row['gap']}, "
              f"{row['solve_s']:.1f} s", flush=True)
    out = {"date": time.strftime("%Y-%m-%d %H:%M"), "time_limit_s": args.time_limit_s, "cores": os.cpu_count(),
           "rows": rows}
    path = write_atomic(Path(__file__).resolve().parent / "results" / "ilp_gap.json",
                        (json.dumps(out, indent=1) + "\n").encode())
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
