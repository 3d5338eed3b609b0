"""Mesh's closed form without building the schedule (search prunes with it before anything is built).

Lower bounds per pass: every rank must run its blocks (Σ of their kernel terms, launches and combines
left out); every link must carry its bytes (fetches and returns of all ranks routed on the topology); and
the ops of one stream run one after another, so each fetch or return stream of a rank takes at least the
sum of its transfers' uncontended times (a return batch also receives the rank's own partial, so the
receiving side's sum bounds it); and, flow-shop style, the blocks that need the j-th fetch of a stream or a
later one cannot start before it lands (at least the first j fetches' times), each taking at least the
rank's cheapest block. ``makespan_s`` = ``bound_s`` = the largest.
Bytes per rank follow :mod:`meshplan.algorithms.mesh.grid`;
peak memory assumes every received chunk and partial accumulator alive at once (Mesh keeps them for the
whole tile). The exact uncontended evaluation of the built schedule (:mod:`meshplan.cost.bounds`) refines it.

Link loads are linear in bytes, so the routing work is done once per (grid, mapping) with unit sizes
(:func:`geometry`) and scaled per pass and dtype.
"""

from __future__ import annotations

import numpy as np

from meshplan.algorithms.mesh.grid import Grid
from meshplan.cost.block_classes import rank_kernel_s
from meshplan.cost.bounds import PassTiming, pool_bound
from meshplan.cost.cost import CostModel
from meshplan.cost.memory import closed_form_peak_bytes
from meshplan.model.topology import Topology
from meshplan.plan.plan import Plan
from meshplan.plan.schedule import tensor_bytes

_GEOMETRY: dict[tuple, dict] = {}
#: (rank, peer) pairs routed at once by :func:`geometry` (a 1 x 4096 tile has 16.8M a family: 12 s at once, 4 s so)
GEOMETRY_PAIRS = 1 << 19
_COMPUTE: dict[tuple, np.ndarray] = {}


def _remember(cache: dict, key, value, limit: int = 64):
    cache[key] = value
    while len(cache) > limit:
        cache.pop(next(iter(cache)))
    return value


