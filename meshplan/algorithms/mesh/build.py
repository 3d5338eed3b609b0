"""Lowering a Mesh plan to ops: fetches, compute groups, returns — the same plan on every rank, in offsets.

Offsets: row offset u means the query chunk of row peer (r, c + u) (u = 0: the rank's own), column offset v
the KV chunk of column peer (r + v, c). Fetch i of the tile plan's order is a batch on its stream: receive
from the peer at +k, send the own chunk to the peer at −k (a permutation); it waits for fetch i − inflight
to land (a bound on transfers in flight). A compute group's blocks that the mask empties are dropped per
rank (ranks with the same remaining blocks share one op call). Returns go out in the plan's order.
"""

from __future__ import annotations

from collections import defaultdict

import numpy as np

from meshplan.algorithms.mesh.grid import Grid
from meshplan.algorithms.mesh.order import TilePlan
from meshplan.plan.build import ScheduleBuilder
from meshplan.plan.plan import Plan


class _Uses:
    """Per (tensor array, rank): ops that use it, for ``free_after``."""

    def __init__(self) -> None:
        self.ops: dict[int, list[tuple[np.ndarray, np.ndarray]]] = defaultdict(list)

    def add(self, key: int, tensors: np.ndarray, ops: np.ndarray) -> None:
        self.ops[key].append((tensors, ops))

    def free(self, b: ScheduleBuilder) -> None:
        for pairs in self.ops.values():
            for t, o in pairs:
                b.free_after(t, o)


def fetch(b: ScheduleBuilder, grid: Grid, plan: TilePlan, own: dict[str, np.ndarray], kinds: dict[str, str],
          inflight: int, kept: dict | None = None) -> tuple[dict, dict]:
    """Issue every fetch of ``plan.order``; returns ({(kind, offset): tensors on each rank}, {...: recv ops}).

    ``kept[(kind, offset)]``: tensors already on the rank (kept from the forward): not fetched, no dep.
    """
    g = np.arange(grid.n)
    tensors, recvs, count, seq = {}, {}, {"q": 0, "kv": 0}, []
    for i, kind in enumerate(plan.order):
        count[kind] += 1
        k = count[kind]
        if kept and (kind, k) in kept:
            tensors[(kind, k)], recvs[(kind, k)] = kept[(kind, k)], np.full(grid.n, -1)
            seq.append(np.full(grid.n, -1))
            continue
        peer = grid.row_peer if kind == "q" else grid.col_peer
        dst = peer(g, -k)                      # who receives rank g's own chunk at this step
        landing = b.tensor(g, kinds[kind], peer(g, k))
        gate = seq[i - inflight] if i >= inflight else np.full(grid.n, -1)
        _, rcv = b.transfer(g, dst, own[kind], landing[dst], stream=kind, step=i, recv_deps=[gate[dst]])
        on_rank = np.empty(grid.n, dtype=np.int64)
        on_rank[dst] = rcv
        tensors[(kind, k)], recvs[(kind, k)] = landing, on_rank
        seq.append(on_rank)
    return tensors, recvs


def groups(b: ScheduleBuilder, plan: Plan, grid: Grid, tile: TilePlan, *, q_in, kv_in, outs, recv_of,
           combine: str, uses: _Uses, writers: dict) -> None:
    """Compute the tile plan's groups in order. ``q_in(u)``/``kv_in(v)`` give input tensor lists, ``outs``
    the output accumulators of a group's rows and columns; ``writers[(side, offset)]`` collects the first
    and last op that wrote each accumulator (per rank), for allocation and the returns."""
    g = np.arange(grid.n)
    permitted = plan.matrix.permitted
    for rows, cols, _ in tile.groups:
        qc = np.stack([grid.row_peer(g, u) for u in rows], axis=1)
        kc = np.stack([grid.col_peer(g, v) for v in cols], axis=1)
        keep = permitted[qc[:, :, None], kc[:, None, :]]            # [N, |rows|, |cols|]
        if keep.all():
            _one_group(b, grid, g, list(rows), list(cols), q_in, kv_in, outs, recv_of, combine, uses, writers)
            continue
        pattern = keep.reshape(grid.n, -1)
        for pat in np.unique(pattern, axis=0):
            if not pat.any():
                continue
            ranks = np.flatnonzero((pattern == pat).all(axis=1))
            mask = pat.reshape(len(rows), len(cols))
            r_sel = [u for a, u in enumerate(rows) if mask[a].any()]
            c_sel = [v for a, v in enumerate(cols) if mask[:, a].any()]
            _one_group(b, grid, ranks, r_sel, c_sel, q_in, kv_in, outs, recv_of, combine, uses, writers)


def _one_group(b, grid, ranks, rows, cols, q_in, kv_in, outs, recv_of, combine, uses, writers) -> None:
    ins = [t[ranks] for u in rows for t in q_in(u)] + [kv_in(v)[ranks] for v in cols]
    out_t = [t[ranks] for t in outs(rows, cols)]
    deps = [recv_of[("q", u)][ranks] for u in rows if u] + [recv_of[("kv", v)][ranks] for v in cols if v]
    deps = [d for d in deps if (d >= 0).any()]
    op = b.compute(ranks, np.stack([grid.row_peer(ranks, u) for u in rows], axis=1),
                   np.stack([grid.col_peer(ranks, v) for v in cols], axis=1),
                   inputs=ins, outputs=out_t, combine=combine, deps=deps)
    for u in rows:
        if u:  # received buffers die after their last use; the rank's own inputs stay
            for t in q_in(u):
                uses.add(id(t), t[ranks], op)
    for v in cols:
        if v:
            uses.add(id(kv_in(v)), kv_in(v)[ranks], op)
    for side, offsets in (("row", rows), ("col", cols)):
        for x in offsets:
            first, last = writers.setdefault((side, x), (np.full(grid.n, -1), np.full(grid.n, -1)))
            first[ranks] = np.where(first[ranks] < 0, op, first[ranks])
            last[ranks] = np.maximum(last[ranks], op)


def send_back(b: ScheduleBuilder, grid: Grid, order: list[int], side: str, acc: dict, writers: dict, *, kind: str,
              stream: str, step0: int, dtype: str, merge_into: np.ndarray, combine: str) -> None:
    """Return each remote row's (or column's) partial to its owner, who merges/accumulates it."""
    g = np.arange(grid.n)
    peer = grid.row_peer if side == "row" else grid.col_peer
    for i, x in enumerate(order):
        dst = peer(g, x)
        landing = b.tensor(g, kind, g, dtype=dtype)
        first, last = writers.get((side, x), (np.full(grid.n, -1), np.full(grid.n, -1)))
        snd, rcv = b.transfer(g, dst, acc[x], landing[dst], stream=stream, step=step0 + i, dtype=dtype,
                              send_deps=[last])
        idle = first < 0                     # nothing computed into it (masked out): allocated at its send
        b.alloc_at(acc[x][~idle], first[~idle])
        b.alloc_at(acc[x][idle], snd[idle])
        b.free_after(acc[x], snd)
        fold = b.combine_op(dst, combine, src=landing[dst], dst=merge_into[dst], deps=[rcv])
        b.free_after(landing[dst], fold)
