"""A split document's group run by direct fetch: each member fetches every other member's pieces (``doc-place``).

Rank r computes its pieces against its own (block (2r+1, 2r+1)); every other group member's pieces it fetches
directly, one batch per offset d = (r − s) mod N (at offset d rank r receives from r − d and sends to r + d: each
batch a permutation), and merges each block into its output (LSE merge) as the pieces land. A fetch waits for the
compute two fetches back (double buffering). Backward: the same blocks and fetches; the partial dK/dV of a fetched
piece goes straight back to its owner (offset d on the ``dkv`` stream, in ``dkv_dtype``), which adds it into its
own. Groups may overlap (a rank in two groups holds pieces of both in its one chunk). Whole documents (block
(2r, 2r)) are computed here too.
"""

from __future__ import annotations

import numpy as np

from meshplan.plan.build import ScheduleBuilder
from meshplan.plan.plan import Plan


class _Layout:
    """Which chunks hold tokens, and who fetches whose pieces at which offset."""

    def __init__(self, plan: Plan, fetch: np.ndarray) -> None:
        n, m = plan.n_ranks, plan.matrix
        self.n, self.r = n, np.arange(n)
        tokens = m.chunks.tokens
        self.whole = tokens[0::2] > 0                                          # [n] chunk 2r not empty
        self.shared = (tokens[1::2] > 0) & fetch                               # [n] chunk 2r + 1, fetched
        self.local = m.permitted[0::2, 0::2].diagonal().copy()                 # [n] block (2r, 2r) to compute
        self.own = m.permitted[1::2, 1::2].diagonal() & fetch                  # [n] block (2r+1, 2r+1)
        need = m.permitted[1::2, 1::2] & fetch[:, None] & fetch[None, :]       # [n, n] r needs s's pieces
        np.fill_diagonal(need, False)
        self.need = need
        dst, src = np.nonzero(need)
        self.offsets = sorted({int(d) for d in (dst - src) % n})

    def at(self, d: int) -> tuple[np.ndarray, np.ndarray]:
        """(receivers, senders) of offset d: rank r fetches from r − d where it needs those pieces."""
        r = self.r
        s = (r - d) % self.n
        ok = self.need[r, s]
        return r[ok], s[ok]


def _tensors(b: ScheduleBuilder, ranks: np.ndarray, chunk: np.ndarray, kinds, role: str, dtype=None) -> dict:
    return {k: b.tensor(ranks, k, chunk, role=role, dtype=dtype) for k in kinds}


def forward(b: ScheduleBuilder, plan: Plan, fetch: np.ndarray) -> None:
    """Whole documents, and the pieces of the groups of the ranks in ``fetch`` ([n] bool), forward."""
    lay = _Layout(plan, fetch)
    r = lay.r
    wr, sr = r[lay.whole], r[lay.shared]
    whole = _tensors(b, wr, 2 * wr, ("q", "kv"), "input")
    whole_out = b.tensor(wr, "out", 2 * wr, role="output", dtype="fp32")
    mine = _tensors(b, sr, 2 * sr + 1, ("q", "kv"), "input")
    out = b.tensor(sr, "out", 2 * sr + 1, role="output", dtype="fp32")
    at = lambda ranks, full: full[np.searchsorted(sr, ranks)]  # noqa: E731  (tensor of rank x's pieces)
    loc = lay.local[wr]
    b.compute(wr[loc], 2 * wr[loc], 2 * wr[loc], inputs=[whole["q"][loc], whole["kv"][loc]],
              outputs=[whole_out[loc]], combine="merge")
    own = lay.own[sr]
    last = np.full(lay.n, -1)
    prev = [np.full(lay.n, -1), np.full(lay.n, -1)]          # each rank's last two fetch computes
    last[sr[own]] = b.compute(sr[own], 2 * sr[own] + 1, 2 * sr[own] + 1, inputs=[mine["q"][own], mine["kv"][own]],
                              outputs=[out[own]], combine="merge")
    for d in lay.offsets:
        dst, src = lay.at(d)
        got = b.tensor(dst, "kv", 2 * src + 1)
        _, recv = b.transfer(src, dst, at(src, mine["kv"]), got, stream="kv", step=d, recv_deps=[prev[0][dst]])
        comp = b.compute(dst, 2 * dst + 1, 2 * src + 1, inputs=[at(dst, mine["q"]), got], outputs=[at(dst, out)],
                         combine="merge", deps=[recv])
        b.free_after(got, comp)
        prev[0][dst], prev[1][dst] = prev[1][dst], comp


