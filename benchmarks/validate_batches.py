"""Per-batch planning, predicted and measured on CPU ranks: does the per-batch plan win where the model says?

``python benchmarks/validate_batches.py [--packs 20] [--ranks 2,4] [--rounds 3] [--quick] [--repredict]`` — for
each rank count, ``--packs`` packs of 2,048 tokens per rank drawn from The Pile's published document sizes (the mix of
``validate_docs.py``: its Table 1, arXiv 2101.00027, each document padded to a multiple of 8), fp32, 4 heads ×
64, forward and backward. Per pack, :func:`meshplan.plan_batch` on ``cpu-local`` gives three candidates — the
doc-place plan, per-document zigzag Ring and the best fixed method ``search`` picks — each predicted as
``plan_batch`` predicts them (doc-place by the contended closed form, the references simulated; the shipped
calibration); the three schedules then run interleaved in one spawned world (gloo), ``--rounds`` rounds, median
per candidate.

Reported per rank count: the measured and predicted speedups of the per-batch pick over per-document Ring and
over the best fixed method (geometric means over the packs), each candidate's prediction error (MAPE), and the
planner's regret: (measured time of the candidate plan_batch picks − the fastest measured of the three) / the
fastest, mean and max over the packs. Results: ``benchmarks/results/validate_batches.json``.
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
RESULTS = HERE / "results" / "validate_batches.json"
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

import validate_cpu  # noqa: E402  (beside this file)
import validate_docs  # noqa: E402

from meshplan.core.fileio import write_atomic  # noqa: E402

TOKENS_PER_RANK = 2048
SHAPE = dict(heads=4, kv_heads=4, head_dim=64, dtype="fp32", passes="fwd+bwd")


def pack_lengths(seq_len: int, seed: int) -> np.ndarray:
    """Document slots (real + padding) of a Pile pack, as ``validate_docs.pile_pack`` draws it."""
    parts = validate_docs.pile_pack(seq_len, seed).removeprefix("docs:").split(",")
    return np.array([sum(int(x) for x in p.split("+")) for p in parts], dtype=np.int64)


def run_pack(n: int, seed: int, rounds: int, tmp: Path) -> dict:
    """One pack on n ranks: plan_batch's three candidates predicted, then measured interleaved."""
    import meshplan
    from meshplan.plan.json.io import write_schedule
    from meshplan.search.batch import plan_batch

    lens = pack_lengths(TOKENS_PER_RANK * n, seed)
    cu = np.concatenate([[0], np.cumsum(lens)])
    topo = meshplan.Topology.load("cpu-local", gpus=n)
    shape = meshplan.resolve(seq_len=int(cu[-1]), **SHAPE)
    got = plan_batch(cu, topo, n, shape, cache=False)
    paths = []
    for k, c in enumerate(got.candidates):
        paths.append(str(tmp / f"{n}-{seed}-{k}.json"))
        write_schedule(c.schedule, paths[-1])
    measured = validate_cpu.measure_interleaved(paths, rounds)
    rows = []
    for c, role, m in zip(got.candidates, got.roles, measured):
        t = [x for x, _ in m]
        rows.append({"role": role, "algorithm": c.algorithm, "layout": c.workload.layout, "knobs": c.knobs,
                     "model_level": c.model_level, "predicted_s": c.predicted.makespan_s,
                     "measured_s": float(np.median(t)), "rounds_s": t,
                     "probe_ms": [p for _, p in m]})
    pick = got.candidates.index(got.best)
    fastest = min(r["measured_s"] for r in rows)
    out = {"ranks": n, "seed": seed, "documents": len(lens), "longest": int(lens.max()), "plan_s": got.plan_s,
           "pick": pick, "rows": rows, "regret_pct": 100 * (rows[pick]["measured_s"] / fastest - 1)}
    print(f"  {n} ranks pack {seed}: {len(lens)} docs, pick {rows[pick]['algorithm']} "
          + ", ".join(f"{r['role']} pred {r['predicted_s'] * 1e3:.0f} meas {r['measured_s'] * 1e3:.0f} ms"
                      for r in rows) + f"; regret {out['regret_pct']:.1f}%", file=sys.stderr, flush=True)
    return out


