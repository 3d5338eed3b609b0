"""Ulysses (DeepSpeed) and USP (Ulysses × Ring): head parallelism by all-to-all, optionally with a ring.

Ulysses (Jacobs et al., arXiv 2309.14509): an all-to-all turns sequence-sharded Q, K, V into head-sharded
full sequences; each rank computes attention over the whole sequence for h/u heads; an all-to-all returns
O. USP (Fang & Zhao, arXiv 2405.07719): Ulysses of degree u inside groups × Ring-Attention of degree
R = N/u across groups — rank (g, p) holds the chunks of group g for heads H_p after the all-to-all, and KV
groups rotate among the R ranks with the same p (KV double-buffered, outputs LSE-merged). Ulysses is USP
with u = N. Grid and all-to-alls: :mod:`meshplan.algorithms.headsplit`.

Backward as training runs it: the head-sharded Q, K, V, O and LSE saved by the forward are the pass's
inputs; dO is scattered by an all-to-all; the ring backward runs as Ring's (dK/dV riding with KV,
``dkv_hops``, ``dkv_dtype`` on the ring); dQ and dK/dV return by an all-to-all in the input dtype and the
dK/dV pieces are summed at the chunk's owner (several pieces per KV head when u > h_kv).

Bytes received per rank, with c tokens per chunk, β the input dtype's bytes, h_kv' = ceil(h/(u·g)) KV
heads per rank (replication when u > h_kv):
    forward   (u−1)·B·c·(h/u + 2·h_kv')·D·β                       (scatter of Q, K, V)
            + (u−1)·(B·c·(h/u)·D·β + 4·B·c·h/u)                   (gather of O and its fp32 LSE)
            + (R−1)·u·2·B·c·h_kv'·D·β                             (the ring's KV)
    backward  (u−1)·B·c·(h/u)·D·β                                 (scatter of dO)
            + (R−1)·u·2·B·c·h_kv'·D·β + R·u·2·B·c·h_kv'·D·β_dkv    (ring: KV and the dK/dV accumulators;
                                                                    R−1 of those with dkv_hops = n-1)
            + (u−1)·B·c·(h/u + 2·h_kv')·D·β                       (gather of dQ, dK, dV)
With u = N (Ulysses) the ring terms vanish: about (u−1)/u · B·c·(2h + 2h_kv)·D·β forward (docs/algorithms.md).
"""

from __future__ import annotations

import numpy as np

from meshplan.algorithms.base import (
    DTYPE_KNOB,
    Algorithm,
    BuiltTiming,
    Knob,
    PassTiming,
    last_compute_op,
    new_builder,
    positive_int_or_auto,
    topology_record,
)
from meshplan.algorithms.headsplit import (
    RANK_ORDERS,
    Grid,
    check_degree,
    gather_heads,
    head_degree_problem,
    scatter_heads,
    split_inputs,
    valid_degrees,
)
from meshplan.algorithms.rotate import RingSpec, rotate_backward, rotate_forward_merge
from meshplan.algorithms.usp_timing import usp_timing
from meshplan.core.errors import SkipCandidate, UserError
from meshplan.model.matrix import attn_matrix
from meshplan.model.topology import Topology
from meshplan.plan.build import ScheduleBuilder
from meshplan.plan.plan import Plan, shared_owner
from meshplan.plan.schedule import Schedule


