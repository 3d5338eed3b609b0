"""Validation on our own runs: predicted vs measured makespan and CCR on CPU ranks (gloo), every candidate
that search proposes for a set of workloads (docs/cost-model.md, "Validation"; a benchmark, not a CI gate).

``python benchmarks/validate_cpu.py [--quick] [--rounds R]`` — for each workload and rank count (2 ranks: ranks
≤ cores; 4 ranks on the 2 cores: the shared-core pool modelled, reported separately), every candidate of
``meshplan search`` (all methods, knobs and layouts it enumerates, each planned and simulated on ``cpu-local``;
CHARM+ with ``--domains 2``, since CPU ranks must declare domains) is written and run by the executor. The
candidates of one workload run in one spawned world, **interleaved**: R rounds, each running every candidate
once after one warm-up iteration, so the host's speed drift (±15% over tens of seconds on this shared VM)
falls on all candidates alike; a candidate's measured time is the median of its R rounds and σ their
standard deviation. Reported: end-to-end makespan error (MAPE, max), Kendall τ over the pairs of one workload
whose measured medians differ by more than 2σ (the larger σ of the two), top-1 regret per workload (also
counting only candidates faster than the pick by more than 2σ), and the host's drift: the executor times a fixed
probe kernel before every timed iteration (:mod:`meshplan.executor.probe`), and the same metrics are given again
("adjusted") against each round's makespan rescaled to the calibration's host speed (× calibration probe / that
round's probe).

The fastest of ~30 noisy medians is the luckiest one, so plain regret is biased upwards; a **race** measures the
pick's regret instead (:mod:`validate_stats`): the candidates stage 1 cannot tell from the fastest (within 2σ,
at most 8) and the pick run ``--race-rounds`` more interleaved rounds, and the pick is compared with them paired
by round, plainly and held out (the fastest on half the rounds timed against the pick on the other half).

Ring's CCR (CHARM+ definition, zigzag, forward) is predicted by ``ring_ccr`` and measured from a
``--serialize`` run of that Ring schedule: max over ranks of Σ compute over max over ranks of Σ transfer time,
a transfer counted from when both its sides had posted (:func:`meshplan.truth.compare.transfer_spans`), so a
serialized recv does not count the time its peer spent computing.

The calibration (``meshplan calibrate``) measures kernels, point-to-point transfers, one overlap run and
core sharing; it never runs these schedules, so calibration and validation use different workloads.
Results: ``benchmarks/results/validate_cpu.json``. ``--repredict`` compares the stored measurements with this
code's predictions without running anything (a model change; the same calibration only).
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
RESULTS = HERE / "results" / "validate_cpu.json"
sys.path.insert(0, str(HERE.parent))

import validate_stats  # noqa: E402  (beside this file)

from meshplan.core.errors import SkipCandidate, UserError  # noqa: E402
from meshplan.core.fileio import write_atomic  # noqa: E402
from meshplan.model.topology import Topology  # noqa: E402
from meshplan.model.workload import resolve  # noqa: E402
from meshplan.plan.json.io import write_schedule  # noqa: E402
from meshplan.search import run_search  # noqa: E402
from meshplan.search.candidate import predict  # noqa: E402

# (label, workload flags): sequence length, GQA ratio, mask, dtype, head dim and pass vary.
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
    """Every candidate search enumerates (and CHARM+ with 2 domains), each planned and simulated, one per label."""
    found = list(run_search(w, topo, n, prune_slack=0.0).candidates)
    try:
        found += run_search(w, topo, n, algos=["charm"], filters={"domains": 2}, prune_slack=0.0).candidates
    except (UserError, SkipCandidate):
        pass
    seen, out = set(), []
    for c in found:
        knobs = _explicit_knobs(c.knobs)
        wl = c.workload
        key = (c.algorithm, wl.layout, json.dumps(knobs, sort_keys=True, default=str))
        if key in seen or c.forward_only and wl.passes != "fwd":
            continue
        seen.add(key)
        try:
            out.append(predict(c.algorithm, wl, topo, n, knobs))
        except (UserError, SkipCandidate) as err:
            print(f"  skipped {c.algorithm} {wl.layout} {knobs}: {err}", file=sys.stderr)
    return out


def _explicit_knobs(knobs: dict) -> dict:
    """A candidate's knobs as ``predict`` takes them again: set ones only, an ``auto:`` order left to choose."""
    return {k: v for k, v in knobs.items() if v is not None and not (k == "order" and str(v).startswith("auto:"))}


