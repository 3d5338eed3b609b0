"""The Ulysses grid and its all-to-alls: sequence-sharded chunks ↔ head-sharded groups of chunks.

N ranks form R = N/u Ulysses groups of u ranks. Rank (g, p) — group g, index p — holds sequence chunk r
(its own rank id) with every head; after the head-scatter all-to-all it holds the chunks of its group
(``groups[g]``, [u]) for the query heads H_p = [p·h/u, (p+1)·h/u) (KV: the KV heads those read; when
u > h_kv a KV head goes to u/h_kv ranks — the replication docs/algorithms.md asks to state and cost). The
gather all-to-all is the reverse. An all-to-all is one P2P batch per rank on its own stream: the (u−1)
pieces to and from the other members posted together (NCCL's all-to-all is grouped send/recv too; on gloo
this is the point-to-point lowering docs/cost-model.md asks for), simulated flow by flow on the topology.

``rank_order``: ``ulysses-first`` puts a group on consecutive ranks (inside a node when u divides the node
size: USP's default), ``ring-first`` strides it by R (the ring inside the node).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import numpy as np

from meshplan.core.errors import SkipCandidate
from meshplan.model.workload import Workload
from meshplan.plan.build import ScheduleBuilder

RANK_ORDERS = ("ulysses-first", "ring-first")


def head_degree_problem(w: Workload, u: int) -> str | None:
    """Why Ulysses degree ``u`` cannot split ``w``'s heads (None when it can): u must divide the query heads,
    and either divide the KV heads or be a multiple of them (then KV heads are replicated)."""
    if w.n_heads % u:
        return f"a Ulysses degree of {u} does not divide the {w.n_heads} query heads"
    if w.n_kv_heads % u and u % w.n_kv_heads:
        return f"a Ulysses degree of {u} neither divides nor is a multiple of the {w.n_kv_heads} KV heads"
    return None


def valid_degrees(w: Workload, n: int) -> list[int]:
    """Ulysses degrees u ≥ 2 dividing N that the heads allow, ascending."""
    return [u for u in range(2, n + 1) if n % u == 0 and head_degree_problem(w, u) is None]


def check_degree(w: Workload, n: int, u: int) -> None:
    """Raise SkipCandidate (with the valid degrees) when u cannot split N ranks or the heads."""
    if n % u:
        raise SkipCandidate("Ulysses degree does not divide the ranks", f"{u} does not divide {n} ranks")
    why = head_degree_problem(w, u)
    if why:
        ok = valid_degrees(w, n)
        raise SkipCandidate("Ulysses degree does not fit the heads",
                            f"{why}; valid degrees for {n} ranks: {', '.join(map(str, ok)) or 'none'}")


@dataclass(frozen=True)
class Grid:
    """R Ulysses groups of u ranks. ``rank_of[g, p]``; ``g_of``, ``p_of`` per rank; ``groups`` = the chunks of
    each group ([R, u]: chunk = the rank that holds it at the start). The arrays are computed once."""

    n: int
    u: int
    order: str
    n_heads: int

    @property
    def R(self) -> int:  # noqa: N802 - the papers' name
        return self.n // self.u

    @cached_property
    def rank_of(self) -> np.ndarray:
        g, p = np.meshgrid(np.arange(self.R), np.arange(self.u), indexing="ij")
        return g * self.u + p if self.order == "ulysses-first" else p * self.R + g

    @cached_property
    def g_of(self) -> np.ndarray:
        out = np.empty(self.n, dtype=np.int64)
        out[self.rank_of] = np.arange(self.R)[:, None]
        return out

    @cached_property
    def p_of(self) -> np.ndarray:
        out = np.empty(self.n, dtype=np.int64)
        out[self.rank_of] = np.arange(self.u)[None, :]
        return out

    @property
    def groups(self) -> np.ndarray:
        return self.rank_of

    def heads_of(self, p) -> tuple[np.ndarray, np.ndarray]:
        """Query-head range [h0, h1) of index p (array)."""
        w = self.n_heads // self.u
        p = np.asarray(p)
        return p * w, (p + 1) * w

    def rank_heads(self) -> tuple[np.ndarray, np.ndarray]:
        """[n] head range of every rank."""
        return self.heads_of(self.p_of)


def split_inputs(b: ScheduleBuilder, grid: Grid, kind: str, **kw) -> np.ndarray:
    """[n, u]: rank r's own chunk r cut into the u head ranges (the pieces the scatter sends)."""
    r = np.arange(grid.n)
    cols = [b.tensor(r, kind, r, heads=grid.heads_of(np.full(grid.n, p)), **kw) for p in range(grid.u)]
    return np.stack(cols, 1)


def scatter_heads(b: ScheduleBuilder, grid: Grid, pieces: dict[str, np.ndarray], *, stream: str, step: int,
                  deps=()) -> tuple[dict[str, np.ndarray], np.ndarray]:
    """Head-scatter all-to-all: ``pieces[kind]`` [n, u] (rank r's chunk r, head range p') go to member p'.

    Returns (``held[kind]`` [n, u]: on rank (g, p) the chunk ``groups[g][t]`` with heads H_p, column t — the
    rank's own piece where t = p), and the recv op ids on each rank ([n]; −1 when u = 1).
    """
    r, g, p = np.arange(grid.n), grid.g_of, grid.p_of
    held = {k: np.full((grid.n, grid.u), -1) for k in pieces}
    last_recv = np.full(grid.n, -1)
    for k, arr in pieces.items():
        held[k][r, p] = arr[r, p]
    for d in range(1, grid.u):
        dst_p = (p + d) % grid.u
        dst = grid.rank_of[g, dst_p]
        for k, arr in pieces.items():
            land = b.tensor(dst, k, r, heads=grid.heads_of(dst_p))
            _, rcv = b.transfer(r, dst, arr[r, dst_p], land, stream=stream, step=step, send_deps=list(deps))
            held[k][dst, p] = land
            last_recv[dst] = rcv
    return held, last_recv


def gather_heads(b: ScheduleBuilder, grid: Grid, kind: str, results: np.ndarray, *, stream: str, step: int,
                 dtype: str, role: str, deps=()) -> tuple[np.ndarray, np.ndarray]:
    """Head-gather all-to-all: on rank (g, p) ``results`` [n, u] hold chunk ``groups[g][t]`` for heads H_p;
    column t goes to the chunk's home (member t). Returns (``landed`` [n, u]: on the home, the piece from
    member p' in column p' — its own result where p' = p — and the recv op ids per rank)."""
    r, g, p = np.arange(grid.n), grid.g_of, grid.p_of
    landed = np.full((grid.n, grid.u), -1)
    landed[r, p] = results[r, p]
    last_recv = np.full(grid.n, -1)
    h0, h1 = grid.rank_heads()
    for d in range(1, grid.u):
        dst_p = (p + d) % grid.u
        dst = grid.rank_of[g, dst_p]
        land = b.tensor(dst, kind, dst, heads=(h0, h1), dtype=dtype, role=role)
        snd, rcv = b.transfer(r, dst, results[r, dst_p], land, stream=stream, step=step, dtype=dtype,
                              send_deps=list(deps))
        b.free_after(results[r, dst_p], snd)
        landed[dst, p] = land
        last_recv[dst] = rcv
    return landed, last_recv

