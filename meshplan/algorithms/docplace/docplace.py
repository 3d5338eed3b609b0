"""``doc-place``: each document where its work is cheapest — whole on one rank, or zigzag over a subgroup.

The plan (:mod:`.placement`): documents by their tile-quantised causal work, longest first, each to the
least-loaded rank with room under the token cap (LPT, Graham 1969); a document above the mean work (or the cap)
split over the fewest consecutive ranks that bring it under (its group, inside a node when it fits). The layout
(:mod:`meshplan.model.doc_place`): rank r holds chunk 2r (its whole documents) and chunk 2r + 1 (its zigzag
pieces of split documents); the workload carries the placement as ``doc_ranks``.

The schedule, per pass:

* **forward**: rank r computes its whole documents (block (2r, 2r)) with no communication, and its pieces
  against its own (block (2r+1, 2r+1)); every other group member's pieces it fetches directly, one batch per
  offset d = (r − s) mod N (at offset d rank r receives from r − d and sends to r + d: each batch a
  permutation), and merges each block into its output (LSE merge) as the pieces land. A fetch waits for the
  compute two fetches back (double buffering).
* **backward**: the same blocks and fetches; the partial dK/dV of a fetched piece goes straight back to its
  owner (offset d on the ``dkv`` stream, in ``dkv_dtype``), which adds it into its own.

Bytes received per rank: Σ over its group peers s of KV(piece of s) forward; backward that again plus the
partial dK/dV of its own pieces from each peer. Whole documents cost nothing.
"""

from __future__ import annotations

import numpy as np

from meshplan.algorithms.base import DTYPE_KNOB, BuiltTiming, Knob, new_builder, topology_record
from meshplan.algorithms.docplace.placement import DEFAULT_TOKEN_CAP, place_documents
from meshplan.core.errors import SkipCandidate
from meshplan.model.matrix import attn_matrix
from meshplan.model.topology import Topology
from meshplan.model.workload import DOC_PLACE, Workload
from meshplan.plan.build import ScheduleBuilder
from meshplan.plan.plan import Plan
from meshplan.plan.schedule import Schedule


def _cap(raw: str) -> float:
    value = float(raw)
    if not value >= 1.0:
        raise ValueError(raw)
    return value


class DocPlace(BuiltTiming):
    """Documents placed by their work (module docstring)."""

    name = "doc-place"
    summary = "documents placed by work: short ones whole on a rank, long ones zigzag over a subgroup sized to them"
    places_tokens = True
    contended_estimate = True
    knobs = {
        "token_cap": Knob("token_cap", DEFAULT_TOKEN_CAP, None,
                          "most tokens per rank, as a multiple of the mean (>= 1)", _cap),
        "dkv_dtype": DTYPE_KNOB("dkv_dtype", "fp32", "dtype of partial dK/dV on the wire"),
    }

    def check(self, workload: Workload, topo: Topology, n_ranks: int, knobs: dict) -> None:
        """Documents only: a docs mask without a cached prefix or ``--valid-len``."""
        if workload.mask.kind != "docs" or workload.prefix_len or workload.valid_len is not None:
            raise SkipCandidate("documents only", "doc-place needs a docs mask (no prefix, no --valid-len)")

    def plan(self, workload, topo, n_ranks, knobs, matrix=None) -> Plan:
        """Place the documents (:func:`~.placement.place_documents` with the kernel's forward tile), then own
        every block by its query chunk's rank."""
        self.check(workload, topo, n_ranks, knobs)
        mask = workload.mask
        placed = place_documents(mask.doc_real_lens(), n_ranks, slots=mask.doc_lens,
                                 tile=topo.kernel.tile("fwd"), token_cap=knobs["token_cap"],
                                 ranks_per_node=_ranks_per_node(topo, n_ranks))
        w = workload.with_(layout=DOC_PLACE, doc_ranks=placed.doc_ranks)
        m = attn_matrix(w, 2 * n_ranks)
        home = np.arange(2 * n_ranks) // 2
        owner = np.where(m.permitted, home[:, None], -1)
        return Plan(self.name, knobs, m, n_ranks, owner, home, home, self.device_map(topo, n_ranks, knobs),
                    extra={"cap_ok": placed.cap_ok})

    def build(self, plan: Plan, topo: Topology) -> Schedule:
        """Local blocks, then the group's pieces fetched by offset (module docstring)."""
        b = new_builder(self, plan, topo)
        b.stream("compute", "compute")
        b.stream("kv", "comm")
        if "fwd" in plan.workload.pass_list:
            b.phase = 0
            _forward(b, plan)
        if "bwd" in plan.workload.pass_list:
            b.stream("dkv", "comm")
            b.phase = 1
            _backward(b, plan)
        return b.build(topology_record(topo))


def _ranks_per_node(topo: Topology, n: int) -> int:
    per = min(topo.gpus_per_node, n)
    return per if n % per == 0 else n


class _Layout:
    """Which chunks hold tokens, and who fetches whose pieces at which offset."""

    def __init__(self, plan: Plan) -> None:
        n, m = plan.n_ranks, plan.matrix
        self.n, self.r = n, np.arange(n)
        tokens = m.chunks.tokens
        self.whole, self.shared = tokens[0::2] > 0, tokens[1::2] > 0       # [n] chunk 2r / 2r + 1 not empty
        self.local = m.permitted[0::2, 0::2].diagonal().copy()                 # [n] block (2r, 2r) to compute
        self.own = m.permitted[1::2, 1::2].diagonal().copy()                   # [n] block (2r+1, 2r+1)
        need = m.permitted[1::2, 1::2].copy()                                  # [n, n] r needs s's pieces
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


def _forward(b: ScheduleBuilder, plan: Plan) -> None:
    lay = _Layout(plan)
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


def _backward(b: ScheduleBuilder, plan: Plan) -> None:
    lay = _Layout(plan)
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
