"""Rank -> GPU placement search against naive placements (issue 7), by hand: ``python benchmarks/mapping_search.py``.

For each method on ``l20x8`` (8 GPUs: PCIe switches, two sockets) and ``h100x16`` (2 nodes x 8: NVSwitch, NICs,
a per-node aggregate), GQA 8/2 x 64, causal zigzag, fwd+bwd: the simulated makespan with the identity placement,
the mean over random placements (the naive baseline), the method's own placement (identity for rings, Mesh's
node-block mapping), and the placement search (:mod:`meshplan.search.mapping`) started from the method's own.
Writes ``benchmarks/results/mapping_search.json``.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np

from meshplan.core.errors import SkipCandidate
from meshplan.core.fileio import write_atomic
from meshplan.model.topology import Topology
from meshplan.model.workload import resolve
from meshplan.search.candidate import make_candidate, simulate_candidate
from meshplan.search.mapping import makespan_s, search_mapping, with_devices

CASES = [("l20x8", 8, "32K"), ("h100x16", 16, "64K")]
METHODS = [("ring", {}), ("ulysses", {}), ("usp", {}), ("mesh", {}), ("charm", {})]
RANDOM_PLACEMENTS = 5
MAX_EVALS = 100


def main() -> None:
    rows = []
    rng = np.random.default_rng(0)
    for topo_name, n, seq in CASES:
        topo = Topology.load(topo_name, gpus=n)
        w = resolve(seq_len=seq, heads=8, kv_heads=2, head_dim=64, layout="zigzag", mask="causal",
                    passes="fwd+bwd")
        for alg, knobs in METHODS:
            try:
                c = simulate_candidate(make_candidate(alg, w, topo, n, knobs), topo, None)
            except SkipCandidate as skip:
                print(f"{topo_name} {alg}: skipped ({skip.reason})")
                continue
            sched = c.schedule
            own = c.predicted.makespan_s
            identity = makespan_s(with_devices(sched, np.arange(n)), topo)
            rand = [makespan_s(with_devices(sched, rng.permutation(n)), topo) for _ in range(RANDOM_PLACEMENTS)]
            res = search_mapping(sched, topo, max_evals=MAX_EVALS)
            rows.append({"topology": topo_name, "gpus": n, "seq": seq, "algorithm": alg, "knobs": c.knobs,
                         "identity_s": identity, "random_mean_s": float(np.mean(rand)), "random_best_s": min(rand),
                         "own_s": own, "searched_s": res.best_s, "evals": res.evals, "swaps": res.swaps,
                         "wall_s": res.wall_s})
            print(f"{topo_name} {alg}: identity {identity * 1e3:.3f}, random {np.mean(rand) * 1e3:.3f}, own "
                  f"{own * 1e3:.3f}, searched {res.best_s * 1e3:.3f} ms ({res.swaps} swaps, {res.evals} sims, "
                  f"{res.wall_s:.1f} s)", flush=True)
    out = {"date": time.strftime("%Y-%m-%d %H:%M"), "max_evals": MAX_EVALS, "random_placements": RANDOM_PLACEMENTS,
           "rows": rows}
    path = write_atomic(Path(__file__).resolve().parent / "results" / "mapping_search.json",
                        (json.dumps(out, indent=1) + "\n").encode())
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
