"""The ``doc-place`` layout: the chunks a document placement implies, and the exact work between them.

A placement (decided by :mod:`meshplan.algorithms.docplace.placement`, carried by the workload as
``doc_ranks``) gives each document its first rank and its group size g (1: kept whole). Rank r holds two
chunks: chunk 2r, its whole documents, and chunk 2r + 1, its pieces of split documents. A document split over
the g ranks of its group is cut zigzag inside the group: 2g pieces of (nearly) equal size (piece i = slot
positions [⌊i·L/2g⌋, ⌊(i+1)·L/2g⌋)), member k holding pieces k and 2g − 1 − k, so every member gets the same
causal work (the zigzag of docs/algorithms.md, over the group instead of all ranks). Whole documents never meet
another chunk; a split document's pieces meet only its group's pieces. So the work is block (2r, 2r) for what
rank r keeps, and blocks between the odd chunks of a group for what it shares — which chunks a rank must
fetch, and from whom, follows.

Positions are the pack's (its slots, padding included); a piece's padding is its slot's tail (the document's
real end), as :class:`~meshplan.model.chunking.Chunking` expects.
"""

from __future__ import annotations

import numpy as np

from meshplan.core.errors import UserError
from meshplan.model.chunking import Chunking
from meshplan.model.pair_counts import UNBOUNDED, count_pairs, restrict


def pieces(doc_ranks, slots, real_lens) -> dict[str, np.ndarray]:
    """Every piece of every document, in document order then piece order: arrays ``doc``, ``chunk``, ``start``
    (position), ``count`` (slot tokens), ``real_end`` (the document's real end, a position).

    Args:
        doc_ranks: per document (first rank, group size g); g = 1 keeps it whole on its first rank.
        slots: tokens of each document's slot, in pack order (padding included).
        real_lens: real tokens of each document (≤ its slot).
    """
    slots = np.asarray(slots, dtype=np.int64)
    bounds = np.concatenate([[0], np.cumsum(slots)])
    real_end = bounds[:-1] + np.asarray(real_lens, dtype=np.int64)
    ranks = np.asarray(doc_ranks, dtype=np.int64).reshape(-1, 2)
    first, g = ranks[:, 0], ranks[:, 1]
    per_doc = np.where(g > 1, 2 * g, 1)                      # pieces per document
    doc = np.repeat(np.arange(slots.size), per_doc)
    i = np.arange(doc.size) - np.repeat(np.cumsum(per_doc) - per_doc, per_doc)     # piece index in its doc
    gd, m = g[doc], per_doc[doc]
    lo = bounds[doc] + (slots[doc] * i) // m
    hi = bounds[doc] + (slots[doc] * (i + 1)) // m
    member = np.minimum(i, 2 * gd - 1 - i)                   # zigzag: pieces k and 2g − 1 − k to member k
    chunk = np.where(gd > 1, 2 * (first[doc] + member) + 1, 2 * first[doc])
    return {"doc": doc, "chunk": chunk, "start": lo, "count": hi - lo, "real_end": real_end[doc]}


def _piece_pairs(p: dict[str, np.ndarray]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(query piece, key piece, permitted pairs) for every pair of pieces of one document, at once: causal
    inside the document, padding neither a query nor a key."""
    doc = p["doc"]
    per_doc = np.bincount(doc, minlength=int(doc.max()) + 1)
    first = np.cumsum(per_doc) - per_doc
    reps = per_doc[doc]                                      # each piece meets every piece of its document
    qi = np.repeat(np.arange(doc.size), reps)
    ki = first[doc[qi]] + (np.arange(qi.size) - np.repeat(np.cumsum(reps) - reps, reps))
    vs, vc, _ = restrict(p["start"], 1, p["count"], 0, p["real_end"])
    return qi, ki, count_pairs(vs[qi], vc[qi], vs[ki], vc[ki], 1, 0, UNBOUNDED)


def block_pairs(p: dict[str, np.ndarray], n_chunks: int) -> np.ndarray:
    """[n_chunks, n_chunks] int64 permitted (query, key) pairs per (batch, head) between the chunks."""
    qi, ki, got = _piece_pairs(p)
    out = np.zeros((n_chunks, n_chunks), dtype=np.int64)
    np.add.at(out, (p["chunk"][qi], p["chunk"][ki]), got)
    return out


def _columns(p: dict[str, np.ndarray], n_chunks: int) -> tuple[np.ndarray, np.ndarray]:
    """(order, column): the pieces sorted by (chunk, position), and each piece's column (segment index) in its
    chunk's row of the Chunking."""
    order = np.lexsort((p["start"], p["chunk"]))
    per = np.bincount(p["chunk"], minlength=n_chunks)
    column = np.empty(order.size, dtype=np.int64)
    column[order] = np.arange(order.size) - np.repeat(np.cumsum(per) - per, per)
    return order, column


def block_work(w, ch: Chunking) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """What :class:`~meshplan.model.matrix.AttnMatrix` needs of a doc-place workload cut into ``ch``:
    (pairs [n, n], q_involved and kv_involved [n, n, seg]: which segments of the chunks take part)."""
    p = pieces(w.doc_ranks, w.mask.doc_lens, w.mask.doc_real_lens())
    n, width = ch.n, ch.start.shape[1]
    _, column = _columns(p, n)
    qi, ki, got = _piece_pairs(p)
    pairs = np.zeros((n, n), dtype=np.int64)
    np.add.at(pairs, (p["chunk"][qi], p["chunk"][ki]), got)
    q_inv, kv_inv = np.zeros((n, n, width), dtype=bool), np.zeros((n, n, width), dtype=bool)
    hit = got > 0
    qc, kc = p["chunk"][qi[hit]], p["chunk"][ki[hit]]
    q_inv[qc, kc, column[qi[hit]]] = True
    kv_inv[qc, kc, column[ki[hit]]] = True
    return pairs, q_inv, kv_inv


def chunking_of(w, n: int) -> Chunking:
    """The chunks of a doc-place workload (``w.doc_ranks``) on n/2 ranks: n chunks.

    Raises:
        UserError: n odd, or a document placed past the last rank.
    """
    ranks = np.asarray(w.doc_ranks, dtype=np.int64).reshape(-1, 2)
    if n % 2 or (ranks[:, 0] + ranks[:, 1] > n // 2).any():
        raise UserError("workload.doc_ranks", f"the placement does not fit {n // 2} ranks ({n} chunks)",
                        "plan the documents for this rank count (doc-place)")
    return chunking(pieces(w.doc_ranks, w.mask.doc_lens, w.mask.doc_real_lens()), n)


def chunking(p: dict[str, np.ndarray], n_chunks: int) -> Chunking:
    """The :class:`~meshplan.model.matrix.Chunking` of the pieces: chunk c's pieces in position order, each a
    stride-1 segment; rows padded with empty segments to one width."""
    order, column = _columns(p, n_chunks)
    chunk, col = p["chunk"][order], column[order]
    width = max(int(np.bincount(chunk, minlength=n_chunks).max()), 1)
    start, count, real_end = (np.zeros((n_chunks, width), dtype=np.int64) for _ in range(3))
    start[chunk, col], count[chunk, col], real_end[chunk, col] = (p[k][order] for k in ("start", "count",
                                                                                        "real_end"))
    offset = np.cumsum(count, axis=1) - count
    return Chunking("doc-place", n_chunks, start, np.ones_like(start), count, offset, np.ones(width, dtype=bool),
                    real_end)