class USP(BuiltTiming):
    """USP: Ulysses of degree u inside groups × a ring of N/u groups."""

    name = "usp"
    summary = "Ulysses all-to-all of degree u × Ring-Attention over N/u groups (USP)"
    knobs = {
        "ulysses_degree": Knob("ulysses_degree", "auto", None, "Ulysses degree u (auto: the largest valid u that "
                               "fits in a node, below N)", parse=positive_int_or_auto),
        "rank_order": Knob("rank_order", "ulysses-first", RANK_ORDERS,
                           "ulysses-first: a Ulysses group on consecutive ranks (inside a node); ring-first"),
        "dkv_dtype": DTYPE_KNOB("dkv_dtype", "fp32", "dtype of partial dK/dV on the ring"),
        "dkv_hops": Knob("dkv_hops", "n", ("n", "n-1"), "dK/dV accumulator hops on the ring: n or n-1"),
    }

    # ------------------------------------------------------------------ degree and checks
    def degree(self, workload, topo: Topology, n: int, knobs: dict) -> int:
        """The Ulysses degree: the knob, or for ``auto`` the largest valid u < N within a node (else the
        smallest valid one)."""
        u = knobs["ulysses_degree"]
        if u != "auto":
            return int(u)
        ok = [v for v in valid_degrees(workload, n) if v < n]
        if not ok:
            return 0
        inside = [v for v in ok if v <= topo.gpus_per_node]
        return max(inside) if inside else min(ok)

    def check(self, workload, topo, n_ranks, knobs) -> None:
        """u must divide N and fit the heads (docs/algorithms.md); a user-given bad degree is an error."""
        super().check(workload, topo, n_ranks, knobs)
        u = self.degree(workload, topo, n_ranks, knobs)
        if knobs["ulysses_degree"] == "auto":
            if u == 0:
                raise SkipCandidate("no Ulysses degree fits", f"no u with 2 ≤ u < {n_ranks} divides {n_ranks} "
                                         f"ranks and fits {workload.n_heads}/{workload.n_kv_heads} heads")
            return
        why = head_degree_problem(workload, u) if n_ranks % u == 0 else f"{u} does not divide {n_ranks} ranks"
        if why:
            valid = valid_degrees(workload, n_ranks)
            raise UserError("--ulysses-degree", why, f"use one of {', '.join(map(str, valid))}" if valid else
                            f"no degree fits {n_ranks} ranks and these heads: use ring or mesh")

    def knob_space(self, workload, topo, n_ranks, filters) -> list[dict]:
        """Every valid degree 2 ≤ u < N: with Ulysses groups on consecutive ranks (USP's default) where the group
        fits in a node, and, on more than one node, with ring groups on consecutive ranks (yunchang's
        ``use_ulysses_low=False``: each ring's hops mostly inside a node, the all-to-all across nodes) at every
        degree — unless pinned (``--ulysses-degree``, ``--knob rank_order=...``). From 128 ranks each starts from
        its schedule-free bound, so the pairs the bounds prune cost little (at 256 H100s the ring-first ones are
        the fastest: 364-374 ms against 461 ms)."""
        multi = n_ranks > topo.gpus_per_node
        degrees = [filters["ulysses_degree"]] if "ulysses_degree" in filters else \
            [u for u in valid_degrees(workload, n_ranks) if u < n_ranks] or ["auto"]
        orders = [filters["rank_order"]] if "rank_order" in filters else \
            ["ulysses-first", "ring-first"] if multi else ["ulysses-first"]
        pinned = "ulysses_degree" in filters or "rank_order" in filters
        return [dict(filters) | {"ulysses_degree": u, "rank_order": o} for u in degrees for o in orders
                if pinned or u == "auto" or o == "ring-first" or u <= topo.gpus_per_node]

    # ------------------------------------------------------------------ plan
    def plan(self, workload, topo, n_ranks, knobs, matrix=None) -> Plan:
        """Group g's u ranks compute every permitted block of its query chunks, one head range each."""
        u = self.degree(workload, topo, n_ranks, knobs)
        check_degree(workload, n_ranks, u)
        m = matrix if matrix is not None else attn_matrix(workload, n_ranks)
        grid = Grid(n_ranks, u, knobs["rank_order"], workload.n_heads)
        row = grid.rank_of[grid.g_of, 0]                 # each query chunk's group's first rank
        owner = shared_owner(m, ("usp", row.tobytes()), lambda: np.broadcast_to(row[:, None], m.permitted.shape))
        idx = np.arange(n_ranks)
        return Plan(self.name, knobs | {"ulysses_degree": u}, m, n_ranks, owner, idx, idx,
                    self.device_map(topo, n_ranks, knobs), extra={"grid": grid})

    # ------------------------------------------------------------------ schedule
    def build(self, plan: Plan, topo: Topology) -> Schedule:
        """Scatter all-to-all, the ring over groups (none when u = N), gather all-to-all; per pass."""
        b = new_builder(self, plan, topo)
        grid: Grid = plan.extra["grid"]
        heads = grid.rank_heads()
        ring = RingSpec(grid.rank_of[(grid.g_of + 1) % grid.R, grid.p_of], grid.g_of, grid.R, grid.groups, heads)
        b.stream("compute", "compute")
        b.stream("a2a", "comm")
        if grid.R > 1:
            b.stream("kv", "comm")
        if "fwd" in plan.workload.pass_list:
            b.phase = 0
            self._forward(b, plan, grid, ring)
        if "bwd" in plan.workload.pass_list:
            if grid.R > 1:
                b.stream("dkv", "comm")
            b.phase = 1
            self._backward(b, plan, grid, ring)
        sched = b.build(topology_record(topo))
        sched.symmetries = _ring_symmetries(grid, topo)
        return sched

    quotient_builds = True

    def symmetries(self, plan: Plan, topo: Topology) -> list[list[np.ndarray]]:
        """The node permutations USP's programs may repeat under, the most reducing first: every ring turned by a node
        and moved to the next (:func:`_ring_symmetries`: rings over several nodes) or the shift by one node; then the
        moves alone — ring-first, rings hold the same chunks, so a move keeps every kernel whatever the mask and
        layout (a turn needs the ring's members to work alike) — or, Ulysses groups first, the shift by one group."""
        grid: Grid = plan.extra["grid"]
        r = np.arange(grid.n)
        step = grid.R if grid.order == "ring-first" else grid.u        # the next ring / the next group
        sets = [_ring_symmetries(grid, topo)] + super().symmetries(plan, topo) + [[(r + step) % grid.n]]
        out = []
        for gens in sets:
            if gens and not any(len(gens) == len(o) and all(np.array_equal(a, b) for a, b in zip(gens, o))
                                for o in out):
                out.append(gens)
        return out

    def _block(self, grid: Grid):
        return lambda rr, j: (grid.groups[grid.g_of[rr]], grid.groups[j])

    def _forward(self, b: ScheduleBuilder, plan: Plan, grid: Grid, ring: RingSpec) -> None:
        w = plan.workload
        held, got = scatter_heads(b, grid, {"q": split_inputs(b, grid, "q", role="input"),
                                            "kv": split_inputs(b, grid, "kv", role="input")}, stream="a2a", step=0)
        acc = _group_tensors(b, grid, "out", dtype="fp32", own_role="output")
        last = self._ring_forward(b, plan, grid, ring, held, acc, got)
        # the received Q, K, V pieces stay: training saves them for the backward
        gather_heads(b, grid, "out", acc, stream="a2a", step=1, dtype=w.dtype, role="output", deps=[last])

    def _backward(self, b: ScheduleBuilder, plan: Plan, grid: Grid, ring: RingSpec) -> None:
        n, w = plan.n_ranks, plan.workload
        r, u = np.arange(n), grid.u
        saved = {kind: _group_tensors(b, grid, kind, own_role="input", role="input") for kind in ("q", "kv", "out")}
        held, got = scatter_heads(b, grid, {"dout": split_inputs(b, grid, "dout", role="input")}, stream="a2a", step=0)
        dq = _group_tensors(b, grid, "dq", dtype="fp32", own_role="output")
        static = [saved["q"][:, t] for t in range(u)] + [saved["out"][:, t] for t in range(u)] + \
            [held["dout"][:, t] for t in range(u)]
        home, ready, last = self._ring_backward(b, plan, grid, ring, saved["kv"], static, dq, got)
        _free_received(b, grid, held.values(), last)
        gather_heads(b, grid, "dq", dq, stream="a2a", step=1, dtype=w.dtype, role="output", deps=[last])
        dkv = b.tensor(r, "dkv", r, dtype="fp32", role="output")
        own = home[r, grid.p_of]
        done = b.combine_op(r, "accumulate", src=own, dst=dkv, deps=[ready[r, grid.p_of], last])
        b.free_after(own, done)
        landed, got_back = gather_heads(b, grid, "dkv", home, stream="a2a", step=2, dtype=w.dtype, role="buffer",
                                        deps=[ready[:, t] for t in range(u)] + [last])
        for d in range(1, u):
            col = (grid.p_of + d) % u
            piece = landed[r, col]
            add = b.combine_op(r, "accumulate", src=piece, dst=dkv, deps=[got_back])
            b.free_after(piece, add)

    def _ring_forward(self, b, plan, grid: Grid, ring: RingSpec, held: dict, acc: np.ndarray, got) -> np.ndarray:
        """The ring over Ulysses groups (KV rotates, outputs LSE-merged); returns each rank's last compute."""
        io = lambda ok, s, j, cur: ([held["q"][ok, t] for t in range(grid.u)] + [c[ok] for c in cur],  # noqa: E731
                                    [acc[ok, t] for t in range(grid.u)], "merge", None)
        steps = rotate_forward_merge(b, plan, held["kv"], "kv", self._block(grid), io, ring=ring, first_deps=got)
        return last_compute_op(steps, plan.n_ranks)

    def _ring_backward(self, b, plan, grid: Grid, ring: RingSpec, kv: np.ndarray, static: list, dq: np.ndarray, got):
        """The ring backward (dK/dV ride with KV); returns (home dK/dV [n, u], ready ops, last compute)."""
        k = plan.knobs
        return rotate_backward(
            b, plan, travel=kv, travel_kind="kv", grad_kind="dkv", grad_dtype=k.get("dkv_dtype", "fp32"),
            hops=k.get("dkv_hops", "n"), block=self._block(grid), static_inputs=static,
            local_grad=[dq[:, t] for t in range(grid.u)], travel_first=False, ring=ring, grad_role="buffer",
            first_deps=got)

    # ------------------------------------------------------------------ timing
    schedule_free = True

    def schedule_free_timing(self, plan: Plan, topo: Topology) -> dict[str, PassTiming]:
        """The plan's lower bound without its schedule (:mod:`meshplan.algorithms.usp_timing`)."""
        return usp_timing(plan, topo)


