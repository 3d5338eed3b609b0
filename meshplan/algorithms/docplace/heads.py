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
    r, u = hg.rank, hg.u
    rr = np.repeat(r, u)
    return b.tensor(rr, kind, 2 * rr + 1, heads=hg.heads(np.tile(np.arange(u), len(r))),
                    role="input").reshape(len(r), u)


def _others(hg: HeadGroups) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Every (member i, other member of its subgroup) pair: (i, the other's index p', the other's member index),
    member-major."""
    u, n = hg.u, len(hg.rank)
    i = np.repeat(np.arange(n), u - 1)
    to_p = (np.repeat(hg.p, u - 1) + np.tile(np.arange(1, u), n)) % u
    return i, to_p, hg.member(hg.j, hg.p)[i] - hg.p[i] + to_p


def _scatter(b: ScheduleBuilder, hg: HeadGroups, pieces: dict[str, np.ndarray]) -> tuple[dict, np.ndarray]:
    """Head-scatter inside each subgroup, one batch per member (NCCL's all-to-all is grouped send/recv): returns
    (``held[kind]`` [M, u]: on member (j, p) chunk C_j[t] for heads H_p in column t, and each member's last recv
    op, −1 when u = 1)."""
    r, p = hg.rank, hg.p
    i, to_p, to = _others(hg)
    held = {k: np.full((len(r), hg.u), -1) for k in pieces}
    last = np.full(len(r), -1)
    for k, arr in pieces.items():
        held[k][np.arange(len(r)), p] = arr[np.arange(len(r)), p]
        if len(i):
            land = b.tensor(r[to], k, 2 * r[i] + 1, heads=hg.heads(to_p))
            _, rcv = b.transfer(r[i], r[to], arr[i, to_p], land, stream="a2a", step=0)
            held[k][to, p[i]] = land
            last[to] = rcv
    return held, last


def _gather(b: ScheduleBuilder, hg: HeadGroups, kind: str, results: np.ndarray, deps, dtype: str,
            step: int) -> None:
    """Head-gather (one batch, step ``step``): column t of ``results`` (chunk C_j[t], heads H_p) goes home to
    member (j, t), landing as that chunk's output for heads H_p."""
    r, p = hg.rank, hg.p
    i, to_p, to = _others(hg)
    if not len(i):
        return
    land = b.tensor(r[to], kind, 2 * r[to] + 1, heads=hg.heads(p[i]), dtype=dtype, role="output")
    snd, _ = b.transfer(r[i], r[to], results[i, to_p], land, stream="a2a", step=step, dtype=dtype,
                        send_deps=[d[i] for d in deps])
    b.free_after(results[i, to_p], snd)


def _accumulators(b: ScheduleBuilder, hg: HeadGroups, kind: str) -> np.ndarray:
    """[M, u] fp32 accumulators of ``kind`` for the subgroup's chunks C_j, heads H_p; the member's own chunk's
    (column p) is its output, the rest go home by the gather."""
    r, p = hg.rank, hg.p
    chunks = hg.chunks(hg.j)
    h0, h1 = hg.heads(p)
    own = np.arange(hg.u)[None, :] == p[:, None]
    out = np.full((len(r), hg.u), -1)
    for mask, role in ((own, "output"), (~own, "buffer")):
        ii, cc = np.nonzero(mask)
        if len(ii):
            out[ii, cc] = b.tensor(r[ii], kind, chunks[ii, cc], dtype="fp32", role=role, heads=(h0[ii], h1[ii]))
    return out


def _free_received(b: ScheduleBuilder, hg: HeadGroups, held, last: np.ndarray) -> None:
    """The pieces the scatter brought die after the member's last compute (its own stay: they are inputs)."""
    i, to_p, _ = _others(hg)
    for arr in held:
        b.free_after(arr[i, to_p], last[i])


def _ring_step(b: ScheduleBuilder, hg: HeadGroups, t: int, cur: np.ndarray, prev2: np.ndarray,
               arrived: np.ndarray):
    """KV of step t − 1 passed on to ((j + 1) mod m, p) as one buffer, once it has ``arrived`` ([M] ops: the
    scatter's last recv before step 1; later steps are ordered by the stream). ``cur`` [M, k]: the KV each member
    holds — at step 1 the scatter's u columns, sent packed (an all-to-all's output is one buffer), after that one
    tensor over the subgroup's u chunks. Returns (the KV landed [M, 1] on each member, the sends [M], the recvs
    [M] on each member)."""
    r, j, p = hg.rank, hg.j, hg.p
    to = hg.member(j + 1, p)
    h0, h1 = hg.heads(p)
    land = b.tensor(r[to], "kv", hg.chunks(j - (t - 1)), heads=(h0, h1))
    snd, rcv = b.transfer(r, r[to], cur, land, stream="kv", step=t, recv_deps=[prev2[to]], send_deps=[arrived])
    got, recvs = np.full((len(r), 1), -1), np.full(len(r), -1)
    got[to, 0], recvs[to] = land, rcv
    return got, snd, recvs


def _next_kv(b: ScheduleBuilder, hg: HeadGroups, t: int, cur: np.ndarray, prev2: np.ndarray, got: np.ndarray,
             passed_on: np.ndarray):
    """Ring step t ≥ 1 (:func:`_ring_step`): returns (the KV now held [M, 1], its recvs [M], the step-1 sends).
    A KV that travelled dies once computed and passed on; the scattered one (passed on at step 1) is freed with
    the rest of the scatter, after those sends."""
    held = cur
    cur, sends, recv = _ring_step(b, hg, t, held, prev2, got if t == 1 else np.full(len(hg.rank), -1))
    if t == 1:
        return cur, recv, sends
    b.free_after(held[:, 0], sends)
    return cur, recv, passed_on


def _columns(x: np.ndarray, ok: np.ndarray) -> list[np.ndarray]:
    """The tensor ids of ``x`` [M, k] of the members ``ok``, one array per column (an op's inputs or outputs)."""
    return [x[ok, c] for c in range(x.shape[1])]


def forward(b: ScheduleBuilder, hg: HeadGroups, permitted: np.ndarray) -> None:
    """The forward of every group in ``hg`` (module docstring); ``permitted`` is the matrix's [n, n]."""
    r, j, p = hg.rank, hg.j, hg.p
    held, got = _scatter(b, hg, {"q": _split(b, hg, "q"), "kv": _split(b, hg, "kv")})
    acc = _accumulators(b, hg, "out")
    mine = hg.chunks(j)
    cur, recv = held["kv"], got
    comps = [np.full(len(r), -1), np.full(len(r), -1)]
    last, passed_on = np.full(len(r), -1), np.full(len(r), -1)
    for t in range(hg.m):
        if t > 0:
            cur, recv, passed_on = _next_kv(b, hg, t, cur, comps[0], got, passed_on)
        kv_chunks = hg.chunks(j - t)
        ok = permitted[mine[:, :, None], kv_chunks[:, None, :]].any(axis=(1, 2))
        comp = np.full(len(r), -1)
        h0, h1 = hg.heads(p)
        comp[ok] = b.compute(r[ok], mine[ok], kv_chunks[ok], heads=(h0[ok], h1[ok]),
                             inputs=_columns(held["q"], ok) + _columns(cur, ok), outputs=_columns(acc, ok),
                             combine="merge", deps=[recv[ok]])
        if t > 0:
            b.free_after(cur[:, 0], comp)
        last = np.where(ok, comp, last)
        comps = [comps[1], np.where(ok, comp, comps[1])]
    _free_received(b, hg, held.values(), last)
    _free_received(b, hg, [held["kv"]], passed_on)     # the scattered KV also travels on at step 1
    _gather(b, hg, "out", acc, [last], b.w.dtype, 1)


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
    last, own_comp, adds, passed_on = np.full(len(r), -1), np.full(len(r), -1), [], np.full(len(r), -1)
    for t in range(hg.m):
        if t > 0:
            cur, recv, passed_on = _next_kv(b, hg, t, cur, comps[0], got, passed_on)
        kv_chunks = hg.chunks(j - t)
        ok = permitted[mine[:, :, None], kv_chunks[:, None, :]].any(axis=(1, 2))
        statics = _columns(saved["q"], ok) + _columns(saved["out"], ok) + _columns(held["dout"], ok)
        sel = np.flatnonzero(ok)
        if t == 0:
            part = dkv
        else:                       # this step's partial dK/dV of C_(j−t): one tensor over its u chunks
            part = np.full((len(r), 1), -1)
            part[sel, 0] = b.tensor(r[sel], "dkv", kv_chunks[sel], dtype="fp32", heads=(h0[sel], h1[sel]))
        comp = np.full(len(r), -1)
        comp[ok] = b.compute(r[ok], mine[ok], kv_chunks[ok], heads=(h0[ok], h1[ok]),
                             inputs=statics + _columns(cur, ok), outputs=_columns(dq, ok) + _columns(part, ok),
                             combine="accumulate", deps=[recv[ok]])
        if t == 0:
            own_comp = comp
        else:
            b.free_after(cur[:, 0], comp)
            home = hg.member(j - t, p)[sel]                # the partial goes straight to its chunks' home
            b.alloc_at(part[sel, 0], comp[sel])
            back = b.tensor(r[home], "dkv", kv_chunks[sel], dtype=dkv_dtype, heads=(h0[sel], h1[sel]))
            send, brecv = b.transfer(r[sel], r[home], part[sel, 0], back, stream="dkv", step=t, dtype=dkv_dtype,
                                     send_deps=[comp[sel]])
            b.free_after(part[sel, 0], send)
            adds.append((home, back, brecv))
        last = np.where(ok, comp, last)
        comps = [comps[1], np.where(ok, comp, comps[1])]
    _free_received(b, hg, held.values(), last)
    _free_received(b, hg, [held["kv"]], passed_on)
    last_add = np.full(len(r), -1)
    for home, back, brecv in adds:              # each home adds a partial into its chunks' accumulators
        add = b.combine_op(r[home], "accumulate", src=back, dst=dkv[home], deps=[brecv, own_comp[home]])
        b.free_after(back, add)
        last_add[home] = add
    _gather(b, hg, "dq", dq, [last], b.w.dtype, 1)
    _gather(b, hg, "dkv", dkv, [last, last_add], b.w.dtype, 2)
