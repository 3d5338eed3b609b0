"""Lowering CHARM+ (merge, RM+, cross-domain query parallelism) to ops, forward and backward.

Ranks are domain-major: rank x = d·p + l. A *pipeline* is one pass of the partner lists inside the domain
over a set of Q *slots*: pipeline 0 holds the rank's own Q (and, with two or more domains, the Q of its
counterpart in domain d + 1); pipeline k ≥ 1 the Q of the counterpart in domain d + k + 1. Foreign Q
arrives on the ``x`` stream (all pipelines' swaps posted in order, so the next pipeline's Q lands while the
current one runs); each foreign slot's accumulated partial goes back to its owner on ``x`` at the end of
its pipeline. KV is fetched once (pipeline 0) and kept, so KV never crosses a domain.

Per pipeline, per level in ``level_order``, per offset j: KV-peers swap KV (``kv`` stream), Q-peers swap
the pipeline's Q slots (``q`` stream, one batch). Compute order (the paper's Figure 3): the slots against
the rank's own KV first, then per level the Q-peer's slots against own KV (partials return at once on the
``out`` stream), then the own slots against the fetched KV. Returned partials are merged (forward) or
accumulated (backward) at the end of the pipeline. Backward mirrors it: the Q side is ``qside`` (Q, dO,
LSE, D); Q-peer blocks return partial dQ; KV-peer blocks accumulate the peer's partial dK/dV, returned once
after the last pipeline.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from meshplan.algorithms.charm_lists import KV, Q, levels, roles
from meshplan.plan import Plan
from meshplan.schedule import ScheduleBuilder


@dataclass
class Slot:
    """A Q chunk processed by a pipeline on every rank: its tensor, chunk id and accumulator per rank."""

    q: np.ndarray
    chunk: np.ndarray
    acc: np.ndarray
    ready: np.ndarray                     # recv op that delivered it (−1: resident)
    owner: np.ndarray | None = None       # rank to return the accumulator to (foreign slots)
    last: np.ndarray | None = None        # last op writing the accumulator, per rank (set by Lowering)


class Lowering:
    """One pass of a CHARM+-family schedule (``fwd`` or ``bwd``)."""

    def __init__(self, b: ScheduleBuilder, plan: Plan, p: int, mechanism: str, pass_: str) -> None:
        self.b, self.plan, self.p, self.pass_ = b, plan, p, pass_
        self.n = plan.n_ranks
        self.m = self.n // p
        self.x = np.arange(self.n)
        self.d, self.l = self.x // p, self.x % p
        self.role = roles(p, mechanism)
        self.permitted = plan.matrix.permitted
        k = plan.knobs
        self.fwd = pass_ == "fwd"
        self.qkind = "q" if self.fwd else "qside"
        self.acc_kind = "out" if self.fwd else "dq"
        self.part_dtype = (k.get("partial_dtype") or plan.workload.dtype) if self.fwd else k.get("dq_dtype", "fp32")
        self.combine = "merge" if self.fwd else "accumulate"
        order = levels(p)
        self.levels = order[::-1] if k.get("level_order") == "descending" else order

    def partner(self, j: int) -> np.ndarray:
        return self.d * self.p + (self.l ^ j)

    def counterpart(self, shift) -> np.ndarray:
        return ((self.d + shift) % self.m) * self.p + self.l

    # ------------------------------------------------------------------ the pass
    def run(self) -> None:
        b, x = self.b, self.x
        b.stream("compute", "compute")
        for s in ("kv", "q", "out"):
            b.stream(s, "comm")
        if self.m > 1:
            b.stream("x", "comm")
        own_q = b.tensor(x, self.qkind, x, role="input")
        self.kv = b.tensor(x, "kv", x, role="input")
        own_acc = b.tensor(x, self.acc_kind, x, role="output", dtype="fp32")
        self.dkv = None if self.fwd else b.tensor(x, "dkv", x, role="output", dtype="fp32")
        self.kv_from: dict[int, tuple[np.ndarray, np.ndarray]] = {}     # offset -> (tensor, recv op) per rank
        self.dkv_part: dict[int, np.ndarray] = {}
        self.kv_last: dict[int, np.ndarray] = {}
        own = Slot(own_q, x, own_acc, np.full(self.n, -1), last=np.full(self.n, -1))
        foreign = [self._foreign(k, own_q) for k in range(self.m - 1)]
        pipelines = [[own] + foreign[:1]] + [[f] for f in foreign[1:]] if self.m > 1 else [[own]]
        for k, slots in enumerate(pipelines):
            returns = self._pipeline(slots, k)
            self._fold(returns)
            for s in slots:
                if s.owner is not None:
                    self._return_foreign(s, own_acc, step=1000 + k)
        if not self.fwd:
            self._return_dkv()
        self._free_fetched_kv()

    def _foreign(self, k: int, own_q: np.ndarray) -> Slot:
        """Pipeline k's foreign Q: from the counterpart in domain d + k + 1 (own Q goes to d − k − 1)."""
        b, x = self.b, self.x
        src, dst = self.counterpart(k + 1), self.counterpart(-(k + 1))
        land = b.tensor(x, self.qkind, src)
        _, rcv = b.transfer(x, dst, own_q, land[dst], stream="x", step=k)
        ready = np.empty(self.n, dtype=np.int64)
        ready[dst] = rcv
        acc = b.tensor(x, self.acc_kind, src, dtype="fp32")
        return Slot(land, src, acc, ready, owner=src, last=np.full(self.n, -1))

    def _pipeline(self, slots: list[Slot], k: int) -> list:
        x = self.x
        for s in slots:
            self._compute(x, s, s.q, self.kv, s.chunk, x, s.acc, deps=[s.ready])
        returns = []
        for offs in self.levels:
            fetched = []
            for j in offs:
                kv_sel, q_sel = self.role[self.l, j] == KV, self.role[self.l, j] == Q
                if k == 0 and kv_sel.any():
                    self._fetch_kv(j, kv_sel)
                if q_sel.any():
                    returns += self._q_peer(j, q_sel, slots, step=k * self.p + j)
                if kv_sel.any():
                    fetched.append((j, kv_sel))
            for j, sel in fetched:
                t, rcv = self.kv_from[j]
                kv_chunk = self.partner(j)
                for s in slots:
                    out = s.acc if self.fwd else self._dkv_part(j, sel)
                    op = self._compute(x[sel], s, s.q[sel], t[sel], s.chunk[sel], kv_chunk[sel], s.acc[sel],
                                       deps=[rcv[sel], s.ready[sel]], kv_out=out[sel] if not self.fwd else None)
                    last = self.kv_last.setdefault(j, np.full(self.n, -1))
                    last[x[sel][op >= 0]] = op[op >= 0]
        return returns

    def _fetch_kv(self, j: int, sel: np.ndarray) -> None:
        b, x = self.b, self.x
        t = np.full(self.n, -1)
        t[sel] = b.tensor(x[sel], "kv", self.partner(j)[sel])
        src = x[sel]
        _, rcv = b.transfer(src, self.partner(j)[sel], self.kv[src], t[self.partner(j)[sel]], stream="kv",
                            step=j)
        on = np.full(self.n, -1)
        on[self.partner(j)[sel]] = rcv
        self.kv_from[j] = (t, on)

    def _q_peer(self, j: int, sel: np.ndarray, slots: list[Slot], step: int) -> list:
        """Swap the slots with the Q-peer at offset j, compute its Q against own KV, send the partials back."""
        b, x = self.b, self.x
        peer = self.partner(j)
        got = []
        for s in slots:                   # one batch: every slot's Q each way
            land = np.full(self.n, -1)
            land[sel] = b.tensor(x[sel], self.qkind, s.chunk[peer[sel]])
            _, rcv = b.transfer(x[sel], peer[sel], s.q[x[sel]], land[peer[sel]], stream="q", step=step,
                                send_deps=[s.ready[sel]])
            on = np.full(self.n, -1)
            on[peer[sel]] = rcv
            got.append((s, land, on))
        returns = []
        for s, land, on in got:
            qc = s.chunk[peer]                        # the peer's slot chunk, computed here against own KV
            ok = sel & self.permitted[qc, x]
            part = np.full(self.n, -1)
            part[ok] = b.tensor(x[ok], self.acc_kind, qc[ok], dtype="fp32")
            op = self._compute(x[ok], None, land[ok], self.kv[ok], qc[ok], x[ok], part[ok], deps=[on[ok]],
                               kv_out=None if self.fwd else self.dkv[ok], fresh=True)
            b.free_after(land[sel & ~ok], on[sel & ~ok])          # a Q whose block the mask empties
            b.free_after(land[ok], op)
            if ok.any():
                b.alloc_at(part[ok], op)
                snd, rcv = b.transfer(x[ok], peer[ok], part[ok], land_back := b.tensor(
                    peer[ok], self.acc_kind, qc[ok], dtype=self.part_dtype), stream="out", step=step,
                    dtype=self.part_dtype, send_deps=[op])
                b.free_after(part[ok], snd)
                returns.append((peer[ok], land_back, rcv, s))
        return returns

    def _compute(self, ranks, slot, q, kv, qc, kc, acc, deps, kv_out=None, fresh=False) -> np.ndarray:
        """One block per rank (skipping those the mask empties); forward merges into ``acc``; backward
        accumulates dQ into ``acc`` and dK/dV into ``kv_out`` (default: the rank's own dK/dV)."""
        ranks = np.asarray(ranks)
        ok = self.permitted[np.asarray(qc), np.asarray(kc)]
        out = np.full(len(ranks), -1)
        if not ok.any():
            return out
        if self.fwd:
            ins, outs = [q[ok], kv[ok]], [acc[ok]]
            combine = "write" if fresh else "merge"
        else:
            ins, outs = [q[ok], kv[ok]], [acc[ok], (self.dkv[ranks] if kv_out is None else kv_out)[ok]]
            combine = "accumulate"
        out[ok] = self.b.compute(ranks[ok], np.asarray(qc)[ok], np.asarray(kc)[ok], inputs=ins, outputs=outs,
                                 combine=combine, deps=[np.asarray(d)[ok] for d in deps])
        if slot is not None:
            slot.last[ranks[ok]] = out[ok]
        return out

    def _dkv_part(self, j: int, sel: np.ndarray) -> np.ndarray:
        """The partial dK/dV of the KV fetched at offset j (accumulated over slots and pipelines)."""
        if j not in self.dkv_part:
            t = np.full(self.n, -1)
            t[sel] = self.b.tensor(self.x[sel], "dkv", self.partner(j)[sel], dtype="fp32")
            self.dkv_part[j] = t
        return self.dkv_part[j]

    def _fold(self, returns: list) -> None:
        """Merge (forward) or accumulate (backward) the returned partials into the slots' accumulators."""
        for ranks, land, rcv, slot in returns:
            op = self.b.combine_op(ranks, self.combine, src=land, dst=slot.acc[ranks], deps=[rcv])
            self.b.free_after(land, op)
            slot.last[ranks] = op

    def _return_foreign(self, s: Slot, own_acc: np.ndarray, step: int) -> None:
        """The foreign slot's accumulated partial goes home on ``x`` and is merged/accumulated there."""
        b, x = self.b, self.x
        land = b.tensor(s.owner, self.acc_kind, s.owner, dtype=self.part_dtype)
        snd, rcv = b.transfer(x, s.owner, s.acc, land, stream="x", step=step, dtype=self.part_dtype,
                              send_deps=[s.last])
        b.free_after(s.acc, snd)
        fold = b.combine_op(s.owner, self.combine, src=land, dst=own_acc[s.owner], deps=[rcv])
        b.free_after(land, fold)

    def _return_dkv(self) -> None:
        """Each fetched KV's partial dK/dV goes back to its owner (``dkv_dtype``) and is accumulated."""
        b, x = self.b, self.x
        dt = self.plan.knobs.get("dkv_dtype", "fp32")
        for j, t in self.dkv_part.items():
            sel = t >= 0
            peer = self.partner(j)
            land = b.tensor(peer[sel], "dkv", peer[sel], dtype=dt)
            snd, rcv = b.transfer(x[sel], peer[sel], t[sel], land, stream="kv", step=2000 + j, dtype=dt,
                                  send_deps=[self.kv_last[j][sel]])
            b.free_after(t[sel], snd)
            fold = b.combine_op(peer[sel], "accumulate", src=land, dst=self.dkv[peer[sel]], deps=[rcv])
            b.free_after(land, fold)

    def _free_fetched_kv(self) -> None:
        for j, (t, _) in self.kv_from.items():
            sel = t >= 0
            self.b.free_after(t[sel], self.kv_last.get(j, np.full(self.n, -1))[sel])
