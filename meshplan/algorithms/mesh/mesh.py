"""Mesh-Attention (arXiv 2512.20968; seeds 000/001): every rank computes an a × b tile of the block matrix.

Grid, KVR, volumes and node-block mappings: :mod:`meshplan.algorithms.mesh.grid`; the in-tile order:
:mod:`meshplan.algorithms.mesh.order`; lowering: :mod:`meshplan.algorithms.mesh.build`.

Bytes received per rank:
    forward   (a−1)·(Qc + Oc + Lc) + (b−1)·KVc             (Oc in ``partial_dtype``)
    backward  (a−1)·(2·Qc + 8·B·c·H + dQc) + (b−1)·(KVc + dKVc)   (refetch; partial gradients in ``dkv_dtype``)
Knobs: ``--tile AxB`` (default: the tile whose busiest link class carries the least time), ``--mapping``
(``auto``: the node-block shape moving the fewest inter-node bytes; ``row-major``; ``block:PxQ``),
``--partial-dtype``, ``--dkv-dtype`` (partial dQ and dK/dV, fp32 default), ``--knob order=...``
(auto | greedy | q-first | kv-first | alternate; auto: the simulator keeps the fastest of them, up to 256
ranks, above which the one-rank model's pick stands), ``--knob inflight=K`` (fetches in flight, default 2)
and ``--knob bwd_inputs=refetch|keep`` (backward fetches Q and KV again, or keeps the forward's).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np

from meshplan.algorithms.base import DTYPE_KNOB, Algorithm, Knob, PassTiming, new_builder, topology_record
from meshplan.algorithms.mesh.build import _Uses, fetch, groups, send_back
from meshplan.algorithms.mesh.grid import Grid, block_mapping, block_shapes, factorisations, parse_tile, translations
from meshplan.algorithms.mesh.order import ORDERS, TileCosts, TilePlan, plan_order, streams_estimate
from meshplan.algorithms.mesh.timing import cheap_timing, geometry
from meshplan.core.errors import UserError
from meshplan.cost.block_classes import mean_block_s
from meshplan.cost.bounds import schedule_timing
from meshplan.cost.cost import CostModel
from meshplan.model.matrix import attn_matrix
from meshplan.model.topology import Topology
from meshplan.model.workload import Workload
from meshplan.plan.plan import Plan, shared_owner
from meshplan.plan.schedule import Schedule, tensor_bytes

JUDGE_ORDERS_UP_TO = 256               # ranks up to which the simulator judges the candidate fetch orders


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise ValueError(text)
    return value


class Mesh(Algorithm):
    """Mesh-Attention: 2D tiles with KV partition rotation and a greedy in-tile order."""

    name = "mesh"
    summary = "a x b tiles of the block matrix: a−1 Q and b−1 KV chunks in, a−1 partial outputs back"
    knobs = {
        "tile": Knob("tile", "auto", None, "AxB with A·B = N, or auto"),
        "mapping": Knob("mapping", "auto", None, "auto, row-major or block:PxQ"),
        "partial_dtype": DTYPE_KNOB("partial_dtype", None, "dtype of partial outputs on the wire"),
        "dkv_dtype": DTYPE_KNOB("dkv_dtype", "fp32", "dtype of partial dQ and dK/dV on the wire"),
        "order": Knob("order", "auto", ORDERS, "fetch order in the tile"),
        "inflight": Knob("inflight", 2, None, "fetches in flight (a positive integer)", parse=_positive_int),
        "bwd_inputs": Knob("bwd_inputs", "refetch", ("refetch", "keep"),
                           "backward: fetch Q and KV again, or keep the forward's received chunks (memory)"),
    }

    # ------------------------------------------------------------------ plan
    def grid(self, n: int, knobs: dict[str, Any], workload: Workload, topo: Topology) -> Grid:
        """The tile grid (``auto``: the tile with the least estimated communication time)."""
        if knobs["tile"] != "auto":
            return parse_tile(knobs["tile"], n)
        return min((Grid(a, b) for a, b in factorisations(n)),
                   key=lambda gr: (_comm_estimate(gr, workload, topo, knobs), abs(gr.a - gr.b)))

    def plan(self, workload, topo, n_ranks, knobs, matrix=None) -> Plan:
        """Owners from the grid and KVR; devices from the mapping."""
        m = matrix if matrix is not None else attn_matrix(workload, n_ranks)
        grid = self.grid(n_ranks, knobs, workload, topo)
        owner = shared_owner(m, ("mesh", grid), grid.owner)      # one per grid: plans differ by their mappings
        dev, shape = _mapping(grid, topo, knobs["mapping"], workload, knobs)
        idx = np.arange(n_ranks)
        knobs = knobs | {"tile": f"{grid.a}x{grid.b}", "mapping": shape}
        return Plan(self.name, knobs, m, n_ranks, owner, idx, idx, dev, extra={"grid": grid})

    # ------------------------------------------------------------------ schedule
    def schedule(self, plan: Plan, topo: Topology) -> Schedule:
        """Forward and/or backward dataflows (see the module docstring).

        The ops depend on the tile plan, not on the mapping, so plans that differ only in their mapping
        share one build (a copy with its own ``device_of_rank`` and symmetries) through the
        :class:`~meshplan.algorithms.base.BuildCache` of the search that made them.
        """
        cached = plan.extra.get("schedule")
        if cached is not None:
            return cached
        tiles = {p: self.tile_plan(plan, topo, p) for p in plan.workload.pass_list}
        key = (id(plan.matrix), plan.extra["grid"], tuple(sorted((k, str(v)) for k, v in plan.knobs.items()
                                                                if k != "mapping")),
               tuple((p, t.order, tuple(t.groups), tuple(t.returns)) for p, t in tiles.items()), topo.name)
        builds = plan.extra.get("builds")            # a search run's BuildCache, if the plan came from one
        base = self._build(plan, topo, tiles) if builds is None else \
            builds.get(key, lambda: self._build(plan, topo, tiles))
        sched = dataclasses.replace(base, device_of_rank=plan.device_of_rank, knobs=plan.knobs)
        grid = plan.extra["grid"]
        p, q = _block_of(plan.knobs["mapping"], grid, topo)
        sched.symmetries = translations(grid, p, q) if p else []
        plan.extra["schedule"] = sched
        return sched

    def _build(self, plan: Plan, topo: Topology, tiles: dict[str, TilePlan]) -> Schedule:
        b = new_builder(self, plan, topo)
        grid, w = plan.extra["grid"], plan.workload
        b.stream("compute", "compute")
        b.stream("q", "comm")
        b.stream("kv", "comm")
        if "fwd" in w.pass_list:
            b.phase = 0
            b.stream("out", "comm")
            self._forward(b, plan, grid, tiles["fwd"])
        if "bwd" in w.pass_list:
            b.phase = 1
            b.stream("dq", "comm")
            b.stream("dkv", "comm")
            self._backward(b, plan, grid, tiles["bwd"])
        return b.build(topology_record(topo))

    def variants(self, plan: Plan, topo: Topology) -> list[Plan]:
        """With ``order=auto``, one plan per distinct candidate order (greedy and the naive orders): the
        simulator keeps the fastest, since one-rank models do not see NIC sharing between streams. Above
        ``JUDGE_ORDERS_UP_TO`` ranks (where every build costs seconds) the one-rank model's pick stands."""
        if plan.knobs["order"] != "auto":
            return [plan]
        return [alt for alt, _ in self._variant_tiles(plan, topo, _pass_costs(plan, topo))]

    def _variant_tiles(self, plan: Plan, topo: Topology,
                       costs: dict[str, TileCosts]) -> list[tuple[Plan, dict[str, TilePlan]]]:
        """:meth:`variants`, each with its tile plan per pass (``costs``: :func:`_pass_costs` of ``plan``, the same
        for every variant: an order changes no fetch, block or return)."""
        passes = plan.workload.pass_list
        if plan.knobs["order"] != "auto":
            return [(plan, {p: self.tile_plan(plan, topo, p, costs[p]) for p in passes})]
        orders = ORDERS[1:]
        if plan.n_ranks > JUDGE_ORDERS_UP_TO:
            orders = (self.tile_plan(plan, topo, passes[0], costs[passes[0]]).name,)
        out, seen = [], set()
        for order in orders:
            alt = dataclasses.replace(plan, knobs=plan.knobs | {"order": order}, extra=dict(plan.extra))
            alt.extra.pop("schedule", None)
            tiles = {p: self.tile_plan(alt, topo, p, costs[p]) for p in passes}
            key = tuple(t.order for t in tiles.values())
            if key not in seen:
                seen.add(key)
                out.append((alt, tiles))
        return out

    def tile_plan(self, plan: Plan, topo: Topology, pass_: str, costs: TileCosts | None = None) -> TilePlan:
        """The in-tile order for a pass, from the uncontended costs of this workload on this topology (``costs``:
        :func:`_tile_costs` of this plan and pass, when the caller has them)."""
        costs = _tile_costs(plan, topo, pass_) if costs is None else costs
        return plan_order(plan.extra["grid"].a, plan.extra["grid"].b, costs, plan.knobs["order"],
                          own_last=pass_ == "fwd")

    def _forward(self, b, plan: Plan, grid: Grid, tile: TilePlan) -> None:
        n, w = grid.n, plan.workload
        g = np.arange(n)
        own = {"q": b.tensor(g, "q", g, role="input"), "kv": b.tensor(g, "kv", g, role="input")}
        out = b.tensor(g, "out", g, role="output", dtype="fp32")
        recv_t, recv_op = fetch(b, grid, tile, own, {"q": "q", "kv": "kv"}, plan.knobs["inflight"])
        acc = {u: b.tensor(g, "out", grid.row_peer(g, u), dtype="fp32") for u in range(1, grid.a)}
        q_of = lambda u: [own["q"] if u == 0 else recv_t[("q", u)]]  # noqa: E731
        kv_of = lambda v: own["kv"] if v == 0 else recv_t[("kv", v)]  # noqa: E731
        outs = lambda rows, cols: [out if u == 0 else acc[u] for u in rows]  # noqa: E731
        uses, writers = _Uses(), {}
        groups(b, plan, grid, tile, q_in=q_of, kv_in=kv_of, outs=outs, recv_of=recv_op, combine="merge", uses=uses,
               writers=writers)
        if plan.knobs["bwd_inputs"] == "refetch":  # else the backward keeps what the forward received
            uses.free(b)
        send_back(b, grid, tile.returns, "row", acc, writers, kind="out", stream="out", step0=len(tile.order),
                  dtype=plan.knobs["partial_dtype"] or w.dtype, merge_into=out, combine="merge")

    def _backward(self, b, plan: Plan, grid: Grid, tile: TilePlan) -> None:
        n = grid.n
        g = np.arange(n)
        q, kv = b.tensor(g, "q", g, role="input"), b.tensor(g, "kv", g, role="input")
        out, dout = b.tensor(g, "out", g, role="input"), b.tensor(g, "dout", g, role="input")
        keep = plan.knobs["bwd_inputs"] == "keep"
        side = "dside" if keep else "qside"
        qside = b.tensor(g, side, g, role="input")
        dq, dkv = b.tensor(g, "dq", g, role="output", dtype="fp32"), b.tensor(g, "dkv", g, role="output", dtype="fp32")
        kept, kept_q = None, {}
        if keep:  # the forward's received chunks, still on the rank
            kept = {("kv", v): b.tensor(g, "kv", grid.col_peer(g, v), role="input") for v in range(1, grid.b)}
            kept_q = {u: b.tensor(g, "q", grid.row_peer(g, u), role="input") for u in range(1, grid.a)}
        recv_t, recv_op = fetch(b, grid, tile, {"q": qside, "kv": kv}, {"q": side, "kv": "kv"},
                                plan.knobs["inflight"], kept)
        dq_acc = {u: b.tensor(g, "dq", grid.row_peer(g, u), dtype="fp32") for u in range(1, grid.a)}
        dkv_acc = {v: b.tensor(g, "dkv", grid.col_peer(g, v), dtype="fp32") for v in range(1, grid.b)}
        q_of = lambda u: [q, out, dout] if u == 0 else [kept_q[u], recv_t[("q", u)]] if keep \
            else [recv_t[("q", u)]]  # noqa: E731
        kv_of = lambda v: kv if v == 0 else recv_t[("kv", v)]  # noqa: E731
        outs = lambda rows, cols: ([dq if u == 0 else dq_acc[u] for u in rows]  # noqa: E731
                                   + [dkv if v == 0 else dkv_acc[v] for v in cols])
        uses, writers = _Uses(), {}
        groups(b, plan, grid, tile, q_in=q_of, kv_in=kv_of, outs=outs, recv_of=recv_op, combine="accumulate",
               uses=uses, writers=writers)
        uses.free(b)
        wire = plan.knobs["dkv_dtype"]
        rows_done, cols_done = _completion(tile, grid)
        send_back(b, grid, rows_done, "row", dq_acc, writers, kind="dq", stream="dq", step0=len(tile.order),
                  dtype=wire, merge_into=dq, combine="accumulate")
        send_back(b, grid, cols_done, "col", dkv_acc, writers, kind="dkv", stream="dkv", step0=len(tile.order),
                  dtype=wire, merge_into=dkv, combine="accumulate")

    # ------------------------------------------------------------------ timing
    def timing(self, plan: Plan, topo: Topology) -> dict[str, PassTiming]:
        """Schedule-free bounds: each rank's blocks and each link's bytes (:mod:`meshplan.algorithms.mesh.timing`)."""
        costs = _pass_costs(plan, topo)
        alts = self._variant_tiles(plan, topo, costs)
        out = {}
        for p in plan.workload.pass_list:
            timings = []
            for alt, tiles in alts:                    # a bound must hold for whichever variant is kept
                t = cheap_timing(alt, topo, p, tiles[p])
                t.estimate_s = max(t.bound_s, streams_estimate(tiles[p], costs[p], plan.knobs["inflight"]))
                timings.append(t)
            out[p] = min(timings, key=lambda t: t.bound_s)
            out[p].estimate_s = min(t.estimate_s for t in timings)
        return out

    def refines(self, plan: Plan) -> bool:
        """Always: the built schedule's uncontended evaluation is tighter than the schedule-free bound."""
        return True

    def refine(self, plan: Plan, topo: Topology) -> dict[str, PassTiming]:
        """The uncontended evaluation of the built schedule (tighter; builds it), least over the variants."""
        out: dict[str, PassTiming] = {}
        for alt in self.variants(plan, topo):
            for p, t in schedule_timing(self.schedule(alt, topo), topo).items():
                if p not in out or t.bound_s < out[p].bound_s:
                    out[p] = t
        return out

    def knob_space(self, workload, topo, n_ranks, filters) -> list[dict[str, Any]]:
        """Every tile (or the one given), and for each every node-block mapping (or the one given)."""
        tiles = [filters["tile"]] if "tile" in filters else [f"{a}x{b}" for a, b in factorisations(n_ranks)]
        out = []
        for tile in tiles:
            grid = parse_tile(tile, n_ranks)
            maps = [filters["mapping"]] if "mapping" in filters else _mapping_choices(grid, topo)
            out += [filters | {"tile": tile, "mapping": m} for m in maps]
        return out