class Ulysses(USP):
    """DeepSpeed-Ulysses: u = N, no ring."""

    name = "ulysses"
    summary = "all-to-all to head-sharded full sequences, attention per head range, all-to-all back (DeepSpeed)"
    knobs = {"rank_order": USP.knobs["rank_order"]}

    def degree(self, workload, topo, n, knobs) -> int:
        """u = N."""
        return n

    def check(self, workload, topo, n_ranks, knobs) -> None:
        """N must fit the heads (docs/algorithms.md): else skipped with the reason."""
        Algorithm.check(self, workload, topo, n_ranks, knobs)
        why = head_degree_problem(workload, n_ranks)
        if why:
            valid = ", ".join(map(str, [u for u in valid_degrees(workload, n_ranks) if u < n_ranks])) or "none"
            raise SkipCandidate("Ulysses degree does not fit the heads",
                                f"pure Ulysses cannot split {workload.n_heads} query / {workload.n_kv_heads} KV heads "
                                f"over {n_ranks} ranks ({why}); usp takes Ulysses degrees {valid}")

    def knob_space(self, workload, topo, n_ranks, filters) -> list[dict]:
        """One setting (the rank order does not matter with a single group)."""
        return [dict(filters)]

    def plan(self, workload, topo, n_ranks, knobs, matrix=None) -> Plan:
        """USP's plan with u = N (the ``ulysses_degree`` it records is N)."""
        p = super().plan(workload, topo, n_ranks, knobs | {"ulysses_degree": n_ranks}, matrix)
        return Plan(p.algorithm, knobs, p.matrix, n_ranks, p.owner, p.q_home, p.kv_home, p.device_of_rank, p.extra)