def backward(b: ScheduleBuilder, plan: Plan, fetch: np.ndarray) -> None:
    """Whole documents, and the pieces of the groups of the ranks in ``fetch``, backward."""
    lay = _Layout(plan, fetch)
    r = lay.r
    dkv_dtype = plan.knobs["dkv_dtype"]
    wr, sr = r[lay.whole], r[lay.shared]
    kinds = ("q", "kv", "out", "dout")
    whole = _tensors(b, wr, 2 * wr, kinds, "input")
    mine = _tensors(b, sr, 2 * sr + 1, kinds, "input")
    whole_dq = b.tensor(wr, "dq", 2 * wr, role="output", dtype="fp32")
    whole_dkv = b.tensor(wr, "dkv", 2 * wr, role="output", dtype="fp32")
    dq = b.tensor(sr, "dq", 2 * sr + 1, role="output", dtype="fp32")
    dkv = b.tensor(sr, "dkv", 2 * sr + 1, role="output", dtype="fp32")
    at = lambda ranks, full: full[np.searchsorted(sr, ranks)]  # noqa: E731
    statics = lambda t, sel: [t["q"][sel], t["out"][sel], t["dout"][sel]]  # noqa: E731
    loc = lay.local[wr]
    b.compute(wr[loc], 2 * wr[loc], 2 * wr[loc], inputs=statics(whole, loc) + [whole["kv"][loc]],
              outputs=[whole_dq[loc], whole_dkv[loc]], combine="accumulate")
    own = lay.own[sr]
    own_comp = np.full(lay.n, -1)
    own_comp[sr[own]] = b.compute(sr[own], 2 * sr[own] + 1, 2 * sr[own] + 1,
                                  inputs=statics(mine, own) + [mine["kv"][own]], outputs=[dq[own], dkv[own]],
                                  combine="accumulate")
    prev = [np.full(lay.n, -1), np.full(lay.n, -1)]
    returned = []                                             # (owner ranks, received partials, recv ops)
    for d in lay.offsets:
        dst, src = lay.at(d)
        got = b.tensor(dst, "kv", 2 * src + 1)
        _, recv = b.transfer(src, dst, at(src, mine["kv"]), got, stream="kv", step=d, recv_deps=[prev[0][dst]])
        part = b.tensor(dst, "dkv", 2 * src + 1, dtype="fp32")
        sel = np.searchsorted(sr, dst)
        comp = b.compute(dst, 2 * dst + 1, 2 * src + 1,
                         inputs=[mine["q"][sel], mine["out"][sel], mine["dout"][sel], got],
                         outputs=[dq[sel], part], combine="accumulate", deps=[recv])
        b.alloc_at(part, comp)
        b.free_after(got, comp)
        back = b.tensor(src, "dkv", 2 * src + 1, dtype=dkv_dtype)
        send, brecv = b.transfer(dst, src, part, back, stream="dkv", step=d, dtype=dkv_dtype, send_deps=[comp])
        b.free_after(part, send)
        returned.append((src, back, brecv))             # (owner ranks, the partials they receive, the recvs)
        prev[0][dst], prev[1][dst] = prev[1][dst], comp
    for owners, back, brecv in returned:                     # each owner adds the partials of its pieces
        acc = b.combine_op(owners, "accumulate", src=back, dst=at(owners, dkv), deps=[brecv, own_comp[owners]])
        b.free_after(back, acc)
