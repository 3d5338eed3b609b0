"""Validation on our own runs: predicted vs measured makespan and CCR on CPU ranks (gloo), every candidate
that search proposes for a set of workloads (COSTMODEL.md, "Validation"; a benchmark, not a CI gate).

``python benchmarks/validate_cpu.py [--quick]`` — for each workload and rank count (2 ranks: ranks ≤ cores;
4 ranks on the 2 cores: the shared-core pool modelled, reported separately), every candidate of ``meshplan
search`` (all methods, knobs and layouts it enumerates, each planned and simulated on ``cpu-local``) is
written, run ``--iters`` times after a warm-up with the executor, and compared: end-to-end makespan error
(MAPE, max), Kendall τ over the pairs of one workload whose measured medians differ by more than 2σ (σ from
the interquartile range of the timed iterations, IQR / 1.349, of the two candidates), and top-1 regret per
workload. Ring's CCR (CHARM+ definition) is predicted by ``ring_ccr`` and measured from a ``--serialize``
run of Ring (max over ranks of Σ compute / max over ranks of Σ transfer time, ops one at a time).

The calibration (``meshplan calibrate``) measures kernels, point-to-point transfers, one overlap run and
core sharing; it never runs these schedules, so calibration and validation use different workloads.
Results: ``benchmarks/results/validate_cpu.json``.
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
sys.path.insert(0, str(HERE.parent))

from meshplan.errors import SkipCandidate, UserError  # noqa: E402
from meshplan.fileio import write_atomic  # noqa: E402
from meshplan.predict import predict  # noqa: E402
from meshplan.schedule_io import write_schedule  # noqa: E402
from meshplan.search import run_search  # noqa: E402
from meshplan.topology import Topology  # noqa: E402
from meshplan.workload import resolve  # noqa: E402

# (label, workload flags): sequence length, GQA ratio, mask, dtype and pass vary.
WORKLOADS = [
    ("S4K MHA causal fp32 fwd+bwd", dict(seq_len=4096, heads=4, kv_heads=4, head_dim=64, mask="causal",
                                         dtype="fp32", passes="fwd+bwd")),
    ("S8K GQA4 causal bf16 fwd", dict(seq_len=8192, heads=8, kv_heads=2, head_dim=64, mask="causal",
                                      dtype="bf16", passes="fwd")),
    ("S4K GQA4 full fp32 fwd", dict(seq_len=4096, heads=4, kv_heads=1, head_dim=64, mask="full", dtype="fp32",
                                    passes="fwd")),
    ("S2K MHA full bf16 fwd+bwd", dict(seq_len=2048, heads=8, kv_heads=8, head_dim=128, mask="full",
                                       dtype="bf16", passes="fwd+bwd")),
    ("S16K MHA causal fp32 fwd", dict(seq_len=16384, heads=2, kv_heads=2, head_dim=32, mask="causal",
                                      dtype="fp32", passes="fwd")),
]


def candidates(w, topo, n: int) -> list:
    """Every candidate search enumerates, each planned and simulated (one per distinct label)."""
    res = run_search(w, topo, n, prune_slack=0.0)
    seen, out = set(), []
    for c in res.candidates:
        knobs = {k: v for k, v in c.knobs.items() if not (k == "order" and str(v).startswith("auto:"))}
        wl = c.workload
        key = (c.algorithm, wl.layout, json.dumps(knobs, sort_keys=True, default=str))
        if key in seen or c.forward_only and wl.passes != "fwd":
            continue
        seen.add(key)
        try:
            out.append(predict(c.algorithm, wl, topo, n, knobs))
        except (UserError, SkipCandidate):
            continue
    return out


def measure(path: str, n: int, iters: int, warmup: int, serialize: bool = False) -> dict:
    """Run a schedule file with the executor (spawned gloo ranks); the Measurement body."""
    from meshplan.executor.launch import run
    from meshplan.executor.worker import RunConfig

    cfg = RunConfig(backend="gloo", iters=iters, warmup=warmup, check=False, serialize=serialize, timeout_s=300.0)
    return run(path, n, cfg)


def serialized_ccr(body: dict, path: str) -> float:
    """Max over ranks of Σ compute over max over ranks of Σ transfer time, from a --serialize run."""
    from meshplan.schedule_io import read_document

    doc, _ = read_document(path)
    kind = {op.id: op.kind for r in doc.ranks for op in r.ops}
    comp, comm = np.zeros(len(doc.ranks)), np.zeros(len(doc.ranks))
    for r in body["ranks"]:
        for op in r["ops"]:
            d = op["end_s"] - op["start_s"]
            if kind[op["id"]] == "compute":
                comp[r["rank"]] += d
            elif kind[op["id"]] in ("send", "recv"):
                comm[r["rank"]] += d
    return float(comp.max() / comm.max()) if comm.max() > 0 else float("nan")


def run_workload(label: str, flags: dict, n: int, iters: int, warmup: int, tmp: Path) -> dict:
    """All candidates of one workload on n ranks: predicted, measured, errors, τ and regret."""
    topo = Topology.load("cpu-local", gpus=n)
    w = resolve(**flags)
    rows = []
    for i, c in enumerate(candidates(w, topo, n)):
        path = tmp / f"{n}-{i}.json"
        write_schedule(c.schedule, path)
        body = measure(str(path), n, iters, warmup)
        sp = body["makespan_spread"]
        rows.append({"algorithm": c.algorithm, "layout": c.workload.layout, "knobs": c.knobs,
                     "predicted_s": c.predicted["makespan_s"], "measured_s": body["makespan_s"],
                     "sigma_s": (sp["p75_s"] - sp["p25_s"]) / 1.349, "min_s": sp["min_s"], "max_s": sp["max_s"]})
        rows[-1]["error_pct"] = 100 * (rows[-1]["predicted_s"] / rows[-1]["measured_s"] - 1)
        r = rows[-1]
        print(f"  {n} ranks  {label:30s} {c.algorithm:10s} {c.workload.layout:10s} pred {r['predicted_s'] * 1e3:8.2f}"
              f" ms  meas {r['measured_s'] * 1e3:8.2f} ms  {r['error_pct']:+6.1f}%", file=sys.stderr)
    ccr = None
    try:        # Ring's CCR on the forward pass (a serialized backward ring can deadlock: refused)
        ring = predict("ring", w.with_(layout="contiguous", passes="fwd"), topo, n, {})
        path = tmp / f"{n}-ring-serial.json"
        write_schedule(ring.schedule, path)
        body = measure(str(path), n, 1, 1, serialize=True)
        ccr = {"predicted": ring.predicted.get("ring_ccr"), "measured": serialized_ccr(body, str(path))}
    except UserError as err:
        print(f"  no CCR for {label} on {n} ranks: {err}", file=sys.stderr)
    return {"workload": label, "ranks": n, "rows": rows, "ring_ccr": ccr, **ranking(rows)}


def ranking(rows: list[dict]) -> dict:
    """Kendall τ over pairs whose measured medians differ by more than 2σ, and top-1 regret."""
    agree = disagree = 0
    for i in range(len(rows)):
        for j in range(i + 1, len(rows)):
            a, b = rows[i], rows[j]
            if abs(a["measured_s"] - b["measured_s"]) <= 2 * max(a["sigma_s"], b["sigma_s"]):
                continue
            same = (a["measured_s"] < b["measured_s"]) == (a["predicted_s"] < b["predicted_s"])
            agree, disagree = agree + same, disagree + (not same)
    pick = min(rows, key=lambda r: r["predicted_s"])
    best = min(r["measured_s"] for r in rows)
    return {"pairs": agree + disagree, "concordant": agree, "discordant": disagree,
            "regret_pct": 100 * (pick["measured_s"] - best) / best}


def summary(results: list[dict]) -> dict:
    """Per rank count: MAPE and max of makespan, τ over the pooled pairs, worst and mean regret."""
    out = {}
    for n in sorted({r["ranks"] for r in results}):
        sub = [r for r in results if r["ranks"] == n]
        errs = np.abs([row["error_pct"] for r in sub for row in r["rows"]])
        c, d = sum(r["concordant"] for r in sub), sum(r["discordant"] for r in sub)
        out[str(n)] = {"pairs_run": int(len(errs)), "mape_pct": float(errs.mean()),
                       "max_abs_error_pct": float(errs.max()),
                       "kendall_tau": (c - d) / (c + d) if c + d else None, "tau_pairs": c + d,
                       "regret_pct_max": max(r["regret_pct"] for r in sub),
                       "regret_pct_mean": float(np.mean([r["regret_pct"] for r in sub]))}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="two workloads, 2 ranks, 2 iterations")
    ap.add_argument("--iters", type=int, default=5)
    args = ap.parse_args()
    t0 = time.perf_counter()
    plan = [(2, WORKLOADS), (4, WORKLOADS)] if not args.quick else [(2, WORKLOADS[:2])]
    iters = 2 if args.quick else args.iters
    results = []
    with tempfile.TemporaryDirectory() as d:
        for n, wls in plan:
            for label, flags in wls:
                results.append(run_workload(label, flags, n, iters, 2, Path(d)))
    body = {"date": time.strftime("%Y-%m-%d"), "topology": "cpu-local", "iters": iters,
            "summary": summary(results), "workloads": results, "wall_s": time.perf_counter() - t0}
    if not args.quick:
        write_atomic(HERE / "results" / "validate_cpu.json", json.dumps(body, indent=1, default=str).encode())
    print(json.dumps(body["summary"], indent=1))


if __name__ == "__main__":
    main()