def geometry(plan: Plan, topo: Topology) -> dict:
    """Per family: unit link loads, per-rank counts of transfers received and of those crossing nodes, and
    per-rank Σ latency and Σ 1/bandwidth of the transfers received; for the families in, those of each step ([K, N]:
    ``step_lat``, ``step_inv_bw``). Shared by plans with the same grid and mapping (any layout, dtype or pass)."""
    grid: Grid = plan.extra["grid"]
    dev, n = plan.device_of_rank, grid.n
    key = (grid, dev.tobytes(), topo.content_hash)
    if key in _GEOMETRY:
        return _GEOMETRY[key]
    g = np.arange(n)
    out = {}
    rows = max(1, GEOMETRY_PAIRS // n)
    for side in ("row", "col"):
        peers = grid.a - 1 if side == "row" else grid.b - 1
        f = {"step_lat": np.empty((peers, n)), "step_inv_bw": np.empty((peers, n)), "loads": np.zeros(topo.n_links),
             "count": np.zeros(n), "cross": np.zeros(n), "lat": np.zeros(n), "inv_bw": np.zeros(n)}
        for k0 in range(0, peers, rows):          # a block of peers at a time: temporaries that stay in cache
            k = np.arange(1 + k0, 1 + min(peers, k0 + rows))[:, None]
            peer = (grid.row_peer if side == "row" else grid.col_peer)(g[None, :], k).ravel()
            me = np.broadcast_to(g[None, :], (len(k), n)).ravel()
            d_src, d_dst = dev[peer], dev[me]                 # the family in: each peer sends to the rank
            lat, bw = topo.pair_stats(d_src, d_dst)
            inv_bw = 1.0 / bw
            cross = ~topo.same_node(d_src, d_dst)
            f["step_lat"][k0:k0 + len(k)] = lat.reshape(len(k), n)
            f["step_inv_bw"][k0:k0 + len(k)] = inv_bw.reshape(len(k), n)
            f["loads"] += topo.link_loads(d_src, d_dst, 1.0)
            f["count"] += len(k)                    # each rank receives one of each row: sums down the columns
            for name, x in (("cross", cross), ("lat", lat), ("inv_bw", inv_bw)):
                f[name] += x.reshape(len(k), n).sum(axis=0)
        out[(side, "in")] = f
        # a row's (a column's) peers are a group: the transfers out are the transfers in, each pair once, so their
        # link loads and sums per receiving rank are the same (no per-step arrays: those are by sender)
        out[(side, "out")] = {name: x for name, x in f.items() if not name.startswith("step_")}
    return _remember(_GEOMETRY, key, out)


def rank_compute(plan: Plan, topo: Topology, pass_: str, kernel_chunks: tuple[int, int] | None = None):
    """([N] Σ kernel terms of each rank's blocks, [N] its cheapest block's term), launches left out; shared
    by plans of one matrix and grid. ``kernel_chunks``: the largest op (q chunks, KV chunks) the tile plan
    runs (default: the whole tile), whose kernel efficiency (the table's monotone envelope) bounds every
    block's."""
    m, grid = plan.matrix, plan.extra["grid"]
    kc = kernel_chunks or (grid.a, grid.b)
    key = (id(m), grid, topo.content_hash, pass_, kc)
    if key not in _COMPUTE:
        total, cheapest, _ = rank_kernel_s(CostModel(topo), m, plan.owner, grid.n, pass_, kc)
        _remember(_COMPUTE, key, (total, cheapest))
    return _COMPUTE[key]


def _flow_shop(f: dict, nbytes: float, blocks_after: np.ndarray, cheapest: np.ndarray) -> np.ndarray:
    """[N] max over j of (the j-th fetch of a stream landing) + (blocks needing it or later) x cheapest."""
    arrive = np.cumsum(f["step_lat"] + nbytes * f["step_inv_bw"], axis=0)     # [K, N]
    return (arrive + blocks_after[:, None] * cheapest[None, :]).max(axis=0, initial=0.0)


def overhead(plan: Plan, topo: Topology, pass_: str, tile) -> float:
    """Per-rank compute-stream time beside the blocks' kernel terms, from the tile plan (the same on every
    rank): a launch per op plus each op's combine (3 x its outputs' fp32 bytes at the merge rate), and the
    merges of the partials the rank receives. Only when no block is masked (else ops differ by rank): 0."""
    m, w = plan.matrix, plan.workload
    if tile is None or not m.permitted.all():
        return 0.0
    cost = CostModel(topo)
    c, cq, h = m.tokens_per_chunk, m.q_tokens_per_chunk, w.n_heads
    acc = {"row": tensor_bytes(w, "out" if pass_ == "fwd" else "dq", cq, h, "fp32"),
           "col": tensor_bytes(w, "dkv", c, h, "fp32")}
    per_op = [cost.kernel.launch_s + 3 * (len(rows) * acc["row"] + (len(cols) * acc["col"] if pass_ == "bwd" else 0))
              / cost.merge_rate for rows, cols, _ in tile.groups]
    grid = plan.extra["grid"]
    if pass_ == "fwd":
        wire = tensor_bytes(w, "out", cq, h, plan.knobs["partial_dtype"] or w.dtype)
        folds = (grid.a - 1) * float(cost.merge_time_s(2 * acc["row"] + wire))
    else:
        wd = plan.knobs["dkv_dtype"]
        folds = (grid.a - 1) * float(cost.merge_time_s(2 * acc["row"] + tensor_bytes(w, "dq", cq, h, wd))) \
            + (grid.b - 1) * float(cost.merge_time_s(2 * acc["col"] + tensor_bytes(w, "dkv", c, h, wd)))
    return float(sum(per_op)) + folds


def cheap_timing(plan: Plan, topo: Topology, pass_: str, tile=None) -> PassTiming:
    """Compute and link bounds of one pass of a Mesh plan (``tile``: its TilePlan, for the op overheads)."""
    grid: Grid = plan.extra["grid"]
    w, m = plan.workload, plan.matrix
    n, h = grid.n, w.n_heads
    size = lambda kind, dtype=w.dtype: float(tensor_bytes(w, kind, m.chunk_tokens(kind), h, dtype))  # noqa: E731
    largest = max(tile.groups, key=lambda g: len(g[0]) * len(g[1])) if tile is not None and tile.groups else None
    compute, cheapest = rank_compute(plan, topo, pass_, (len(largest[0]), len(largest[1])) if largest else None)
    compute = compute + overhead(plan, topo, pass_, tile)
    if pass_ == "fwd":
        moved = {("row", "in"): size("q"), ("row", "out"): size("out", plan.knobs["partial_dtype"] or w.dtype),
                 ("col", "in"): size("kv"), ("col", "out"): 0.0}
    else:
        wire, keep = plan.knobs["dkv_dtype"], plan.knobs["bwd_inputs"] == "keep"
        moved = {("row", "in"): size("dside" if keep else "qside"), ("row", "out"): size("dq", wire),
                 ("col", "in"): 0.0 if keep else size("kv"), ("col", "out"): size("dkv", wire)}
    geo = geometry(plan, topo)
    loads, recv, cross, comm = 0.0, np.zeros(n), np.zeros(n), np.zeros(n)
    stream = np.zeros(n)
    for fam, nbytes in moved.items():
        if nbytes:
            f = geo[fam]
            loads = loads + nbytes * f["loads"]
            recv += nbytes * f["count"]
            cross += nbytes * f["cross"]
            serial = f["lat"] + nbytes * f["inv_bw"]      # one stream's transfers, back to back
            comm += serial
            stream = np.maximum(stream, serial)
    link = float((np.asarray(loads) / topo.link_capacity).max(initial=0.0)) if np.ndim(loads) else 0.0
    j_rows, j_cols = np.arange(1, grid.a), np.arange(1, grid.b)
    fill = np.maximum(
        _flow_shop(geo[("row", "in")], moved[("row", "in")], (grid.a - j_rows) * grid.b, cheapest) if grid.a > 1 else 0,
        _flow_shop(geo[("col", "in")], moved[("col", "in")], (grid.b - j_cols) * grid.a, cheapest) if grid.b > 1 else 0)
    bound = max(float(compute.max()), float(stream.max()), float(np.max(fill)), link, pool_bound(topo, compute))
    crit = int(np.argmax(compute))
    if pass_ == "fwd":
        own = size("q") + size("kv") + size("out", "fp32")
    else:
        own = size("q") + size("kv") + size("out") + size("dout") + size("qside") + size("dq", "fp32") \
            + size("dkv", "fp32")
    kept = plan.knobs["bwd_inputs"] == "keep" and pass_ == "bwd"
    held = (grid.a - 1) * (moved[("row", "in")] + size("out" if pass_ == "fwd" else "dq", "fp32")
                           + (size("q") if kept else 0.0)) \
        + (grid.b - 1) * (moved[("col", "in")] + (size("kv") if kept else 0.0)
                          + (size("dkv", "fp32") if pass_ == "bwd" else 0.0))
    return PassTiming(makespan_s=bound, bound_s=bound, compute_s=float(compute[crit]), comm_s=float(comm[crit]),
                      recv_bytes_max=float(recv.max()), inter_node_bytes_max=float(cross.max()),
                      flops_total=float(m.flops(pass_).sum()), recv_bytes_total=float(recv.sum()),
                      peak_memory_bytes=own + held,
                      peak_memory_total_bytes=closed_form_peak_bytes(topo.memory_model, plan, pass_, own + held,
                                                                     float(recv.max())))   # every fetch at once
