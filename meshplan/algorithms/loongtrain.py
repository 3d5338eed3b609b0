"""LoongTrain (Gu et al., arXiv 2406.18485): head parallelism × Double-Ring-Attention.

The Ulysses grid of :mod:`meshplan.algorithms.ulysses` (degree u, ``--ulysses-degree``, default 1: pure
double ring) with its R = N/u groups split into n_win = R/w *windows* of w consecutive groups (``--inner-ring
W``, default: as many groups as fit in a node). Outer step o: rank (window a, position b) holds the KV
group of (a − o, b); an inner ring of w ranks rotates it (w − 1 dependent transfers inside the window)
while the outer ring sends it on to (a + 1, b) — one transfer across windows per outer step, overlapped
with the whole inner ring. Backward: the inner ring as Ring's (dK/dV ride along, N hops); each outer
group's dK/dV sum then goes home across the windows and is added there.

Bytes received per rank: the same KV chunks as USP's ring, (R − 1)·u·KVc' forward (KVc' the KV of a head
range), arriving as n_win·(w − 1) inner and n_win − 1 outer transfers; backward adds n_win·w·u·dKVc' inner
(none when w = 1) and
(n_win − 1)·u·dKVc' outer for the dK/dV sums — plus the all-to-alls of ulysses.py when u > 1.
"""

from __future__ import annotations

import numpy as np

from meshplan.algorithms.base import Knob, last_compute_op, positive_int_or_auto
from meshplan.algorithms.headsplit import Grid
from meshplan.algorithms.rotate import RingSpec, rotate_backward, rotate_forward_merge
from meshplan.algorithms.ulysses import USP
from meshplan.algorithms.usp_timing import double_ring_hops, headsplit_timing
from meshplan.core.errors import UserError