def _unit(topo: Topology) -> int:
    """Devices per node (several nodes), per NUMA domain (one node with domains), else all devices."""
    if topo.n_nodes > 1:
        return topo.gpus_per_node
    if topo.n_domains > 1:
        return topo.n_devices // topo.n_domains
    return topo.n_devices


def _block_of(mapping: str, grid: Grid, topo: Topology) -> tuple[int, int]:
    """(p, q) of a block mapping, or (0, 0) when the mapping is not a block mapping."""
    unit = _unit(topo)
    if mapping.startswith("block:"):
        p, q = (int(x) for x in mapping[6:].split("x"))
        return p, q
    if mapping == "row-major":
        if grid.a % unit == 0:
            return 1, unit
        if unit % grid.a == 0 and grid.b % (unit // grid.a) == 0:
            return unit // grid.a, grid.a
    return 0, 0


def _mapping_choices(grid: Grid, topo: Topology) -> list[str]:
    unit = _unit(topo)
    if unit >= grid.n:
        return ["row-major"]
    shapes = [f"block:{p}x{q}" for p, q in block_shapes(grid, unit)]
    rm = _block_of("row-major", grid, topo)
    return [s for s in shapes if (int(s[6:].split("x")[0]), int(s[6:].split("x")[1])) != rm] + ["row-major"]


def _mapping(grid: Grid, topo: Topology, mapping: str, workload: Workload, knobs) -> tuple[np.ndarray, str]:
    unit = _unit(topo)
    if unit >= grid.n or mapping == "row-major":
        return np.arange(grid.n), "row-major"
    shapes = block_shapes(grid, unit)
    if mapping == "auto":
        if not shapes:
            return np.arange(grid.n), "row-major"
        sizes = _sizes(workload, grid.n, knobs)
        p, q = min(shapes, key=lambda s: ((grid.a - s[1]) * (sizes["q"] + sizes["o"]) + (grid.b - s[0]) * sizes["kv"],
                                          -s[1]))
    elif mapping.startswith("block:"):
        try:
            p, q = (int(x) for x in mapping[6:].split("x"))
        except ValueError:
            p = q = 0
        if (p, q) not in shapes:
            valid = ", ".join(f"block:{a}x{b}" for a, b in shapes) or "none for this tile"
            raise UserError("--mapping", f"{mapping} does not tile a {grid.a}x{grid.b} grid with {unit} devices "
                            f"per {'node' if topo.n_nodes > 1 else 'domain'}", f"use row-major, auto or {valid}")
    else:
        raise UserError("--mapping", f"unknown mapping {mapping!r}", "use auto, row-major or block:PxQ")
    return block_mapping(grid, unit, p, q), f"block:{p}x{q}"


def _sizes(workload: Workload, n: int, knobs) -> dict[str, float]:
    c, cq = workload.seq_len // n, workload.n_queries // n
    h = workload.n_heads
    pd = knobs.get("partial_dtype") or workload.dtype
    dt = workload.dtype
    return {"q": tensor_bytes(workload, "q", cq, h, dt), "kv": tensor_bytes(workload, "kv", c, h, dt),
            "o": tensor_bytes(workload, "out", cq, h, pd)}


def _comm_estimate(grid: Grid, workload: Workload, topo: Topology, knobs) -> float:
    """Per-rank transfer time if every fetch took the slowest path of its kind (picks ``tile=auto``)."""
    s = _sizes(workload, grid.n, knobs)
    dev, _ = _mapping(grid, topo, "auto", workload, knobs)
    g = np.arange(grid.n)[None, :]
    lat, bw = topo.pair_stats(dev[grid.row_peer(g, np.arange(1, grid.a)[:, None])], dev[g])
    t = float(np.max(lat + (s["q"] + s["o"]) / bw, axis=1).sum()) if grid.a > 1 else 0.0
    lat, bw = topo.pair_stats(dev[grid.col_peer(g, np.arange(1, grid.b)[:, None])], dev[g])
    return t + (float(np.max(lat + s["kv"] / bw, axis=1).sum()) if grid.b > 1 else 0.0)


def _pass_costs(plan: Plan, topo: Topology) -> dict[str, TileCosts]:
    """:func:`_tile_costs` of every pass of the plan."""
    return {p: _tile_costs(plan, topo, p) for p in plan.workload.pass_list}


def _tile_costs(plan: Plan, topo: Topology, pass_: str) -> TileCosts:
    """Mean uncontended costs over ranks: one fetch of each kind, one return, one block."""
    w, m = plan.workload, plan.matrix
    c, cq = m.tokens_per_chunk, m.q_tokens_per_chunk
    geo = geometry(plan, topo)
    row, col = geo[("row", "in")], geo[("col", "in")]
    keep = pass_ == "bwd" and plan.knobs["bwd_inputs"] == "keep"
    q_kind, o_kind = ("q", "out") if pass_ == "fwd" else ("dside" if keep else "qside", "dq")
    o_dtype = (plan.knobs["partial_dtype"] or w.dtype) if pass_ == "fwd" else plan.knobs["dkv_dtype"]
    size_q = tensor_bytes(w, q_kind, cq, w.n_heads, w.dtype)
    size_o = tensor_bytes(w, o_kind, cq, w.n_heads, o_dtype)
    size_kv = tensor_bytes(w, "kv", c, w.n_heads, w.dtype)
    mean = lambda f, size: float((f["lat"].sum() + size * f["inv_bw"].sum()) / f["count"].sum()) \
        if f["count"].sum() else 0.0  # noqa: E731
    grid = plan.extra["grid"]
    t_block = mean_block_s(CostModel(topo), m, pass_, (grid.a, grid.b))
    t_kv = 0.0 if keep else mean(col, size_kv)         # kept KV chunks are there from the start
    return TileCosts(t_q=mean(row, size_q), t_kv=t_kv, t_o=mean(row, size_o), t_block=t_block)


def _completion(tile: TilePlan, grid: Grid) -> tuple[list[int], list[int]]:
    """Remote rows and columns in the order their last group runs."""
    last_row, last_col = {}, {}
    for i, (rows, cols, _) in enumerate(tile.groups):
        for u in rows:
            last_row[u] = i
        for v in cols:
            last_col[v] = i
    rows = sorted((u for u in range(1, grid.a)), key=lambda u: (last_row.get(u, -1), u))
    cols = sorted((v for v in range(1, grid.b)), key=lambda v: (last_col.get(v, -1), v))
    return rows, cols