def _ring_symmetries(grid: Grid, topo: Topology) -> list[np.ndarray]:
    """Rank permutations the programs are declared to repeat under, for the simulator's reduction
    (:mod:`meshplan.cost.symmetry` checks each before it uses it): with ring groups on consecutive ranks spanning
    whole nodes (``ring-first``, R a multiple of the node's GPUs), every ring turned by one node, and every ring
    moved to the next (Ulysses position p -> p + 1) — together they take a rank to its local index on every node.
    None otherwise: the shift by one node is tried (Ulysses groups on consecutive ranks, or rings inside a node)."""
    per_node = topo.gpus_per_node
    if grid.order != "ring-first" or grid.R <= per_node or grid.R % per_node:
        return []
    r = np.arange(grid.n)
    p, g = np.divmod(r, grid.R)                        # ring p (Ulysses position), its member g
    return [p * grid.R + (g + per_node) % grid.R, (r + grid.R) % grid.n]


def _group_tensors(b: ScheduleBuilder, grid: Grid, kind: str, *, dtype: str | None = None, own_role: str,
                   role: str = "buffer") -> np.ndarray:
    """[n, u]: on rank (g, p), a tensor of ``kind`` for chunk ``groups[g][t]`` and heads H_p per column t; the
    rank's own chunk (t = p) gets ``own_role``."""
    n = grid.n
    r, h0, h1 = np.arange(n), *grid.rank_heads()
    chunks = grid.groups[grid.g_of]
    out = np.full((n, grid.u), -1)
    for t in range(grid.u):
        for sel, rl in ((grid.p_of == t, own_role), (grid.p_of != t, role)):
            if sel.any():
                out[sel, t] = b.tensor(r[sel], kind, chunks[sel, t], dtype=dtype, role=rl, heads=(h0[sel], h1[sel]))
    return out


def _free_received(b: ScheduleBuilder, grid: Grid, held, last: np.ndarray) -> None:
    """Pieces received by the scatter die after the rank's last compute (its own input pieces stay)."""
    r = np.arange(grid.n)
    for arr in held:
        for d in range(1, grid.u):
            b.free_after(arr[r, (grid.p_of + d) % grid.u], last)
