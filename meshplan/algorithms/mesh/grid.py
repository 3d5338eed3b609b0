"""Mesh-Attention's grid: tiles, KV partition rotation (KVR), peers, volumes and node-block mappings.

N = a·b ranks on a grid of b tile-rows × a tile-columns, placed row-first: rank g -> (r, c) = (g div a,
g mod a). Rank g owns query chunk g and KV chunk g. Tile-row r covers query chunks r·a .. r·a + a − 1 (its
row group owns them); with KVR, tile-column c covers KV chunks {c, c + a, .., c + (b−1)·a} (its column group
owns them). So every tile holds its rank's own (Q_g, KV_g) block; a rank receives a−1 Q chunks from its
row peers and b−1 KV chunks from its column peers, returns a−1 partial outputs, and every KV owner sends
to b−1 peers. At step k a rank fetches from row peer (r, c + k) and column peer (r + k, c): a permutation.

Bytes received per rank, forward (docs/algorithms.md): ``(a−1)·(Qc + Oc + Lc) + (b−1)·KVc``; a = 1 is Ring's
``(N−1)·KVc``; MHA square tiles without LSE give ``V_mesh / V_ring = 2 / (√N + 1)``.

Node-block mapping: each node (or NUMA domain of a single node) holds a p × q block of the grid, so a
rank's inter-node bytes are ``(a − q)·(Qc + Oc + Lc) + (b − p)·KVc``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from meshplan.core.errors import UserError


@dataclass(frozen=True)
class Grid:
    """The a × b tile grid of N = a·b ranks (a query chunks and b KV chunks per tile)."""

    a: int
    b: int

    @property
    def n(self) -> int:
        """N = a·b."""
        return self.a * self.b

    def rank(self, r, c):
        """Rank at tile-row r, tile-column c (wrapping)."""
        return (np.asarray(r) % self.b) * self.a + np.asarray(c) % self.a

    def pos(self, g):
        """(tile-row, tile-column) of rank g."""
        return np.divmod(np.asarray(g), self.a)

    def row_peer(self, g, u):
        """Rank at row offset u of rank g (its query chunk id is the same number)."""
        r, c = self.pos(g)
        return self.rank(r, c + u)

    def col_peer(self, g, v):
        """Rank at column offset v of rank g (its KV chunk id is the same number)."""
        r, c = self.pos(g)
        return self.rank(r + v, c)

    def owner(self) -> np.ndarray:
        """[N, N] rank computing block (query chunk i, KV chunk j)."""
        i, j = np.arange(self.n)[:, None], np.arange(self.n)[None, :]
        return self.rank(i // self.a, j % self.a)


def factorisations(n: int) -> list[tuple[int, int]]:
    """Every (a, b) with a·b = n, a ascending."""
    return [(a, n // a) for a in range(1, n + 1) if n % a == 0]


def parse_tile(text: str, n: int) -> Grid:
    """``AxB`` -> Grid; refuses a tile that does not factor N, listing the valid ones."""
    valid = ", ".join(f"{a}x{b}" for a, b in factorisations(n))
    try:
        a, b = (int(x) for x in str(text).lower().split("x"))
    except ValueError:
        raise UserError("--tile", f"cannot read {text!r}", f"write AxB with A·B = {n}: {valid}") from None
    if a * b != n or a < 1 or b < 1:
        raise UserError("--tile", f"{a}x{b} does not factor N = {n}", f"use one of {valid}")
    return Grid(a, b)


def block_shapes(grid: Grid, unit: int) -> list[tuple[int, int]]:
    """Node-block shapes p × q (p tile-rows, q tile-columns) with p·q = unit that tile the grid."""
    return [(unit // q, q) for q in range(1, unit + 1)
            if unit % q == 0 and grid.a % q == 0 and grid.b % (unit // q) == 0]


def block_mapping(grid: Grid, unit: int, p: int, q: int) -> np.ndarray:
    """rank -> device when each group of ``unit`` consecutive devices holds a p × q block of the grid."""
    r, c = grid.pos(np.arange(grid.n))
    block = (r // p) * (grid.a // q) + c // q
    return block * unit + (r % p) * q + c % q


def translations(grid: Grid, p: int, q: int) -> list[np.ndarray]:
    """Grid translations by one block (q columns, p rows): the symmetries of a block-mapped Mesh plan."""
    g = np.arange(grid.n)
    r, c = grid.pos(g)
    out = []
    if q < grid.a:
        out.append(grid.rank(r, c + q))
    if p < grid.b:
        out.append(grid.rank(r + p, c))
    return out


def volumes(grid: Grid, qc: float, kvc: float, oc: float, lc: float) -> float:
    """Forward bytes received per rank: (a−1)·(Qc + Oc + Lc) + (b−1)·KVc."""
    return (grid.a - 1) * (qc + oc + lc) + (grid.b - 1) * kvc
