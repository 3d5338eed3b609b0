"""Every method of the registry on the shipped GPU topologies: the best predicted time of each.

``python benchmarks/baselines_table.py`` prints Markdown tables (rows: methods, columns: topologies) and
writes ``benchmarks/results/baselines_table.json``. Two workloads: (A) the llama3-8b shape (32 query heads,
8 KV heads, head dim 128), bf16, causal, S = 120,960 tokens (a multiple of 2·N·(N−1) for TASP at 8 and 16
ranks), forward + backward — TASP is forward only (its cell shows its forward time, marked); (B) the CHARM+
paper's shape (12 heads × 192, MHA, full attention), B = 16, S = 26,880, forward — communication matters
more. Each cell is the best of that method's knob settings and layouts (``meshplan search --algos NAME
--prune-slack 0``). The model is not calibrated (docs/accuracy.md): predictions, not measurements.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

from meshplan.algorithms import NAMES  # noqa: E402
from meshplan.core.fileio import write_atomic  # noqa: E402
from meshplan.model.topology import Topology  # noqa: E402
from meshplan.model.workload import resolve  # noqa: E402
from meshplan.search import run_search  # noqa: E402

TOPOLOGIES = [("h100x8", 8), ("h100x16", 16), ("h20x16", 16), ("l20x8", 8), ("a100x8", 8)]
WORKLOADS = {"A: llama3-8b, S=120960, fwd+bwd, causal": dict(seq_len=120_960, passes="fwd+bwd"),
             "B: charm-h100 (12x192 MHA), B=16, S=26880, fwd, full": dict(model="charm-h100", batch=16,
                                                                        seq_len=26_880, passes="fwd")}


def main() -> None:
    t0 = time.perf_counter()
    out = {"date": time.strftime("%Y-%m-%d %H:%M"), "topologies": TOPOLOGIES, "tables": {}}
    for title, spec in WORKLOADS.items():
        rows = table(resolve(**spec))
        print(f"\n**{title}**\n")
        print(markdown(rows))
        out["tables"][title] = rows
    out["wall_s"] = time.perf_counter() - t0
    write_atomic(HERE / "results" / "baselines_table.json", json.dumps(out, indent=1, default=str).encode())
    print(f"\n{time.perf_counter() - t0:.1f} s", file=sys.stderr)


def table(w) -> dict:
    """method -> topology -> best candidate summary (or the skip reasons)."""
    rows: dict[str, dict[str, dict]] = {name: {} for name in NAMES}
    for topo_name, n in TOPOLOGIES:
        topo = Topology.load(topo_name, gpus=n)
        for name in NAMES:
            res = run_search(w, topo, n, algos=[name], prune_slack=0.0)
            best = res.candidates[0] if res.candidates else None
            if best is None:
                rows[name][topo_name] = {"skipped": sorted(res.counts["skipped"])}
                continue
            p = best.predicted.json()
            fwd_only = p.get("bwd", 0) is None
            rows[name][topo_name] = {"makespan_s": p["fwd"]["makespan_s"] if fwd_only else p["makespan_s"],
                                     "forward_only": fwd_only, "layout": best.workload.layout,
                                     "knobs": {k: v for k, v in best.knobs.items() if v is not None}}
    return rows


def markdown(rows: dict) -> str:
    header = "| method | " + " | ".join(f"{t} ({n})" for t, n in TOPOLOGIES) + " |"
    lines = [header, "|" + "---|" * (len(TOPOLOGIES) + 1)]
    for name in NAMES:
        cells = []
        for t, _ in TOPOLOGIES:
            cell = rows[name][t]
            if "skipped" in cell:
                cells.append("— (" + "; ".join(cell["skipped"]) + ")")
            else:
                cells.append(f"{cell['makespan_s'] * 1e3:.1f} ms" + (" (fwd)" if cell["forward_only"] else ""))
        lines.append(f"| `{name}` | " + " | ".join(cells) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
