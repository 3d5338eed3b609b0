"""The chunks a document placement implies, and the exact work between them.

Rank r holds two chunks: chunk 2r, its whole documents, and chunk 2r + 1, its pieces of split documents. A
document split over the g ranks of its group is cut zigzag inside the group: 2g pieces of (nearly) equal size
(piece i = slot positions [⌊i·L/2g⌋, ⌊(i+1)·L/2g⌋)), member k holding pieces k and 2g − 1 − k, so every member
gets the same causal work (the zigzag of docs/algorithms.md, over the group instead of all ranks). Whole
documents never meet another chunk; a split document's pieces meet only its group's pieces. So the work is
block (2r, 2r) for what rank r keeps, and blocks between the odd chunks of a group for what it shares — which
chunks a rank must fetch, and from whom, follows.

Positions are the pack's (its slots, padding included); a piece's padding is its slot's tail (the document's
real end), as :class:`~meshplan.model.matrix.Chunking` expects.
"""

from __future__ import annotations

import numpy as np

from meshplan.algorithms.docplace.placement import DocPlacement
from meshplan.model.matrix import Chunking
from meshplan.model.pair_counts import UNBOUNDED, count_pairs, restrict


def pieces(placement: DocPlacement, slots, real_lens) -> dict[str, np.ndarray]:
    """Every piece of every document, in document order then piece order: arrays ``doc``, ``chunk``, ``start``
    (position), ``count`` (slot tokens), ``real_end`` (the document's real end, a position).

    Args:
        placement: where each document goes (:func:`~.placement.place_documents`).
        slots: tokens of each document's slot, in pack order (padding included).
        real_lens: real tokens of each document (≤ its slot).
    """
    slots = np.asarray(slots, dtype=np.int64)
    bounds = np.concatenate([[0], np.cumsum(slots)])
    real_end = bounds[:-1] + np.asarray(real_lens, dtype=np.int64)
    g = np.ones(slots.size, dtype=np.int64)
    first = placement.owner.copy()
    for d, ranks in placement.groups.items():
        g[d], first[d] = len(ranks), ranks[0]
    per_doc = np.where(g > 1, 2 * g, 1)                      # pieces per document
    doc = np.repeat(np.arange(slots.size), per_doc)
    i = np.arange(doc.size) - np.repeat(np.cumsum(per_doc) - per_doc, per_doc)     # piece index in its doc
    gd, m = g[doc], per_doc[doc]
    lo = bounds[doc] + (slots[doc] * i) // m
    hi = bounds[doc] + (slots[doc] * (i + 1)) // m
    member = np.minimum(i, 2 * gd - 1 - i)                   # zigzag: pieces k and 2g − 1 − k to member k
    chunk = np.where(gd > 1, 2 * (first[doc] + member) + 1, 2 * first[doc])
    return {"doc": doc, "chunk": chunk, "start": lo, "count": hi - lo, "real_end": real_end[doc]}


def block_pairs(p: dict[str, np.ndarray], n_chunks: int) -> np.ndarray:
    """[n_chunks, n_chunks] int64 permitted (query, key) pairs per (batch, head): causal inside each document,
    padding neither a query nor a key. Every pair of pieces of one document, at once."""
    doc = p["doc"]
    per_doc = np.bincount(doc, minlength=int(doc.max()) + 1)
    first = np.cumsum(per_doc) - per_doc
    reps = per_doc[doc]                                      # each piece meets every piece of its document
    qi = np.repeat(np.arange(doc.size), reps)
    ki = first[doc[qi]] + (np.arange(qi.size) - np.repeat(np.cumsum(reps) - reps, reps))
    vs, vc, _ = restrict(p["start"], 1, p["count"], 0, p["real_end"])
    got = count_pairs(vs[qi], vc[qi], vs[ki], vc[ki], 1, 0, UNBOUNDED)
    out = np.zeros((n_chunks, n_chunks), dtype=np.int64)
    np.add.at(out, (p["chunk"][qi], p["chunk"][ki]), got)
    return out


def chunking(p: dict[str, np.ndarray], n_chunks: int) -> Chunking:
    """The :class:`~meshplan.model.matrix.Chunking` of the pieces: chunk c's pieces in position order, each a
    stride-1 segment; rows padded with empty segments to one width."""
    order = np.lexsort((p["start"], p["chunk"]))
    chunk = p["chunk"][order]
    per = np.bincount(chunk, minlength=n_chunks)
    width = max(int(per.max()), 1)
    col = np.arange(chunk.size) - np.repeat(np.cumsum(per) - per, per)
    start, count, real_end = (np.zeros((n_chunks, width), dtype=np.int64) for _ in range(3))
    start[chunk, col], count[chunk, col], real_end[chunk, col] = (p[k][order] for k in ("start", "count",
                                                                                        "real_end"))
    offset = np.cumsum(count, axis=1) - count
    return Chunking("doc-place", n_chunks, start, np.ones_like(start), count, offset, np.ones(width, dtype=bool),
                    real_end)