def repredict(body: dict) -> dict:
    """The stored measurements against this code's predictions: every pack planned again (the same documents),
    each role's prediction replaced, the pick and its regret recomputed. Refused when the calibration changed or a
    role's method is no longer the one that was measured."""
    import meshplan
    from meshplan.search.batch import plan_batch

    if body.get("calibration") != validate_cpu._calibration_stamp():
        raise SystemExit("validate_batches --repredict: the calibration changed since these runs; run them again")
    for p in body["packs"]:
        n = p["ranks"]
        lens = pack_lengths(TOKENS_PER_RANK * n, p["seed"])
        cu = np.concatenate([[0], np.cumsum(lens)])
        got = plan_batch(cu, meshplan.Topology.load("cpu-local", gpus=n), n,
                         meshplan.resolve(seq_len=int(cu[-1]), **SHAPE), cache=False)
        for row, c, role in zip(p["rows"], got.candidates, got.roles):
            if (row["role"], row["algorithm"], row["layout"]) != (role, c.algorithm, c.workload.layout):
                raise SystemExit(f"validate_batches --repredict: pack {p['seed']} on {n} ranks now plans {role} "
                                 f"as {c.algorithm} {c.workload.layout}, not the measured {row['algorithm']}")
            row["predicted_s"] = c.predicted.makespan_s
        p["pick"] = min(range(len(p["rows"])), key=lambda k: p["rows"][k]["predicted_s"])
        fastest = min(r["measured_s"] for r in p["rows"])
        p["regret_pct"] = 100 * (p["rows"][p["pick"]]["measured_s"] / fastest - 1)
    body["summary"] = summary(body["packs"])
    body["repredicted"] = time.strftime("%Y-%m-%d %H:%M")
    return body


def summary(packs: list[dict]) -> dict:
    """Per rank count: speedups of the pick (measured, predicted), MAPE per role, the planner's regret."""
    out = {}
    for n in sorted({p["ranks"] for p in packs}):
        mine = [p for p in packs if p["ranks"] == n]
        s = {"packs": len(mine)}
        for ref in ("per_doc_ring", "best_fixed"):
            for kind in ("measured_s", "predicted_s"):
                ratios = [next(r for r in p["rows"] if r["role"] == ref)[kind] / p["rows"][p["pick"]][kind]
                          for p in mine if any(r["role"] == ref for r in p["rows"])]
                s[f"speedup_vs_{ref}_{kind[:-2]}"] = float(np.exp(np.mean(np.log(ratios)))) if ratios else None
        for role in ("plan", "per_doc_ring", "best_fixed"):
            errs = [abs(r["predicted_s"] / r["measured_s"] - 1) for p in mine for r in p["rows"] if r["role"] == role]
            s[f"mape_pct_{role}"] = 100 * float(np.mean(errs)) if errs else None
        s["regret_pct_mean"] = float(np.mean([p["regret_pct"] for p in mine]))
        s["regret_pct_max"] = float(np.max([p["regret_pct"] for p in mine]))
        s["picked"] = {a: sum(1 for p in mine if p["rows"][p["pick"]]["algorithm"] == a)
                       for a in sorted({p["rows"][p["pick"]]["algorithm"] for p in mine})}
        out[str(n)] = s
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--packs", type=int, default=20)
    ap.add_argument("--ranks", default="2,4")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="2 packs on 2 ranks, 2 rounds (results not written)")
    ap.add_argument("--repredict", action="store_true",
                    help="no runs: the stored measurements against this code's predictions (rewrites the results)")
    args = ap.parse_args()
    if args.repredict:
        body = repredict(json.loads(RESULTS.read_text()))
        write_atomic(RESULTS, json.dumps(body, indent=1, default=str).encode())
        print(json.dumps(body["summary"], indent=1))
        return
    ranks = [2] if args.quick else [int(x) for x in args.ranks.split(",")]
    packs_n, rounds = (2, 2) if args.quick else (args.packs, args.rounds)
    t0 = time.perf_counter()
    packs = []
    with tempfile.TemporaryDirectory() as d:
        for n in ranks:
            for seed in range(packs_n):
                packs.append(run_pack(n, 100 + seed, rounds, Path(d)))
    body = {"date": time.strftime("%Y-%m-%d %H:%M"), "topology": "cpu-local", "rounds": rounds,
            "tokens_per_rank": TOKENS_PER_RANK, "shape": SHAPE, "calibration": validate_cpu._calibration_stamp(),
            "summary": summary(packs), "packs": packs, "wall_s": time.perf_counter() - t0}
    if not args.quick:
        write_atomic(RESULTS, json.dumps(body, indent=1, default=str).encode())
    print(json.dumps(body["summary"], indent=1))


if __name__ == "__main__":
    main()
