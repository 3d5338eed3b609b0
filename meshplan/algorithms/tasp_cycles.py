"""Hamiltonian decompositions for TASP's concurrent rings: flat over all ranks, or node-aware.

**Flat.** K_N* (the complete directed graph) splits into N − 1 directed Hamiltonian cycles for every N except 4
and 6 (Tillson, "A Hamiltonian decomposition of K*_2m, 2m ≥ 8", J. Comb. Theory B 29, 1980). TASP (arXiv
2509.26541) publishes a generator for N = 8 and N ≥ 8 with N % 4 == 0. We ship decompositions found with OR-Tools
CP-SAT (one ``AddCircuit`` per cycle, every arc in exactly one cycle) for N = 8, 12, 16, 20 in
``meshplan/data/hamiltonian_cycles.json``. Larger N (CP-SAT does not finish in 30 s at N = 24) is not implemented.

**Node-aware** (across nodes of g GPUs; TASP's topology decomposition: an AlltoAll node plus one NIC per GPU).
K_g* splits into g directed Hamiltonian *paths* (remove the extra vertex from each of the g cycles of K_{g+1}*;
shipped for g = 2, 4, 8 in ``meshplan/data/hamiltonian_paths.json``). Cycle c walks path c inside node 0, crosses to
node 1 at its start, walks path c there, and so on, back to node 0: g cycles, each crossing between nodes once
per node. Every intra-node arc is used once per node; since every GPU ends exactly one path, every GPU sends on
exactly one node-crossing arc and receives on one — each step moves g sub-chunks per rank, one of them across
nodes, so all of a node's NICs carry one flow each (a flat decomposition crosses nodes on about half its arcs).

Regenerate both files with ``python -m meshplan.algorithms.tasp_cycles``.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

import numpy as np

DATA = Path(__file__).resolve().parents[1] / "data" / "hamiltonian_cycles.json"
PATHS = Path(__file__).resolve().parents[1] / "data" / "hamiltonian_paths.json"
IMPOSSIBLE = (4, 6)


@functools.lru_cache(maxsize=None)
def shipped() -> dict[int, np.ndarray]:
    """N -> [N − 1, N] successor arrays (cycle k sends rank r's data to succ[k, r])."""
    raw = json.loads(DATA.read_text())
    return {int(n): np.asarray(cycles, dtype=np.int64) for n, cycles in raw.items()}


@functools.lru_cache(maxsize=None)
def shipped_paths() -> dict[int, np.ndarray]:
    """g -> [g, g] vertex orders: g directed Hamiltonian paths of K_g* using every arc once."""
    raw = json.loads(PATHS.read_text())
    return {int(g): np.asarray(paths, dtype=np.int64) for g, paths in raw.items()}


def node_aware(rank_at: np.ndarray) -> np.ndarray:
    """[g, N] successor arrays of the node-aware cycles over ``rank_at`` [M, g] (the rank at each node's local
    index, M ≥ 2 nodes): cycle c follows path c inside each node and goes from its end in node k to its start in
    node k + 1 (mod M).

    Raises:
        KeyError: no paths shipped for g GPUs a node.
    """
    m, g = rank_at.shape
    paths = shipped_paths()[g]
    succ = np.empty((g, m * g), dtype=np.int64)
    for c, path in enumerate(paths):
        for k in range(m):
            succ[c, rank_at[k, path[:-1]]] = rank_at[k, path[1:]]
            succ[c, rank_at[k, path[-1]]] = rank_at[(k + 1) % m, path[0]]
    return succ


def check_paths(paths: np.ndarray) -> bool:
    """Every path visits all g vertices once and every ordered pair (i, j), i ≠ j, is consecutive in exactly one."""
    k, g = paths.shape
    if k != g or any(sorted(p.tolist()) != list(range(g)) for p in paths):
        return False
    used = np.zeros((g, g), dtype=int)
    np.add.at(used, (paths[:, :-1].ravel(), paths[:, 1:].ravel()), 1)
    return bool((used + np.eye(g, dtype=int) == 1).all())


def paths_from_cycles(succ: np.ndarray) -> np.ndarray:
    """g Hamiltonian paths of K_g* from a decomposition of K_{g+1}* (``succ`` [g, g + 1]): each cycle with vertex g
    removed, read from the vertex after g."""
    g = succ.shape[0]
    out = []
    for row in succ:
        path, x = [], int(row[g])
        while x != g:
            path.append(x)
            x = int(row[x])
        out.append(path)
    return np.asarray(out, dtype=np.int64)


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
    """Solve and check N = 8, 12, 16, 20 (cycles) and g = 2, 4, 8 (paths, from K_{g+1}*); rewrite the files."""
    out = {}
    for n in (8, 12, 16, 20):
        succ = solve(n)
        assert succ is not None and check_decomposition(succ), n
        out[str(n)] = succ.tolist()
    DATA.write_text(json.dumps(out, separators=(",", ":")) + "\n")
    paths = {}
    for g in (2, 4, 8):
        succ = solve(g + 1)
        assert succ is not None and check_decomposition(succ), g
        paths[str(g)] = paths_from_cycles(succ).tolist()
        assert check_paths(np.asarray(paths[str(g)])), g
    PATHS.write_text(json.dumps(paths, separators=(",", ":")) + "\n")


if __name__ == "__main__":  # pragma: no cover
    main()