def _as_run(knobs: dict) -> dict:
    """A stored candidate's knobs with an ``auto:`` order resolved to the order that ran (``--repredict``: a
    changed model must price the schedule that was measured, not choose another)."""
    return {k: str(v).removeprefix("auto:") if k == "order" else v
            for k, v in knobs.items() if v is not None}


def _ccr_ring(w, topo, n: int):
    """Ring on the forward pass in zigzag: the schedule whose CCR is predicted and measured."""
    return predict("ring", w.with_(layout="zigzag", passes="fwd"), topo, n, {})


def measure_interleaved(paths: list[str], rounds: int, timeout_s: float = 600.0) -> list[list[tuple[float, float]]]:
    """Run the schedules (one rank count) in one spawned world, ``rounds`` times interleaved, each once after one
    warm-up iteration; per schedule (makespan, host-speed probe ms just before it) in every round."""
    from meshplan.executor.launch import run_batch
    from meshplan.executor.worker import RunConfig

    cfg = RunConfig(backend="gloo", iters=1, warmup=1, check=False, timeout_s=timeout_s, memory=False)
    bodies = run_batch([(p, cfg) for _ in range(rounds) for p in paths])
    return [[(b["makespan_s"], b["env"]["probe_ms"]) for b in bodies[i::len(paths)]] for i in range(len(paths))]


def serialized_ccr(path: str) -> float:
    """Ring's CCR from a ``--serialize`` run: max over ranks of Σ compute over max over ranks of Σ transfer time
    (each transfer from when both sides had posted; a batch counts its longest transfer)."""
    from meshplan.executor.launch import run
    from meshplan.executor.worker import RunConfig
    from meshplan.plan.json.io import from_json, read_document
    from meshplan.plan.schedule import COMPUTE
    from meshplan.truth.compare import transfer_spans

    body = run(path, None, RunConfig(backend="gloo", iters=3, warmup=1, check=False, serialize=True,
                                     timeout_s=600.0, memory=False))
    doc, _ = read_document(path)
    sched = from_json(doc)
    index = {op.id: i for i, op in enumerate(op for r in doc.ranks for op in r.ops)}
    start, end = np.full(len(index), np.nan), np.full(len(index), np.nan)
    for r in body["ranks"]:
        for op in r["ops"]:
            start[index[op["id"]]], end[index[op["id"]]] = op["start_s"], op["end_s"]
    o = sched.ops
    comp = np.zeros(sched.n_ranks)
    np.add.at(comp, o.rank[o.kind == COMPUTE], (end - start)[o.kind == COMPUTE])
    spans = transfer_spans(sched, start, end)
    comm = np.zeros(sched.n_ranks)
    for (rank, phase, step) in {(int(a), int(b), int(c)) for a, b, c in zip(o.rank, o.phase, o.step) if c >= 0}:
        sel = (o.rank == rank) & (o.phase == phase) & (o.step == step)
        comm[rank] += spans[sel].max()
    return float(comp.max() / comm.max()) if comm.max() > 0 else float("nan")


def probe_ms() -> float:
    """A fixed kernel (fp32, 4 heads × 1024² × 64, forward, one thread) in this process: the host's speed now."""
    import torch

    from meshplan.executor.kernels import block_forward

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 4, 1024, 64, generator=g) for _ in range(3))
    block_forward(q, k, v, 0.125, None)
    times = []
    for _ in range(7):
        t0 = time.perf_counter()
        block_forward(q, k, v, 0.125, None)
        times.append(time.perf_counter() - t0)
    torch.set_num_threads(before)
    return float(np.median(times) * 1e3)


