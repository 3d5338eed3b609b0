"""Lowering CHARM+ (merge, RM+, cross-domain query parallelism) to ops, forward and backward.

Ranks are domain-major: rank x = d·p + l. A *pipeline* is one pass of (some of) the partner lists' levels
inside the domain over a set of Q *slots*. ``query_order=fused``: pipeline 0 holds the rank's own Q (and,
with two or more domains, the Q of its counterpart in domain d + 1); pipeline k ≥ 1 the Q of the counterpart
in domain d + k + 1. ``foreign-first``: the own Q's levels but the last, then one pipeline per foreign Q (all
levels), then the own Q's last level. Foreign Q arrives on the ``x`` stream (all swaps posted in order, so
the next pipeline's Q lands while the current one runs); each foreign slot's accumulated partial goes back
to its owner on ``x`` at the end of its pipeline and is folded there after the rank's last block. KV is
fetched once (at its first use) and kept, so KV never crosses a domain.

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

from meshplan.algorithms.charm.lists import KV, Q, levels, roles
from meshplan.plan.build import ScheduleBuilder
from meshplan.plan.plan import Plan


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
        self.query_order = k.get("query_order", "fused")       # merge and rmplus have one domain

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
        self.homecoming: list = []                                      # foreign partials on their way home
        self.kv_last: dict[int, np.ndarray] = {}
        own = Slot(own_q, x, own_acc, np.full(self.n, -1), last=np.full(self.n, -1))
        foreign = [self._foreign(k, own_q) for k in range(self.m - 1)]
        if self.m > 1 and self.query_order == "foreign-first":
            held = max(len(self.levels) - 1, 0)
            parts = [([own], self.levels[:held], True)] + [([f], self.levels, True) for f in foreign] \
                + [([own], self.levels[held:], False)]
        else:
            pipelines = [[own] + foreign[:1]] + [[f] for f in foreign[1:]] if self.m > 1 else [[own]]
            parts = [(slots, self.levels, True) for slots in pipelines]
        for k, (slots, lv, first) in enumerate(parts):
            returns = self._pipeline(slots, k, lv, first)
            self._fold(returns)
            for s in slots:
                if s.owner is not None:
                    self._return_foreign(s, step=1000 + k)
        for ranks, land, rcv in self.homecoming:        # folded last: the own Q's blocks never wait on them
            fold = b.combine_op(ranks, self.combine, src=land, dst=own_acc[ranks], deps=[rcv])
            b.free_after(land, fold)
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

    def _pipeline(self, slots: list[Slot], k: int, lv: list[list[int]], first: bool = True) -> list:
        """Pipeline ``k`` over levels ``lv``: the own-KV blocks (when ``first``), then per level the fetches,
        the Q-peers' blocks (returned at once) and the own slots against the level's fetched KV — each group one
        kernel (CHARM+ runs 2c × c kernels)."""
        x = self.x
        for s in slots if first else []:   # the own Q first (its inputs are present), the foreign one as it lands
            op = self._op(np.ones(self.n, bool), [s.q], [s.chunk], [self.kv], [x], [s.acc],
                          None if self.fwd else [self.dkv], self.combine, [s.ready])
            self._mark([s], op)
        returns = []
        for offs in lv:
            landed = {}
            for j in offs:
                role = self.role[self.l, j]
                if j not in self.kv_from and (role == KV).any():
                    self._fetch_kv(j, role == KV)
                if (role == Q).any():
                    landed[j] = self._swap_q(j, role == Q, slots, step=k * self.p + j)
            q_offs, kv_offs = self._offsets(offs, Q), self._offsets(offs, KV)
            if q_offs.shape[1]:
                returns += self._q_peer_op(q_offs, landed, slots, step=k * self.p + offs[0])
            if kv_offs.shape[1]:
                self._kv_peer_op(kv_offs, slots)
        return returns

    def _offsets(self, offs: list[int], role: int) -> np.ndarray:
        """[n, h]: each rank's offsets of this level with ``role`` (equally many on every rank), ascending."""
        sel = self.role[self.l][:, offs] == role
        h = int(sel[0].sum())
        assert (sel.sum(axis=1) == h).all(), "partner roles must split every level equally"
        order = np.argsort(~sel, axis=1, kind="stable")[:, :h]
        return np.asarray(offs)[order]

    def _pick(self, offsets: np.ndarray, of) -> np.ndarray:
        """[n]: ``of(j)[x]`` with j = offsets[x] (per rank)."""
        out = np.full(self.n, -1)
        for j in np.unique(offsets):
            m = offsets == j
            out[m] = of(int(j))[m]
        return out

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

    def _swap_q(self, j: int, sel: np.ndarray, slots: list[Slot], step: int) -> list:
        """Swap every slot's Q with the Q-peer at offset j (one batch); per slot (landed tensor, recv op)."""
        b, x = self.b, self.x
        peer = self.partner(j)
        got = []
        for s in slots:
            land = np.full(self.n, -1)
            land[sel] = b.tensor(x[sel], self.qkind, s.chunk[peer[sel]])
            _, rcv = b.transfer(x[sel], peer[sel], s.q[x[sel]], land[peer[sel]], stream="q", step=step,
                                send_deps=[s.ready[sel]])
            on = np.full(self.n, -1)
            on[peer[sel]] = rcv
            got.append((land, on))
        return got

    def _q_peer_op(self, q_offs: np.ndarray, landed: dict, slots: list[Slot], step: int) -> list:
        """The Q-peers' slots against own KV in one op; each partial returns to its owner on ``out``."""
        b, x = self.b, self.x
        cols = [(a, si) for a in range(q_offs.shape[1]) for si in range(len(slots))]
        peer = {a: self.d * self.p + (self.l ^ q_offs[:, a]) for a in range(q_offs.shape[1])}
        q_t = [self._pick(q_offs[:, a], lambda j, si=si: landed[j][si][0]) for a, si in cols]
        recv = [self._pick(q_offs[:, a], lambda j, si=si: landed[j][si][1]) for a, si in cols]
        q_c = [slots[si].chunk[peer[a]] for a, si in cols]
        live = [self.permitted[c, x] for c in q_c]                     # rows with a permitted pair
        ok = np.any(live, axis=0)
        parts = []
        for c in q_c:
            t = np.full(self.n, -1)
            t[ok] = b.tensor(x[ok], self.acc_kind, c[ok], dtype="fp32")
            parts.append(t)
        op = self._op(ok, q_t, q_c, [self.kv], [x], parts, None if self.fwd else [self.dkv],
                      "write" if self.fwd else "accumulate", recv)
        returns = []
        for (a, si), t, c, lv, q, rc in zip(cols, parts, q_c, live, q_t, recv):
            b.free_after(q[ok], op[ok])
            b.free_after(q[~ok], rc[~ok])                                # a Q whose blocks the mask empties
            b.alloc_at(t[ok], op[ok])
            send = ok & lv
            b.free_after(t[ok & ~lv], op[ok & ~lv])
            if send.any():
                dst = peer[a][send]
                land = b.tensor(dst, self.acc_kind, c[send], dtype=self.part_dtype)
                snd, rcv = b.transfer(x[send], dst, t[send], land, stream="out", step=step, dtype=self.part_dtype,
                                      send_deps=[op[send]])
                b.free_after(t[send], snd)
                returns.append((dst, land, rcv, slots[si]))
        return returns

    def _kv_peer_op(self, kv_offs: np.ndarray, slots: list[Slot]) -> None:
        """The own slots against this level's fetched KV chunks in one op."""
        h = kv_offs.shape[1]
        kv_t = [self._pick(kv_offs[:, a], lambda j: self.kv_from[j][0]) for a in range(h)]
        recv = [self._pick(kv_offs[:, a], lambda j: self.kv_from[j][1]) for a in range(h)]
        kv_c = [self.d * self.p + (self.l ^ kv_offs[:, a]) for a in range(h)]
        kv_out = None
        if not self.fwd:
            for j in np.unique(kv_offs):
                self._dkv_part(int(j))
            kv_out = [self._pick(kv_offs[:, a], lambda j: self.dkv_part[j]) for a in range(h)]
        op = self._op(np.ones(self.n, bool), [s.q for s in slots], [s.chunk for s in slots], kv_t, kv_c,
                      [s.acc for s in slots], kv_out, self.combine, recv + [s.ready for s in slots])
        self._mark(slots, op)
        for a in range(h):
            for j in np.unique(kv_offs[:, a]):
                m = (kv_offs[:, a] == j) & (op >= 0)
                self.kv_last.setdefault(int(j), np.full(self.n, -1))[m] = op[m]

    def _op(self, mask, q_t, q_c, kv_t, kv_c, q_out, kv_out, combine: str, deps) -> np.ndarray:
        """One compute op per rank over the cartesian product of its Q chunks and KV chunks ([n] arrays per
        column); ranks outside ``mask`` or whose rectangle holds no permitted pair skip it. Forward: the
        outputs are one accumulator per Q chunk; backward: dQ per Q chunk then dK/dV per KV chunk."""
        qc, kc = np.stack(q_c, 1), np.stack(kv_c, 1)
        ok = mask & self.permitted[qc[:, :, None], kc[:, None, :]].any(axis=(1, 2))
        op = np.full(self.n, -1)
        if ok.any():
            outs = [o[ok] for o in q_out] + [o[ok] for o in (kv_out or [])]
            op[ok] = self.b.compute(self.x[ok], qc[ok], kc[ok], inputs=[t[ok] for t in q_t] + [t[ok] for t in kv_t],
                                    outputs=outs, combine=combine, deps=[np.asarray(d)[ok] for d in deps])
        return op

    def _mark(self, slots: list[Slot], op: np.ndarray) -> None:
        for s in slots:
            s.last[op >= 0] = op[op >= 0]

    def _dkv_part(self, j: int) -> np.ndarray:
        """The partial dK/dV of the KV fetched at offset j (accumulated over slots and pipelines)."""
        if j not in self.dkv_part:
            sel = self.kv_from[j][0] >= 0
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

    def _return_foreign(self, s: Slot, step: int) -> None:
        """The foreign slot's accumulated partial goes home on ``x``; its fold there waits for the pass's end."""
        b, x = self.b, self.x
        land = b.tensor(s.owner, self.acc_kind, s.owner, dtype=self.part_dtype)
        snd, rcv = b.transfer(x, s.owner, s.acc, land, stream="x", step=step, dtype=self.part_dtype,
                              send_deps=[s.last])
        b.free_after(s.acc, snd)
        self.homecoming.append((s.owner, land, rcv))

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