class LoongTrain(USP):
    """Head parallel × double ring (inner ring inside a node, outer ring across windows)."""

    name = "loongtrain"
    summary = "LoongTrain: head-parallel all-to-all × double ring (inner ring in a node, outer across windows)"
    knobs = {
        "ulysses_degree": Knob("ulysses_degree", 1, None, "head-parallel degree u (1: pure double ring)",
                               parse=positive_int_or_auto),
        "inner_ring": Knob("inner_ring", "auto", None, "inner ring size w in Ulysses groups (auto: a node's)",
                           parse=positive_int_or_auto),
        "rank_order": USP.knobs["rank_order"],
        "dkv_dtype": USP.knobs["dkv_dtype"],
    }

    lazy_refines = True    # its schedule-free bound is 2.5% (zigzag) to 10% (causal contiguous) under the built one

    def schedule_free_timing(self, plan, topo):
        """USP's schedule-free bound over the double ring's transfers (:mod:`meshplan.algorithms.usp_timing`)."""
        return headsplit_timing(plan, topo, double_ring_hops)

    def degree(self, workload, topo, n, knobs) -> int:
        """u: the knob (``auto``: USP's choice)."""
        return super().degree(workload, topo, n, knobs) if knobs["ulysses_degree"] == "auto" else \
            int(knobs["ulysses_degree"])

    def inner(self, topo, n: int, u: int, knobs: dict) -> int:
        """w: the knob, or the groups that fit in a node (at least 1, dividing R)."""
        R = n // u
        if knobs["inner_ring"] != "auto":
            return int(knobs["inner_ring"])
        w = max(1, min(R, topo.gpus_per_node // u))
        while R % w:
            w -= 1
        return w

    def check(self, workload, topo, n_ranks, knobs) -> None:
        """u per USP; w must divide R = N/u."""
        super().check(workload, topo, n_ranks, knobs)
        u = self.degree(workload, topo, n_ranks, knobs)
        if u < 1 or n_ranks % u:
            return
        w, R = self.inner(topo, n_ranks, u, knobs), n_ranks // u
        if w < 1 or R % w:
            raise UserError("--inner-ring", f"an inner ring of {w} does not divide the {R} ring ranks (N/u)",
                            f"use a divisor of {R}")

    def knob_space(self, workload, topo, n_ranks, filters) -> list[dict]:
        """The given knobs, else u = 1 and the node-sized inner ring (both overridable)."""
        return [dict(filters)]

    def plan(self, workload, topo, n_ranks, knobs, matrix=None):
        """USP's plan, with the inner ring size recorded."""
        p = super().plan(workload, topo, n_ranks, knobs, matrix)
        w = self.inner(topo, n_ranks, p.extra["grid"].u, knobs)
        p.knobs["inner_ring"] = w
        p.extra["inner_ring"] = w
        return p

    # ------------------------------------------------------------------ the double ring
    def _outer_steps(self, plan, grid: Grid):
        """Per outer step o: (o, inner RingSpec, block function, home of the group held at step o, the next
        window's rank each rank sends to, the group each rank receives for step o + 1 — None at the last)."""
        W = plan.extra["inner_ring"]
        n_win = grid.R // W
        a, pos = grid.g_of // W, grid.g_of % W
        inner_next = grid.rank_of[a * W + (pos + 1) % W, grid.p_of]
        outer_next = grid.rank_of[((a + 1) % n_win) * W + pos, grid.p_of]
        for o in range(n_win):
            groups = grid.groups[((np.arange(n_win)[:, None] - o) % n_win) * W + np.arange(W)[None, :]]
            ring = RingSpec(inner_next, pos, W, groups, grid.rank_heads(), ring_of=a)
            block = lambda rr, j, groups=groups: (grid.groups[grid.g_of[rr]], groups[a[rr], j])  # noqa: E731
            home = grid.rank_of[((a - o) % n_win) * W + pos, grid.p_of]
            incoming = grid.groups[((a - o - 1) % n_win) * W + pos] if o < n_win - 1 else None
            yield o, ring, block, home, outer_next, incoming

    @staticmethod
    def _send_on(b, grid: Grid, o: int, travel: np.ndarray, deps, outer_next: np.ndarray, incoming):
        """Post step o's outer transfer (each travelling group to the next window, one batch), overlapped with
        the inner ring; returns (new tensors, recvs on each rank, sends) or None at the last step."""
        if incoming is None:
            return None
        r = np.arange(grid.n)
        new, on, sends = (np.full(travel.shape, -1) for _ in range(3))
        for t in range(travel.shape[1]):
            land = b.tensor(r, "kv", incoming[:, t], heads=grid.rank_heads())
            snd, rcv = b.transfer(r, outer_next, travel[:, t], land[outer_next], stream="outer", step=o,
                                  send_deps=[deps])
            new[:, t], sends[:, t] = land, snd
            on[outer_next, t] = rcv
        return new, on, sends

    def _ring_forward(self, b, plan, grid, ring, held, acc, got) -> np.ndarray:
        if "outer" not in b.streams.names:
            b.stream("outer", "comm")
        travel, deps, last = held["kv"], got, np.full(grid.n, -1)
        io = lambda ok, s, j, cur: ([held["q"][ok, t] for t in range(grid.u)] + [c[ok] for c in cur],  # noqa: E731
                                    [acc[ok, t] for t in range(grid.u)], "merge", None)
        for o, inner, block, _, outer_next, incoming in self._outer_steps(plan, grid):
            nxt, sent = self._send_on(b, grid, o, travel, deps, outer_next, incoming), []
            steps = rotate_forward_merge(b, plan, travel, "kv", block, io, ring=inner, first_deps=deps,
                                         step0=o * inner.size, sent=sent)
            last_o = last_compute_op(steps, grid.n)
            last = np.where(last_o >= 0, last_o, last)
            travel, deps = self._retire(b, o, travel, deps, last_o, nxt, sent)
        return last

    @staticmethod
    def _retire(b, o: int, travel, deps, last_o, nxt, sent: list):
        """A received outer group dies after its uses and its forwarding (on the outer ring, and on the inner
        ring: ``sent``, which alone holds it on a rank that computes nothing with it, e.g. documents apart);
        returns the next (travel, deps)."""
        if o > 0:
            for t in range(travel.shape[1]):
                b.free_after(travel[:, t], last_o)
                for fwd in sent:
                    b.free_after(travel[:, t], fwd[:, t])
                if nxt is not None:
                    b.free_after(travel[:, t], nxt[2][:, t])
        return (nxt[0], nxt[1][:, 0]) if nxt is not None else (travel, deps)

    def _ring_backward(self, b, plan, grid, ring, kv, static, dq, got):
        for name in ("outer", "outer-dkv"):
            if name not in b.streams.names:
                b.stream(name, "comm")
        r, u = np.arange(grid.n), grid.u
        dt = plan.knobs.get("dkv_dtype", "fp32")
        travel, deps, last = kv, got, np.full(grid.n, -1)
        result = ready = None
        for o, inner, block, home_rank, outer_next, incoming in self._outer_steps(plan, grid):
            nxt, sent = self._send_on(b, grid, o, travel, deps, outer_next, incoming), []
            home, rdy, last_o = rotate_backward(
                b, plan, travel=travel, travel_kind="kv", grad_kind="dkv", grad_dtype=dt, hops="n", block=block,
                static_inputs=static, local_grad=[dq[:, t] for t in range(u)], travel_first=False, ring=inner,
                grad_role="buffer", first_deps=deps, step0=o * inner.size, sent=sent)
            last = np.where(last_o >= 0, last_o, last)
            if o == 0:
                result, ready = home, rdy.copy()
            else:                                       # this outer group's dK/dV sum goes home and is added
                landed = []
                for t in range(u):                      # one batch; the sums are added once it is posted
                    land = b.tensor(home_rank, "dkv", grid.groups[grid.g_of[home_rank], t], heads=grid.rank_heads(),
                                    dtype=dt)
                    snd, rcv = b.transfer(r, home_rank, home[:, t], land, stream="outer-dkv", step=o, dtype=dt,
                                          send_deps=[rdy[:, t]])
                    b.free_after(home[:, t], snd)
                    landed.append((land, rcv))
                for t, (land, rcv) in enumerate(landed):
                    add = b.combine_op(home_rank, "accumulate", src=land, dst=result[home_rank, t],
                                       deps=[rcv, ready[home_rank, t]])
                    b.free_after(land, add)
                    ready[home_rank, t] = add
            travel, deps = self._retire(b, o, travel, deps, last_o, nxt, sent)
        return result, ready, last
