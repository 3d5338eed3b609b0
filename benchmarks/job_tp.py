"""How the best CP plan changes with the TP size and the rank order inside a job (issue 8), by hand:
``python benchmarks/job_tp.py``.

One job of 16 GPUs on ``h100x16`` (2 nodes x 8 H100, NVSwitch, 8 NICs a node): Llama-3-70B's attention (64 query,
8 KV heads, D = 128), 128K tokens, causal, fwd+bwd. For TP = 1, 2, 4, 8 (CP = 16 / TP, DP = 1) and the rank
orders ``tp-cp-dp`` (Megatron-LM's: TP innermost, so a CP group's GPUs are TP apart, spread over both nodes
once TP ≥ 2) and ``cp-tp-dp`` (CP innermost: a CP group of ≤ 8 sits in one node), the search
(:func:`meshplan.search.run_search`) ranks one CP group's plans and :func:`meshplan.search.job_rerank.rerank_for_job`
re-ranks its best 8 by all CP groups at once. Writes ``benchmarks/results/job_tp.json``.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from meshplan.core.fileio import write_atomic
from meshplan.model.topology import Topology
from meshplan.model.workload import resolve
from meshplan.plan.job import JobShape
from meshplan.search import run_search
from meshplan.search.job_rerank import rerank_for_job

TOPO, WORLD, SEQ, MODEL, TOP = "h100x16", 16, "128K", "llama3-70b", 8


def main() -> None:
    rows = []
    job_topo = Topology.load(TOPO, gpus=WORLD)
    base = resolve(model=MODEL, seq_len=SEQ, passes="fwd+bwd")
    for tp in (1, 2, 4, 8):
        cp = WORLD // tp
        for order in ("tp-cp-dp", "cp-tp-dp"):
            if tp == 1 and order != "tp-cp-dp":
                continue                     # without TP the orders place the one CP group alike
            t0 = time.perf_counter()
            shape = JobShape(tp, cp, 1, order)
            w = shape.cp_workload(base)
            result = run_search(w, Topology.load(TOPO, gpus=cp), cp)
            job = rerank_for_job(result, shape, job_topo, TOP)
            best = result.candidates[0]
            group_best = min((c for c in result.candidates[:TOP] if c.job), key=lambda c: c.predicted.makespan_s)
            rows.append({"tp": tp, "cp": cp, "order": order, "group0": job["cp_groups"][0],
                         "algorithm": best.algorithm, "layout": best.workload.layout,
                         "knobs": {k: v for k, v in best.knobs.items() if v is not None},
                         "job_s": best.job["together_s"], "alone_s": best.job["alone_s"],
                         "group_s": best.predicted.makespan_s,
                         "group_best": f"{group_best.algorithm} {group_best.workload.layout}",
                         "group_best_job_s": group_best.job["together_s"], "wall_s": time.perf_counter() - t0})
            r = rows[-1]
            print(f"TP {tp} CP {cp} {order}: {r['algorithm']} {r['layout']} {r['knobs']} job "
                  f"{r['job_s'] * 1e3:.2f} ms (alone {r['alone_s'] * 1e3:.2f}, planned {r['group_s'] * 1e3:.2f}); "
                  f"the group-only pick {r['group_best']}: {r['group_best_job_s'] * 1e3:.2f} ms", flush=True)
    out = {"date": time.strftime("%Y-%m-%d %H:%M"), "topology": TOPO, "world": WORLD, "seq_len": SEQ,
           "model": MODEL, "top": TOP, "rows": rows}
    path = write_atomic(Path(__file__).resolve().parent / "results" / "job_tp.json",
                        (json.dumps(out, indent=1) + "\n").encode())
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
