"""Ring rotations shared by Ring (pass-KV) and pass-Q: one side of every block travels, the other stays.

At step s rank r holds the travelling chunk j = (r − s) mod N, which it received from rank r − 1 and
forwards to rank r + 1 while it computes (double buffering, as ring-flash-attention does). Backward: the
partial gradients of the travelling chunk travel with it and are summed on the way
(``hops="n"``: N hops, the accumulator starts at the chunk's owner and comes home; ``hops="n-1"``: the
owner keeps its own partial and adds the N−1-hop sum at the end).
"""

from __future__ import annotations

from typing import Callable

import numpy as np

from meshplan.plan import Plan
from meshplan.schedule import ScheduleBuilder

BlockFn = Callable[[np.ndarray, np.ndarray], tuple[np.ndarray, np.ndarray]]


def _recv_on(recv_ids: np.ndarray, n: int) -> np.ndarray:
    """Transfers are added with src = r, dst = r + 1: the recv landing on rank x is entry x − 1."""
    return recv_ids[(np.arange(n) - 1) % n]


def pass_travel(b: ScheduleBuilder, cur: np.ndarray, kind: str, s: int, n: int, stream: str, last_comp: np.ndarray):
    """Forward the travelling tensors to rank r + 1; returns (send ids, recv ids on each rank, new tensors).

    Double buffering: the recv of step s waits for the rank's previous compute (``last_comp``), so at most
    two travelling buffers are alive besides the rank's own.
    """
    r = np.arange(n)
    nxt = b.tensor(r, kind, (r - s - 1) % n)
    gate = last_comp[(r + 1) % n]
    snd, rcv = b.transfer(r, (r + 1) % n, cur, nxt[(r + 1) % n], stream=stream, step=s, recv_deps=[gate])
    return snd, _recv_on(rcv, n), nxt


def rotate_forward_merge(b: ScheduleBuilder, plan: Plan, travel: np.ndarray, kind: str,
                         block: BlockFn, make_io) -> list[np.ndarray]:
    """Forward pass: rotate ``travel`` tensors; every rank computes its block of each step.

    ``make_io(ok, s, j, cur)`` returns (inputs, outputs, combine, fresh) for the ranks ``ok`` of step s;
    ``fresh`` (or None) are tensors the compute op creates (allocated when it starts).
    Returns, per step, the compute op of every rank (−1 where its block is empty).
    """
    n, m = plan.n_ranks, plan.matrix
    r = np.arange(n)
    cur, prev_recv, steps, last_comp = travel, np.full(n, -1), [], np.full(n, -1)
    for s in range(n):
        j = (r - s) % n
        snd = rcv = nxt = None
        if s < n - 1:
            snd, rcv, nxt = pass_travel(b, cur, kind, s, n, stream=kind, last_comp=last_comp)
        qi, ki = block(r, j)
        ok = m.permitted[qi, ki]
        inputs, outputs, combine, fresh = make_io(ok, s, j, cur)
        comp = b.compute(r[ok], qi[ok], ki[ok], inputs=inputs, outputs=outputs, combine=combine,
                         deps=[prev_recv[ok]])
        if fresh is not None:
            b.alloc_at(fresh, comp)
        if s > 0:  # the received buffer dies after its compute and its forwarding send
            b.free_after(cur[ok], comp)
            if snd is not None:
                b.free_after(cur, snd)
        if nxt is not None:
            cur, prev_recv = nxt, rcv
        step_ops = np.full(n, -1)
        step_ops[ok] = comp
        steps.append(step_ops)
        last_comp = np.where(ok, step_ops, last_comp)
    return steps


