"""Ring rotations shared by Ring (pass-KV) and pass-Q: one side of every block travels, the other stays.

At step s rank r holds the travelling chunk j = (r − s) mod N, which it received from rank r − 1 and
forwards to rank r + 1 while it computes (double buffering, as ring-flash-attention does). Backward: the
partial gradients of the travelling chunk travel with it and are summed on the way
(``hops="n"``: N hops, the accumulator starts at the chunk's owner and comes home; ``hops="n-1"``: the
owner keeps its own partial and adds the N−1-hop sum at the end).

A :class:`RingSpec` generalises the ring for hybrid methods (USP, LoongTrain): several disjoint rings of R
ranks at once, each ring position holding a *group* of chunks, each rank a head range. Then j is the
travelling group's ring position and a block is the cartesian product of two groups.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import numpy as np

from meshplan.plan.build import ScheduleBuilder
from meshplan.plan.plan import Plan

BlockFn = Callable[[np.ndarray, np.ndarray], tuple[np.ndarray, np.ndarray]]


@dataclass(frozen=True)
class RingSpec:
    """Disjoint rings over all ranks: rank r sends to ``nxt[r]`` and sits at ring position ``pos[r]`` of its
    ring of ``size`` ranks; ``groups[x]`` are the chunks held at position x ([size, k]; or [rings, size, k]
    with ``ring_of[r]`` naming each rank's ring when rings hold different chunks); ``heads`` each rank's
    query-head range ([n] arrays h0, h1) or None for all heads."""

    nxt: np.ndarray
    pos: np.ndarray
    size: int
    groups: np.ndarray
    heads: tuple[np.ndarray, np.ndarray] | None = None
    ring_of: np.ndarray | None = None

    def group(self, ranks: np.ndarray, x: np.ndarray) -> np.ndarray:
        """[len(ranks), k]: the chunks at position x of each rank's ring."""
        return self.groups[x] if self.ring_of is None else self.groups[self.ring_of[ranks], x]

    @staticmethod
    def simple(n: int) -> RingSpec:
        """One ring of n ranks, rank r at position r holding chunk r, all heads."""
        r = np.arange(n)
        return RingSpec((r + 1) % n, r, n, r[:, None])

    @property
    def prev(self) -> np.ndarray:
        """[n] the rank that sends to each rank."""
        out = np.empty_like(self.nxt)
        out[self.nxt] = np.arange(len(self.nxt))
        return out

    def h(self, sel=slice(None)):
        """The ``heads`` argument of builder calls for ranks ``sel``."""
        return None if self.heads is None else (self.heads[0][sel], self.heads[1][sel])

    def permitted(self, m, qi: np.ndarray, ki: np.ndarray) -> np.ndarray:
        """[n] whether block (qi, ki) (chunks or [n, k] groups) holds any permitted pair."""
        if qi.ndim == 1 and ki.ndim == 1:
            return m.permitted[qi, ki]
        qi, ki = qi.reshape(len(qi), -1), ki.reshape(len(ki), -1)
        return m.permitted[qi[:, :, None], ki[:, None, :]].any(axis=(1, 2))


def _recv_on(recv_ids: np.ndarray, ring: RingSpec) -> np.ndarray:
    """Transfers are added with src = r, dst = nxt[r]: the recv landing on rank x is entry prev[x]."""
    return recv_ids[ring.prev]


def pass_travel(b: ScheduleBuilder, cur: np.ndarray, kind: str, s: int, ring: RingSpec, stream: str,
                last_comp: np.ndarray, send_deps=(), step0: int = 0, sent: list | None = None):
    """Forward the travelling tensors ([n, k]: k single-chunk tensors per rank, one batch) to the next rank;
    returns (send ids, recv ids on each rank, new tensors), each [n, k]; the send ids are also appended to
    ``sent`` when it is a list.

    Double buffering: the recv of step s waits for the rank's previous compute (``last_comp``), so at most
    two travelling groups are alive besides the rank's own.
    """
    r = np.arange(len(ring.nxt))
    grp = ring.group(r, (ring.pos - s - 1) % ring.size)
    gate = last_comp[ring.nxt]
    snd, rcv, nxt = [], [], []
    for t in range(cur.shape[1]):
        new = b.tensor(r, kind, grp[:, t], heads=ring.h())
        st, rt = b.transfer(r, ring.nxt, cur[:, t], new[ring.nxt], stream=stream, step=step0 + s, recv_deps=[gate],
                            send_deps=list(send_deps))
        snd.append(st)
        rcv.append(_recv_on(rt, ring))
        nxt.append(new)
    if sent is not None:
        sent.append(np.stack(snd, 1))
    return np.stack(snd, 1), np.stack(rcv, 1), np.stack(nxt, 1)


def _firsts(first_deps, n: int) -> list[np.ndarray]:
    """``first_deps`` as a list of [n] op-id arrays (one array of −1 when None)."""
    if first_deps is None:
        return [np.full(n, -1)]
    if isinstance(first_deps, np.ndarray) and first_deps.ndim == 1:
        return [first_deps]
    return [np.asarray(d) for d in first_deps]


def _columns(x: np.ndarray, sel) -> list[np.ndarray]:
    return [x[sel, t] for t in range(x.shape[1])]


def _free_travelled(b: ScheduleBuilder, cur: np.ndarray, ok: np.ndarray, comp: np.ndarray, snd) -> None:
    """A received group dies after its compute and its forwarding send."""
    for t in range(cur.shape[1]):
        b.free_after(cur[ok, t], comp)
        if snd is not None:
            b.free_after(cur[:, t], snd[:, t])


def rotate_forward_merge(b: ScheduleBuilder, plan: Plan, travel: np.ndarray, kind: str,
                         block: BlockFn, make_io, ring: RingSpec | None = None,
                         stream: str | None = None, first_deps: np.ndarray | None = None,
                         step0: int = 0, sent: list | None = None) -> list[np.ndarray]:
    """Forward pass: rotate ``travel`` tensors ([n] or [n, k]); every rank computes its block of each step.

    ``make_io(ok, s, j, cur)`` returns (inputs, outputs, combine, fresh) for the ranks ``ok`` of step s
    (j: the travelling group's ring position; cur: the k travelling tensor arrays); ``fresh`` (or None)
    are tensors the compute op creates (allocated when it starts). Returns, per step, the compute op of
    every rank (−1 where its block is empty). ``first_deps`` ([n], or a list of them): what the first compute
    and the first
    forwarding send wait for (the all-to-all that delivered the travelling tensors, for hybrid methods).
    ``step0`` offsets the batch ids (rotations that follow each other on one stream need distinct ones).
    ``sent``, when a list, receives the sends that forward ``travel`` itself ([n, k]; the caller owns those
    tensors and frees them: after these sends too, a rank may compute nothing with them).
    """
    n, m = plan.n_ranks, plan.matrix
    ring = ring or RingSpec.simple(n)
    r = np.arange(n)
    cur = travel.reshape(n, -1)
    firsts = _firsts(first_deps, n)
    prev_recv, steps, last_comp = np.stack(firsts, 1), [], np.full(n, -1)
    for s in range(ring.size):
        j = (ring.pos - s) % ring.size
        snd = rcv = nxt = None
        if s < ring.size - 1:
            snd, rcv, nxt = pass_travel(b, cur, kind, s, ring, stream=stream or kind, last_comp=last_comp,
                                        send_deps=firsts if s == 0 else (), step0=step0, sent=sent if s == 0 else None)
        qi, ki = block(r, j)
        ok = ring.permitted(m, qi, ki)
        inputs, outputs, combine, fresh = make_io(ok, s, j, [cur[:, t] for t in range(cur.shape[1])])
        comp = b.compute(r[ok], qi[ok], ki[ok], inputs=inputs, outputs=outputs, combine=combine,
                         deps=_columns(prev_recv, ok), heads=ring.h(ok))
        if fresh is not None:
            b.alloc_at(fresh, comp)
        if s > 0:
            _free_travelled(b, cur, ok, comp, snd)
        if nxt is not None:
            cur, prev_recv = nxt, rcv
        step_ops = np.full(n, -1)
        step_ops[ok] = comp
        steps.append(step_ops)
        last_comp = np.where(ok, step_ops, last_comp)
    return steps


def rotate_backward(b: ScheduleBuilder, plan: Plan, *, travel: np.ndarray, travel_kind: str,
                    grad_kind: str, grad_dtype: str, hops: str, block: BlockFn,
                    static_inputs: list[np.ndarray], local_grad: list[np.ndarray] | np.ndarray,
                    travel_first: bool, stream: str | None = None, ring: RingSpec | None = None,
                    grad_stream: str | None = None, grad_role: str = "output", first_deps: np.ndarray | None = None,
                    step0: int = 0, sent: list | None = None):
    """Backward pass of a rotation; gradients of the travelling chunks ride along (see module doc).

    ``travel`` is [n] or [n, k] (k single-chunk tensors per rank); ``static_inputs`` are the rank's own
    resident tensors; the compute op's inputs are the travelling tensors followed by them
    (``travel_first``) or them followed by the travelling ones. Outputs: ``local_grad`` (one array, or
    several: accumulated in place, fp32) and the travelling chunks' fresh partial gradients, whose sums end
    at the chunks' home with role ``grad_role``.

    Returns (home, ready, last_comp): the final gradient tensors at each rank's home group ([n, k]), the ops
    after which each is complete ([n, k]) and each rank's last compute op ([n]). ``sent``: as forward.
    """
    n, m = plan.n_ranks, plan.matrix
    ring = ring or RingSpec.simple(n)
    local = [local_grad] if isinstance(local_grad, np.ndarray) else list(local_grad)
    r, R = np.arange(n), ring.size
    cur = travel.reshape(n, -1)
    k = cur.shape[1]
    firsts = _firsts(first_deps, n)
    prev_recv, last_comp = np.stack(firsts, 1), np.full(n, -1)
    state = (np.full((n, k), -1), np.full((n, k), -1), np.full((n, k), -1), None)  # acc in, its recv, own, ready
    for s in range(R):
        j = (ring.pos - s) % R
        snd = rcv = nxt = None
        if s < R - 1:
            snd, rcv, nxt = pass_travel(b, cur, travel_kind, s, ring, stream=stream or travel_kind, last_comp=last_comp,
                                        send_deps=firsts if s == 0 else (), step0=step0, sent=sent if s == 0 else None)
        qi, ki = block(r, j)
        ok = ring.permitted(m, qi, ki)
        part = np.full((n, k), -1)
        fresh = ok | ((hops == "n-1") & (s == 1)) | ((hops == "n") & (s == 0))
        keep_own = R == 1 or (hops == "n-1" and s == 0)
        for t in range(k):
            part[fresh, t] = b.tensor(r[fresh], grad_kind, ring.group(r[fresh], j[fresh])[:, t], dtype="fp32",
                                      role=grad_role if keep_own else "buffer", heads=ring.h(fresh))
        ins = _columns(cur, ok) + [x[ok] for x in static_inputs]
        if not travel_first:
            ins = ins[k:] + ins[:k]
        comp = np.full(n, -1)
        comp[ok] = b.compute(r[ok], qi[ok], ki[ok], inputs=ins,
                             outputs=[g[ok] for g in local] + _columns(part, ok),
                             combine="accumulate", deps=_columns(prev_recv, ok), heads=ring.h(ok))
        for t in range(k):
            b.alloc_at(part[ok, t], comp[ok])
        last_comp = np.where(ok, comp, last_comp)
        if s > 0:
            _free_travelled(b, cur, ok, comp[ok], snd)
        if R == 1:
            return part, np.repeat(comp[:, None], k, 1), last_comp
        state = _grad_step(b, s, ring, hops, ok, part, comp, state, grad_kind, grad_dtype,
                           grad_stream or grad_kind, grad_role, step0)
        if nxt is not None:
            cur, prev_recv = nxt, rcv
    g_in, g_recv, own, ready = state
    return (g_in, g_recv, last_comp) if hops == "n" else (own, ready, last_comp)


def _grad_step(b, s, ring: RingSpec, hops, ok, part, comp, state, grad_kind, grad_dtype, stream, role, step0):
    """Add the received gradient accumulators into this step's partials and pass them on ([n, k] each)."""
    g_in, g_recv, own, ready = state
    n, k = part.shape
    r = np.arange(n)
    if hops == "n-1" and s == 0:
        return g_in, g_recv, part, ready  # the owner keeps its own block's partial
    acc_sel = ok & (g_in[:, 0] >= 0)
    last = s == ring.size - 1
    grp = ring.group(r, (ring.pos - s - 1) % ring.size)
    new_in, new_recv, ready = np.full((n, k), -1), np.full((n, k), -1), np.full((n, k), -1)
    for t in range(k):
        acc = np.full(n, -1)
        acc[acc_sel] = b.combine_op(r[acc_sel], "accumulate", src=g_in[acc_sel, t], dst=part[acc_sel, t],
                                    deps=[g_recv[acc_sel, t]])
        send_t = np.where(part[:, t] >= 0, part[:, t], g_in[:, t])
        dep = np.where(acc >= 0, acc, np.where(ok, comp, -1))
        g_next = b.tensor(r, grad_kind, grp[:, t], dtype=grad_dtype,
                          role=role if last and hops == "n" else "buffer", heads=ring.h())
        gs, gr = b.transfer(r, ring.nxt, send_t, g_next[ring.nxt], stream=stream, step=step0 + s,
                            dtype=grad_dtype, send_deps=[dep])
        b.free_after(send_t, gs)
        b.free_after(g_in[acc_sel, t], acc[acc_sel])
        idle = (part[:, t] >= 0) & ~ok  # a zero partial sent by a rank whose block is empty: allocated at its send
        b.alloc_at(part[idle, t], gs[idle])
        new_in[:, t], new_recv[:, t] = g_next, _recv_on(gr, ring)
    for t in range(k if last and hops == "n-1" else 0):  # the owner adds the N−1-hop sum into the partial it
        # kept — after every column's transfer is posted (they form one batch)
        ready[:, t] = b.combine_op(r, "accumulate", src=new_in[:, t], dst=own[:, t], deps=[new_recv[:, t]])
        b.free_after(new_in[:, t], ready[:, t])
    return new_in, new_recv, own, ready
