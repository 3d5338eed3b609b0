"""A split document's group run head-parallel: Ulysses inside each node, a ring over the group's nodes (USP
restricted to one group's pieces).

A group of g = m·u consecutive ranks (member k = rank a + k, at node-subgroup j = k // u, index p = k % u; each
subgroup inside one node) shares the documents split over it; member k holds their pieces in chunk
c_k = 2(a + k) + 1 (:mod:`meshplan.model.doc_place`). Per pass, as USP (:mod:`meshplan.algorithms.ulysses`)
runs it over all ranks:

* **scatter** (all-to-all inside the subgroup, stream ``a2a``): member (j, p) sends the head range H_p' of its
  pieces to member (j, p'); it then holds the subgroup's u chunks C_j for the query heads H_p (h/u of them);
* **ring** over the m subgroups (stream ``kv``): at step t member (j, p) holds the KV of subgroup (j − t) mod m
  for heads H_p, computes C_j × C_(j−t) in one kernel and passes that KV on to ((j + 1) mod m, p) (double
  buffered: a receive waits for the compute two steps back); outputs LSE-merged;
* **gather** (all-to-all back): each member's result for chunk C_j[p'] goes home to (j, p').

Backward: it starts from each rank's own pieces, as a drop-in attention that saves only its output and LSE must
(``meshplan.executor.autograd``): Q, K, V, O and dO are scattered (one more all-to-all of Q, K, V and O than USP,
whose training keeps the forward's head-sharded pieces); the same ring,
each step's partial dK/dV for C_(j−t) sent straight home to ((j − t) mod m, p) on the ``dkv`` stream (in
``dkv_dtype``) and added there; dQ and dK/dV gathered home. u must divide both the query and the KV heads (no
KV-head replication), so every landed piece is a distinct head range of its chunk's output.

Bytes per member with c tokens per chunk, β the input dtype's bytes: forward (u − 1)/u·c·(h + 2h_kv)·D·β in,
(u − 1)/u·c·h·D·β + LSE out and back, and (m − 1)·u·c·2(h_kv/u)·D·β on the ring — against (g − 1)·c·2h_kv·D·β
when the group's pieces are fetched directly. Across nodes only the ring's KV moves: u times less than direct
fetches over the same nodes.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from meshplan.plan.build import ScheduleBuilder


@dataclass(frozen=True)
class HeadGroups:
    """Every head-parallel group of one shape (u, m), as arrays over their members (member index i).

    Attributes:
        u: Ulysses degree (members per subgroup); m: subgroups (ring length); n_heads: query heads.
        first: [G] first rank of each group.
    """

    u: int
    m: int
    n_heads: int
    first: np.ndarray

    @property
    def g(self) -> int:
        return self.u * self.m

    @property
    def rank(self) -> np.ndarray:
        """[M] every member's rank, group by group."""
        return (self.first[:, None] + np.arange(self.g)[None, :]).ravel()

    @property
    def base(self) -> np.ndarray:
        return np.repeat(self.first, self.g)

    @property
    def j(self) -> np.ndarray:
        return np.tile(np.arange(self.g) // self.u, len(self.first))

    @property
    def p(self) -> np.ndarray:
        return np.tile(np.arange(self.g) % self.u, len(self.first))

    def member(self, j, p) -> np.ndarray:
        """[M] index of member (j, p) of each member's own group."""
        group = np.repeat(np.arange(len(self.first)), self.g)
        return group * self.g + (np.asarray(j) % self.m) * self.u + np.asarray(p) % self.u

    def chunks(self, j) -> np.ndarray:
        """[M, u] the chunks of subgroup j (each member's group)."""
        return 2 * (self.base[:, None] + (np.asarray(j) % self.m)[:, None] * self.u + np.arange(self.u)) + 1

    def heads(self, p) -> tuple[np.ndarray, np.ndarray]:
        """([M] h0, [M] h1): the query heads H_p."""
        w = self.n_heads // self.u
        p = np.asarray(p)
        return p * w, (p + 1) * w


def _split(b: ScheduleBuilder, hg: HeadGroups, kind: str) -> np.ndarray:
    """[M, u] each member's own pieces cut into the u head ranges (the inputs the scatter sends)."""
    r = hg.rank
    own = 2 * r + 1
    return np.stack([b.tensor(r, kind, own, heads=hg.heads(np.full(len(r), q)), role="input")
                     for q in range(hg.u)], 1)


def _scatter(b: ScheduleBuilder, hg: HeadGroups, pieces: dict[str, np.ndarray]) -> tuple[dict, np.ndarray]:
    """Head-scatter inside each subgroup: returns (``held[kind]`` [M, u]: on member (j, p) chunk C_j[t] for heads
    H_p in column t, and each member's last recv op, −1 when u = 1)."""
    r, j, p = hg.rank, hg.j, hg.p
    i = np.arange(len(r))
    held = {k: np.full((len(r), hg.u), -1) for k in pieces}
    last = np.full(len(r), -1)
    for k, arr in pieces.items():
        held[k][i, p] = arr[i, p]
    for d in range(1, hg.u):
        to_p = (p + d) % hg.u
        to = hg.member(j, to_p)
        for k, arr in pieces.items():
            land = b.tensor(r[to], k, 2 * r + 1, heads=hg.heads(to_p))
            _, rcv = b.transfer(r, r[to], arr[i, to_p], land, stream="a2a", step=d)
            held[k][to, p] = land
            last[to] = rcv
    return held, last


def _gather(b: ScheduleBuilder, hg: HeadGroups, kind: str, results: np.ndarray, deps, dtype: str,
            step: int) -> None:
    """Head-gather (steps ``step`` + 1 …): column t of ``results`` (chunk C_j[t], heads H_p) goes home to member
    (j, t), landing as that chunk's output for heads H_p."""
    r, j, p = hg.rank, hg.j, hg.p
    i = np.arange(len(r))
    for d in range(1, hg.u):
        to_p = (p + d) % hg.u
        to = r[hg.member(j, to_p)]
        land = b.tensor(to, kind, 2 * to + 1, heads=hg.heads(p), dtype=dtype, role="output")
        snd, _ = b.transfer(r, to, results[i, to_p], land, stream="a2a", step=step + d, dtype=dtype,
                            send_deps=list(deps))
        b.free_after(results[i, to_p], snd)


def _accumulators(b: ScheduleBuilder, hg: HeadGroups, kind: str) -> np.ndarray:
    """[M, u] fp32 accumulators of ``kind`` for the subgroup's chunks C_j, heads H_p; the member's own chunk's
    (column p) is its output, the rest go home by the gather."""
    r, p = hg.rank, hg.p
    chunks = hg.chunks(hg.j)
    h0, h1 = hg.heads(p)
    out = np.full((len(r), hg.u), -1)
    for t in range(hg.u):
        for sel, role in ((p == t, "output"), (p != t, "buffer")):
            if sel.any():
                out[sel, t] = b.tensor(r[sel], kind, chunks[sel, t], dtype="fp32", role=role,
                                       heads=(h0[sel], h1[sel]))
    return out


def _free_received(b: ScheduleBuilder, hg: HeadGroups, held, last: np.ndarray) -> None:
    """The pieces the scatter brought die after the member's last compute (its own stay: they are inputs)."""
    i, p = np.arange(len(hg.rank)), hg.p
    for arr in held:
        for d in range(1, hg.u):
            b.free_after(arr[i, (p + d) % hg.u], last)


def _ring_step(b: ScheduleBuilder, hg: HeadGroups, t: int, cur: np.ndarray, prev2: np.ndarray,
               arrived: np.ndarray):
    """KV of step t − 1 passed on to ((j + 1) mod m, p), once it has ``arrived`` ([M] ops: the scatter's last
    recv before step 1; later steps are ordered by the stream): returns (the KV landed [M, u] on each member, the
    sends [M] of each member's forwarding, the recvs [M] on each member)."""
    r, j, p = hg.rank, hg.j, hg.p
    i = np.arange(len(r))
    to = hg.member(j + 1, p)
    src_sub = (j - (t - 1)) % hg.m                         # the subgroup whose KV member i holds before step t
    chunks = hg.chunks(src_sub)
    got = np.full((len(r), hg.u), -1)
    sends, recvs = np.full(len(r), -1), np.full(len(r), -1)
    h0, h1 = hg.heads(p)
    for col in range(hg.u):
        land = b.tensor(r[to], "kv", chunks[:, col], heads=(h0, h1))
        snd, rcv = b.transfer(r, r[to], cur[i, col], land, stream="kv", step=t, recv_deps=[prev2[to]],
                              send_deps=[arrived])
        got[to, col] = land
        sends, recvs[to] = snd, rcv
    return got, sends, recvs


def forward(b: ScheduleBuilder, hg: HeadGroups, permitted: np.ndarray) -> None:
    """The forward of every group in ``hg`` (module docstring); ``permitted`` is the matrix's [n, n]."""
    r, j, p = hg.rank, hg.j, hg.p
    held, got = _scatter(b, hg, {"q": _split(b, hg, "q"), "kv": _split(b, hg, "kv")})
    acc = _accumulators(b, hg, "out")
    mine = hg.chunks(j)
    cur, recv = held["kv"], got
    comps = [np.full(len(r), -1), np.full(len(r), -1)]
    last, sends_prev, cur_prev = np.full(len(r), -1), None, None
    for t in range(hg.m):
        if t > 0:
            cur_prev = cur
            cur, sends_prev, recv = _ring_step(b, hg, t, cur, comps[0], got if t == 1 else np.full(len(r), -1))
            if t > 1:                                      # a travelled KV dies once computed and passed on
                b.free_after(cur_prev.ravel(), np.repeat(sends_prev, hg.u))
        kv_chunks = hg.chunks(j - t)
        ok = permitted[mine[:, :, None], kv_chunks[:, None, :]].any(axis=(1, 2))
        comp = np.full(len(r), -1)
        h0, h1 = hg.heads(p)
        comp[ok] = b.compute(r[ok], mine[ok], kv_chunks[ok], heads=(h0[ok], h1[ok]),
                             inputs=[held["q"][ok, c] for c in range(hg.u)] + [cur[ok, c] for c in range(hg.u)],
                             outputs=[acc[ok, c] for c in range(hg.u)], combine="merge", deps=[recv[ok]])
        if t > 0:
            b.free_after(cur.ravel(), np.repeat(comp, hg.u))
        last = np.where(ok, comp, last)
        comps = [comps[1], np.where(ok, comp, comps[1])]
    _free_received(b, hg, held.values(), last)
    _gather(b, hg, "out", acc, [last], b.w.dtype, hg.u)


def backward(b: ScheduleBuilder, hg: HeadGroups, permitted: np.ndarray, dkv_dtype: str) -> None:
    """The backward of every group in ``hg`` (module docstring)."""
    r, j, p = hg.rank, hg.j, hg.p
    held, got = _scatter(b, hg, {k: _split(b, hg, k) for k in ("q", "kv", "out", "dout")})
    saved = held
    dq, dkv = _accumulators(b, hg, "dq"), _accumulators(b, hg, "dkv")
    mine = hg.chunks(j)
    h0, h1 = hg.heads(p)
    cur, recv = saved["kv"], got
    comps = [np.full(len(r), -1), np.full(len(r), -1)]
    last, own_comp, adds = np.full(len(r), -1), np.full(len(r), -1), []
    for t in range(hg.m):
        if t > 0:
            cur_prev = cur
            cur, sends_prev, recv = _ring_step(b, hg, t, cur, comps[0], got if t == 1 else np.full(len(r), -1))
            if t > 1:
                b.free_after(cur_prev.ravel(), np.repeat(sends_prev, hg.u))
        kv_chunks = hg.chunks(j - t)
        ok = permitted[mine[:, :, None], kv_chunks[:, None, :]].any(axis=(1, 2))
        statics = [saved["q"][ok, c] for c in range(hg.u)] + [saved["out"][ok, c] for c in range(hg.u)] + \
            [held["dout"][ok, c] for c in range(hg.u)]
        if t == 0:
            part = dkv
        else:
            part = np.full((len(r), hg.u), -1)
            for c in range(hg.u):
                part[ok, c] = b.tensor(r[ok], "dkv", kv_chunks[ok, c], dtype="fp32", heads=(h0[ok], h1[ok]))
        comp = np.full(len(r), -1)
        comp[ok] = b.compute(r[ok], mine[ok], kv_chunks[ok], heads=(h0[ok], h1[ok]),
                             inputs=statics + [cur[ok, c] for c in range(hg.u)],
                             outputs=[dq[ok, c] for c in range(hg.u)] + [part[ok, c] for c in range(hg.u)],
                             combine="accumulate", deps=[recv[ok]])
        if t == 0:
            own_comp = comp
        else:
            b.free_after(cur.ravel(), np.repeat(comp, hg.u))
            home = hg.member(j - t, p)                     # the partial dK/dV goes straight to its chunks' home
            for c in range(hg.u):
                b.alloc_at(part[ok, c], comp[ok])
                back = b.tensor(r[home[ok]], "dkv", kv_chunks[ok, c], dtype=dkv_dtype, heads=(h0[ok], h1[ok]))
                send, brecv = b.transfer(r[ok], r[home[ok]], part[ok, c], back, stream="dkv", step=t,
                                         dtype=dkv_dtype, send_deps=[comp[ok]])
                b.free_after(part[ok, c], send)
                adds.append((home[ok], c, back, brecv))
        last = np.where(ok, comp, last)
        comps = [comps[1], np.where(ok, comp, comps[1])]
    _free_received(b, hg, held.values(), last)
    last_add = np.full(len(r), -1)
    for home, c, back, brecv in adds:                       # each home adds the partials of its chunks
        add = b.combine_op(r[home], "accumulate", src=back, dst=dkv[home, c], deps=[brecv, own_comp[home]])
        b.free_after(back, add)
        last_add[home] = add
    _gather(b, hg, "dq", dq, [last], b.w.dtype, hg.u)
    _gather(b, hg, "dkv", dkv, [last, last_add], b.w.dtype, 2 * hg.u)