def rotate_backward(b: ScheduleBuilder, plan: Plan, *, travel: np.ndarray, travel_kind: str,
                    grad_kind: str, grad_dtype: str, hops: str, block: BlockFn,
                    static_inputs: list[np.ndarray], local_grad: np.ndarray, travel_first: bool,
                    stream: str | None = None) -> None:
    """Backward pass of a rotation; gradients of the travelling chunk ride along (see module doc).

    ``static_inputs`` are the rank's own resident tensors; the compute op's inputs are the travelling
    tensor followed by them (``travel_first``) or them followed by it. Outputs: ``local_grad``
    (accumulated in place, fp32) and the travelling chunk's fresh partial gradient.
    """
    n, m = plan.n_ranks, plan.matrix
    r = np.arange(n)
    cur, prev_recv, last_comp = travel, np.full(n, -1), np.full(n, -1)
    g_in, g_recv, own = np.full(n, -1), np.full(n, -1), np.full(n, -1)
    for s in range(n):
        j = (r - s) % n
        snd = rcv = nxt = None
        if s < n - 1:
            snd, rcv, nxt = pass_travel(b, cur, travel_kind, s, n, stream=stream or travel_kind, last_comp=last_comp)
        qi, ki = block(r, j)
        ok = m.permitted[qi, ki]
        part = np.full(n, -1)
        fresh = ok | ((hops == "n-1") & (s == 1)) | ((hops == "n") & (s == 0))
        keep_own = n == 1 or (hops == "n-1" and s == 0)
        part[fresh] = b.tensor(r[fresh], grad_kind, j[fresh], dtype="fp32", role="output" if keep_own else "buffer")
        ins = [cur[ok]] + [x[ok] for x in static_inputs]
        if not travel_first:
            ins = ins[1:] + ins[:1]
        comp = np.full(n, -1)
        comp[ok] = b.compute(r[ok], qi[ok], ki[ok], inputs=ins, outputs=[local_grad[ok], part[ok]],
                             combine="accumulate", deps=[prev_recv[ok]])
        b.alloc_at(part[ok], comp[ok])
        last_comp = np.where(ok, comp, last_comp)
        if s > 0:
            b.free_after(cur[ok], comp[ok])
            if snd is not None:
                b.free_after(cur, snd)
        if n == 1:
            return
        g_in, g_recv, own = _grad_step(b, s, n, hops, ok, part, comp, (g_in, g_recv, own),
                                       grad_kind, grad_dtype)
        if nxt is not None:
            cur, prev_recv = nxt, rcv


def _grad_step(b, s, n, hops, ok, part, comp, state, grad_kind, grad_dtype):
    """Add the received gradient accumulator into this step's partial and pass it on."""
    g_in, g_recv, own = state
    r = np.arange(n)
    if hops == "n-1" and s == 0:
        return g_in, g_recv, part  # the owner keeps its own block's partial
    has_in = g_in >= 0
    acc_sel = ok & has_in
    acc = np.full(n, -1)
    acc[acc_sel] = b.combine_op(r[acc_sel], "accumulate", src=g_in[acc_sel], dst=part[acc_sel],
                                deps=[g_recv[acc_sel]])
    send_t = np.where(part >= 0, part, g_in)
    dep = np.where(acc >= 0, acc, np.where(ok, comp, -1))
    last = s == n - 1
    g_next = b.tensor(r, grad_kind, (r - s - 1) % n, dtype=grad_dtype,
                      role="output" if last and hops == "n" else "buffer")
    gs, gr = b.transfer(r, (r + 1) % n, send_t, g_next[(r + 1) % n], stream=grad_kind, step=s,
                        dtype=grad_dtype, send_deps=[dep])
    b.free_after(send_t, gs)
    b.free_after(g_in[acc_sel], acc[acc_sel])
    idle = (part >= 0) & ~ok  # a zero partial sent by a rank whose block is empty: allocated at its send
    b.alloc_at(part[idle], gs[idle])
    g_recv_new = _recv_on(gr, n)
    if last and hops == "n-1":  # the owner adds the N−1-hop sum into the partial it kept
        fin = b.combine_op(r, "accumulate", src=g_next, dst=own, deps=[g_recv_new])
        b.free_after(g_next, fin)
    return g_next, g_recv_new, own