def run_workload(label: str, flags: dict, n: int, rounds: int, race_rounds: int, tmp: Path) -> dict:
    """All candidates of one workload on n ranks: predicted, measured, errors, τ and regret; then the race (the
    contenders of stage 1 and the pick, ``race_rounds`` more interleaved rounds) for the pick's regret."""
    topo = Topology.load("cpu-local", gpus=n)
    w = resolve(**flags)
    cands = candidates(w, topo, n)
    paths = []
    for i, c in enumerate(cands):
        paths.append(str(tmp / f"{n}-{i}.json"))
        write_schedule(c.schedule, paths[-1])
    probes = [probe_ms()]
    measured = measure_interleaved(paths, rounds)
    probes.append(probe_ms())
    ref = topo.calibration.host_probe_ms if topo.calibration is not None else None
    rows = [_row(c, got, ref) for c, got in zip(cands, measured)]
    for c, r in zip(cands, rows):
        print(f"  {n} ranks  {label:30s} {c.algorithm:10s} {c.workload.layout:10s} pred {r['predicted_s'] * 1e3:8.2f}"
              f" ms  meas {r['measured_s'] * 1e3:8.2f} ms  {r['error_pct']:+6.1f}%  at calibration speed "
              f"{r['adjusted_error_pct']:+6.1f}%", file=sys.stderr)
    race = None
    if race_rounds:
        idx = validate_stats.contenders(rows)
        got = measure_interleaved([paths[i] for i in idx], race_rounds)
        race = {"candidates": idx, "rounds_s": [[m for m, _ in g] for g in got],
                "probe_ms": [[p for _, p in g] for g in got]}
    ccr = None
    try:        # Ring's CCR on the forward pass (a serialized backward ring can deadlock: refused)
        ring = _ccr_ring(w, topo, n)
        path = tmp / f"{n}-ring-serial.json"
        write_schedule(ring.schedule, path)
        ccr = {"predicted": ring.predicted.ring_ccr, "measured": serialized_ccr(str(path))}
    except UserError as err:
        print(f"  no CCR for {label} on {n} ranks: {err}", file=sys.stderr)
    out = {"workload": label, "ranks": n, "rows": rows, "ring_ccr": ccr, "probe_ms": probes, "race": race}
    out |= rankings(rows, race)
    print(f"  {n} ranks  {label}: pick's regret {out['regret_pct']:.1f}% (fastest median), race "
          f"{out['race_regret']['regret_pct']:.1f}%, held out {out['race_regret']['heldout_regret_pct']}",
          file=sys.stderr)
    return out


def _row(c, got: list[tuple[float, float]], ref: float | None) -> dict:
    """One candidate's row: predicted, its rounds (and their probes), median, σ, speed-adjusted, best; errors."""
    t, probe = np.asarray([m for m, _ in got]), np.asarray([p for _, p in got])
    adj = t * (ref / probe) if ref else t          # each round at the calibration's host speed
    return _errors({"algorithm": c.algorithm, "layout": c.workload.layout, "knobs": c.knobs,
                    "predicted_s": c.predicted.makespan_s, "measured_s": float(np.median(t)),
                    "rounds_s": [float(x) for x in t], "probe_ms": [float(x) for x in probe],
                    "sigma_s": float(t.std(ddof=1)) if len(t) > 1 else 0.0,
                    "adjusted_s": float(np.median(adj)),
                    "adjusted_sigma_s": float(adj.std(ddof=1)) if len(t) > 1 else 0.0,
                    "best_s": float(t.min())})


def _errors(r: dict) -> dict:
    """``r`` with its errors: predicted against the median, the speed-adjusted median and the best round."""
    r["error_pct"] = 100 * (r["predicted_s"] / r["measured_s"] - 1)
    r["adjusted_error_pct"] = 100 * (r["predicted_s"] / r["adjusted_s"] - 1)
    r["best_error_pct"] = 100 * (r["predicted_s"] / r["best_s"] - 1)
    return r


def rankings(rows: list[dict], race: dict | None) -> dict:
    """τ and regret against the median (top level), the speed-adjusted median and the best round; the race's
    paired regret of the pick (:func:`validate_stats.race_regret`)."""
    rank = validate_stats.ranking
    return rank(rows) | {"adjusted": rank(rows, "adjusted_s", "adjusted_sigma_s"), "best": rank(rows, "best_s"),
                         "race_regret": validate_stats.race_regret(rows, race)}


def repredict(results: dict, workloads: list | None = None) -> dict:
    """The stored measurements against this code's predictions: every row and Ring's CCR predicted again
    (same workloads, candidates and knobs), errors, rankings and summary recomputed. For a model change
    that leaves the executor alone; refused when the calibration is not the one the runs were compared with."""
    if results.get("calibration") != _calibration_stamp():
        raise SystemExit("validate_cpu --repredict: the calibration changed since these runs; run them again")
    flags = dict(WORKLOADS if workloads is None else workloads)
    for wl in results["workloads"]:
        n = wl["ranks"]
        topo = Topology.load("cpu-local", gpus=n)
        w = resolve(**flags[wl["workload"]])
        for r in wl["rows"]:
            r["predicted_s"] = predict(r["algorithm"], w.with_(layout=r["layout"]), topo, n,
                                       _as_run(r["knobs"])).predicted.makespan_s
            _errors(r)
        if wl.get("ring_ccr"):
            wl["ring_ccr"]["predicted"] = _ccr_ring(w, topo, n).predicted.ring_ccr
        wl |= rankings(wl["rows"], wl.get("race"))
    results["summary"] = validate_stats.summary(results["workloads"])
    results["repredicted"] = time.strftime("%Y-%m-%d %H:%M")
    return results


