"""Exact pair counts between token progressions, and between the pieces of documents.

:func:`count_pairs` counts the permitted (query, key) pairs between two progressions of one stride under a band
``lo <= q − k < hi`` in closed form; :func:`restrict` cuts progressions to a range. For document masks cut by a
per-document layout, :func:`piece_pairs` (contiguous, zigzag) and :func:`same_doc_pairs` (striped, in batches)
count each document's pieces against its own — never every segment against every other.
"""

from __future__ import annotations

import numpy as np

from meshplan.model.workload import Workload

UNBOUNDED = 2**50      # an infinite band edge for count_pairs (exact in int64 arithmetic)


def _ceil_div(x: np.ndarray, s: np.ndarray) -> np.ndarray:
    return -((-x) // s)


def _tri_capped(m: np.ndarray, cap: np.ndarray) -> np.ndarray:
    """H(m) = sum_{u=1..m} min(cap, u) for m >= 0 (int64, elementwise)."""
    m = np.maximum(m, 0)
    small = m * (m + 1) // 2
    big = cap * (cap + 1) // 2 + (m - cap) * cap
    return np.where(m <= cap, small, big)


def _pairs_delta_le(x: np.ndarray, cq: np.ndarray, ckv: np.ndarray) -> np.ndarray:
    """C(X) = #{(a, b) in [0,cq) x [0,ckv) : a − b <= X}."""
    hi = ckv + x
    lo = ckv + x - cq + 1
    return _tri_capped(hi, ckv) - _tri_capped(lo - 1, ckv)


def count_pairs(q_start, q_count, k_start, k_count, stride, lo, hi) -> np.ndarray:
    """Count pairs (q, k) with ``lo <= q − k < hi`` between two token progressions of one stride.

    Query tokens are ``q_start + a·stride`` (a < q_count), keys ``k_start + b·stride`` (b < k_count).
    Causal is (lo, hi) = (0, ∞), a window of W tokens (0, W), full (−∞, ∞); pass ±2**50 for ∞.
    Exact integer arithmetic on int64 arrays (broadcast); the derivation sums a capped triangle over
    the diagonals δ = a − b.

    Returns:
        int64 array of pair counts.
    """
    qs, cq, ks, ckv, s = (np.asarray(v, dtype=np.int64) for v in (q_start, q_count, k_start, k_count, stride))
    lo, hi = np.asarray(lo, dtype=np.int64), np.asarray(hi, dtype=np.int64)
    delta = qs - ks
    if (s == 1).all():                                      # contiguous runs (no stride): no division
        d_lo, d_hi = np.maximum(lo - delta, -ckv), np.minimum(hi - delta - 1, cq)
    else:
        d_lo = np.maximum(_ceil_div(lo - delta, s), -ckv)   # smallest allowed a − b
        d_hi = np.minimum((hi - delta - 1) // s, cq)        # largest allowed a − b
    d_lo, d_hi, cq, ckv = np.broadcast_arrays(d_lo, d_hi, cq, ckv)
    some = (cq > 0) & (ckv > 0) & (d_hi >= d_lo)
    # the band holds every (a, b) — a − b runs from −(ckv − 1) to cq − 1 — or none: most blocks of a matrix; the
    # capped-triangle sums only for the others (the diagonal's): the same integers, a fraction of the work
    whole = some & (d_lo <= 1 - ckv) & (d_hi >= cq - 1)
    out = np.where(whole, cq * ckv, 0)
    part = np.flatnonzero(some & ~whole)
    if len(part):               # .flat: the few elements of the broadcast views, not a copy of them whole
        pq, pk = cq.flat[part], ckv.flat[part]
        out.ravel()[part] = _pairs_delta_le(d_hi.flat[part], pq, pk) - _pairs_delta_le(d_lo.flat[part] - 1, pq, pk)
    return out


def restrict(start, stride, count, lo, hi):
    """Restrict progressions to positions in [lo, hi): returns (start, count, first_index) arrays."""
    start, stride, count = (np.asarray(v, dtype=np.int64) for v in (start, stride, count))
    a0 = np.clip(_ceil_div(np.asarray(lo) - start, stride), 0, count)
    a1 = np.clip(_ceil_div(np.asarray(hi) - start, stride), 0, count)
    a1 = np.maximum(a1, a0)
    return start + a0 * stride, a1 - a0, a0


def doc_columns(w: Workload, ch) -> int:
    """Segment columns per document of chunking ``ch`` (a :class:`~meshplan.model.matrix.Chunking`) when every
    column lies inside one document, the same for every chunk (the per-document layouts: document d owns columns
    [k·d, k·(d + 1)), k = 2 for zigzag, else 1); 0 when not — always for doc-place, whose chunks hold whole
    documents and pieces by placement, whatever their column count."""
    if w.mask.kind != "docs" or w.doc_layout != "per-doc" or ch.layout not in ("contiguous", "zigzag", "striped"):
        return 0
    width = 2 if ch.layout == "zigzag" else 1
    return width if ch.start.shape[1] == width * len(w.mask.doc_lens) else 0


def piece_pairs(w: Workload, n: int, width: int):
    """(pairs [n, n], q_involved and kv_involved [n, n, seg]) of a per-document contiguous or zigzag layout, in
    closed form over all documents at once.

    Each document d (padded to P_d tokens, real_d of them real, the real ones first) is cut into m = w·n
    pieces of p_d = P_d / m tokens; chunk i holds pieces i (and 2n − 1 − i under zigzag). Piece a has
    r[d, a] = clip(real_d − a·p_d, 0, p_d) real tokens. Under the causal document mask a query piece a sees
    every real key of an earlier piece b < a (r[d, a]·r[d, b] pairs), the causal triangle of its own piece
    (r(r + 1)/2), and nothing later; so the pairs of pieces (a, b) summed over documents are the strictly
    lower triangle of rᵀr plus the diagonal Σ_d r(r + 1)/2 (exact: float64 products below 2⁵³, else int64).
    A piece takes part where it is real and meets a real piece on its permitted side.
    """
    regions = np.asarray([(a, e, r) for a, e, r, _ in w.regions()], dtype=np.int64)        # [D, 3]
    m = width * n
    piece = (regions[:, 1] - regions[:, 0]) // m                                           # p_d
    real = np.clip(regions[:, 2] - regions[:, 0], 0, None)                                  # real_d
    r = np.clip(real[:, None] - np.arange(m)[None, :] * piece[:, None], 0, piece[:, None])  # [D, m]
    if float(r.max(initial=0)) ** 2 * len(r) < 2.0 ** 53:
        cross = np.rint(r.T.astype(np.float64) @ r.astype(np.float64)).astype(np.int64)
    else:
        cross = r.T @ r
    between = np.tril(cross, -1) + np.diag((r * (r + 1) // 2).sum(axis=0))                  # [m, m]
    i = np.arange(n)
    pieces = np.stack([i, m - 1 - i], axis=1) if width == 2 else i[:, None]                  # [n, w]
    pairs = between[pieces[:, None, :, None], pieces[None, :, None, :]].sum(axis=(2, 3))
    n_real = -(-real // np.maximum(piece, 1))                                               # real pieces
    # query piece a of chunk i meets chunk j where a is real and some piece b of j has b <= a (b < a is
    # real then); key piece b of chunk j meets chunk i where b is real and some real piece a of i has a >= b
    a = pieces[:, None, None, :]                                                            # [n, 1, 1, w]
    q_inv = (a < n_real[None, None, :, None]) & (pieces.min(axis=1)[None, :, None, None] <= a)
    b = pieces[None, :, None, :]                                                            # [1, n, 1, w]
    held = pieces[:, :, None]                                                               # [n, w, 1]
    top = np.where(held < n_real[None, None, :], held, -1).max(axis=1)                      # [n, D]
    kv_inv = (b < n_real[None, None, :, None]) & (top[:, None, :, None] >= b)
    shape = (n, n, len(r) * width)
    return pairs, np.broadcast_to(q_inv, (n, n, len(r), width)).reshape(shape), kv_inv.reshape(shape)


def same_doc_pairs(vs, q_count, vc, stride, width: int, budget: int = 1 << 22):
    """(pairs [n, n], q_involved and kv_involved [n, n, seg]) of a per-document layout: each document's
    segments against its own only (causal inside the document), documents taken in batches of at most
    ``budget`` segment pairs — never the [n, n, seg, seg] tensor of every segment against every other."""
    n, seg = vs.shape
    docs = seg // width
    pairs = np.zeros((n, n), dtype=np.int64)
    q_inv, kv_inv = np.zeros((n, n, seg), dtype=bool), np.zeros((n, n, seg), dtype=bool)
    qs, qc, ks, kc = (a.reshape(n, docs, width) for a in (vs, q_count, vs, vc))
    step = max(1, budget // (n * n * width * width))
    for d0 in range(0, docs, step):
        g = slice(d0, min(d0 + step, docs))
        sp = count_pairs(qs[:, None, g, :, None], qc[:, None, g, :, None], ks[None, :, g, None, :],
                         kc[None, :, g, None, :], stride, 0, UNBOUNDED)          # [n, n, docs in g, w, w]
        pairs += sp.sum(axis=(2, 3, 4))
        cols = slice(d0 * width, g.stop * width)
        q_inv[:, :, cols] = (sp.sum(axis=4) > 0).reshape(n, n, -1)
        kv_inv[:, :, cols] = (sp.sum(axis=3) > 0).reshape(n, n, -1)
    return pairs, q_inv, kv_inv
