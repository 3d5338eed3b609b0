"""Hamiltonian decompositions of the complete directed graph K_N* (TASP's N − 1 concurrent rings).

K_N* splits into N − 1 directed Hamiltonian cycles for every N except 4 and 6 (Tillson, "A Hamiltonian
decomposition of K*_2m, 2m ≥ 8", J. Comb. Theory B 29, 1980). TASP (arXiv 2509.26541) publishes a
generator for N = 8 and N ≥ 8 with N % 4 == 0. We ship decompositions found with OR-Tools CP-SAT (one
``AddCircuit`` per cycle, every arc in exactly one cycle) for N = 8, 12, 16, 20 in
``meshplan/data/hamiltonian_cycles.json``; regenerate with ``python -m meshplan.algorithms.tasp_cycles``.
Larger N (CP-SAT does not finish in 30 s at N = 24) is not implemented yet.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

import numpy as np

DATA = Path(__file__).resolve().parents[1] / "data" / "hamiltonian_cycles.json"
IMPOSSIBLE = (4, 6)


@functools.lru_cache(maxsize=None)
def shipped() -> dict[int, np.ndarray]:
    """N -> [N − 1, N] successor arrays (cycle k sends rank r's data to succ[k, r])."""
    raw = json.loads(DATA.read_text())
    return {int(n): np.asarray(cycles, dtype=np.int64) for n, cycles in raw.items()}


def check_decomposition(succ: np.ndarray) -> bool:
    """Every cycle visits all N ranks once and every ordered pair (i, j), i ≠ j, is used by exactly one cycle."""
    k, n = succ.shape
    for row in succ:
        seen, x = set(), 0
        for _ in range(n):
            seen.add(x)
            x = int(row[x])
        if len(seen) != n or x != 0:
            return False
    used = np.zeros((n, n), dtype=int)
    np.add.at(used, (np.tile(np.arange(n), k), succ.ravel()), 1)
    return k == n - 1 and (used + np.eye(n, dtype=int) == 1).all()


def solve(n: int, seconds: float = 60.0) -> np.ndarray | None:
    """A decomposition of K_n* by CP-SAT (deterministic: one worker, fixed seed), or None."""
    from ortools.sat.python import cp_model

    m = cp_model.CpModel()
    arcs = [(i, j) for i in range(n) for j in range(n) if i != j]
    x = {(k, i, j): m.NewBoolVar(f"x{k}_{i}_{j}") for k in range(n - 1) for i, j in arcs}
    for k in range(n - 1):
        m.AddCircuit([(i, j, x[k, i, j]) for i, j in arcs])
        m.Add(x[k, 0, k + 1] == 1)                       # symmetry breaking: cycle k leaves 0 for k + 1
    for i, j in arcs:
        m.AddExactlyOne(x[k, i, j] for k in range(n - 1))
    solver = cp_model.CpSolver()
    solver.parameters.max_time_in_seconds = seconds
    solver.parameters.num_workers = 1
    solver.parameters.random_seed = 0
    if solver.Solve(m) not in (cp_model.OPTIMAL, cp_model.FEASIBLE):
        return None
    return np.asarray([[next(j for j in range(n) if j != i and solver.Value(x[k, i, j])) for i in range(n)]
                       for k in range(n - 1)])


def main() -> None:  # pragma: no cover - a generator run by hand
    """Solve and check N = 8, 12, 16, 20 and rewrite the shipped file."""
    out = {}
    for n in (8, 12, 16, 20):
        succ = solve(n)
        assert succ is not None and check_decomposition(succ), n
        out[str(n)] = succ.tolist()
    DATA.write_text(json.dumps(out, separators=(",", ":")) + "\n")


if __name__ == "__main__":  # pragma: no cover
    main()