def run_all(args, workloads: list, ranks: list[int], quick_workloads: int) -> dict:
    """Every workload on every rank count (``--quick``: the first ``quick_workloads`` on 2 ranks, 2 rounds, a race
    of 4); the results body (date, rounds, calibration, summary, workloads, wall time)."""
    t0 = time.perf_counter()
    plan = [(2, workloads[:quick_workloads])] if args.quick else [(n, workloads) for n in ranks]
    rounds, race_rounds = (2, 4) if args.quick else (args.rounds, args.race_rounds)
    results = []
    with tempfile.TemporaryDirectory() as d:
        for n, wls in plan:
            for label, flags in wls:
                results.append(run_workload(label, flags, n, rounds, race_rounds, Path(d)))
    return {"date": time.strftime("%Y-%m-%d"), "topology": "cpu-local", "rounds": rounds,
            "race_rounds": race_rounds, "calibration": _calibration_stamp(),
            "summary": validate_stats.summary(results), "workloads": results, "wall_s": time.perf_counter() - t0}


def parse_args(doc: str, quick: str) -> argparse.Namespace:
    """The validation scripts' flags (``doc``: the script's docstring; ``quick``: what --quick runs)."""
    ap = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help=f"{quick}, 2 ranks, 2 rounds (results not written)")
    ap.add_argument("--rounds", type=int, default=5, help="interleaved rounds per candidate (default 5)")
    ap.add_argument("--race-rounds", type=int, default=10,
                    help="more interleaved rounds of the contenders and the pick, for the regret (default 10; 0: none)")
    ap.add_argument("--ranks", default="2,4", help="rank counts (default 2,4)")
    ap.add_argument("--repredict", action="store_true",
                    help="no runs: the stored measurements against this code's predictions (rewrites the results)")
    return ap.parse_args()


def repredict_file(path: Path, workloads: list) -> None:
    """``--repredict``: the results at ``path`` predicted again (:func:`repredict`), rewritten, summary printed."""
    body = repredict(json.loads(path.read_text()), workloads)
    write_atomic(path, json.dumps(body, indent=1, default=str).encode())
    print(json.dumps(body["summary"], indent=1))


def main() -> None:
    args = parse_args(__doc__, "two workloads")
    if args.repredict:
        repredict_file(RESULTS, WORKLOADS)
        return
    ranks = [int(x) for x in args.ranks.split(",")]
    body = run_all(args, WORKLOADS, ranks, quick_workloads=2)
    if not args.quick:
        write_atomic(RESULTS, json.dumps(_merged(body, ranks), indent=1, default=str).encode())
    print(json.dumps(body["summary"], indent=1))


def _merged(body: dict, ranks: list[int]) -> dict:
    """``body`` with the previous results file's rank counts that this run did not measure (same calibration,
    rounds and race rounds only), so ``--ranks 2`` and ``--ranks 4`` can run apart; their dates are kept per rank
    count."""
    body["dates"] = {str(n): body["date"] for n in ranks}
    body["walls_s"] = {str(n): body["wall_s"] / len(ranks) for n in ranks}
    try:
        old = json.loads(RESULTS.read_text())
    except (OSError, ValueError):
        return body
    if any(old.get(k) != body[k] for k in ("calibration", "rounds", "race_rounds")):
        return body
    for n, s in old.get("summary", {}).items():
        if int(n) not in ranks:
            body["summary"][n] = s
            body["workloads"] += [w for w in old["workloads"] if w["ranks"] == int(n)]
            body["dates"][n] = old.get("dates", {}).get(n, old["date"])
            body["walls_s"][n] = old.get("walls_s", {}).get(n, old["wall_s"] / len(old["summary"]))
    body["summary"] = dict(sorted(body["summary"].items(), key=lambda kv: int(kv[0])))
    body["wall_s"] = sum(body["walls_s"].values())
    return body


def _calibration_stamp() -> dict:
    """Which calibration the predictions used, and the host it was measured on."""
    c = Topology.load("cpu-local").calibration
    return {} if c is None else {"measured_at": str(c.measured_at), "cpu": c.device.cpu, "isa": c.device.isa,
                                 "cores": c.device.cores}


if __name__ == "__main__":
    main()
