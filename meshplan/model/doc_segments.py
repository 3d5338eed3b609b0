"""Document segments: the pieces of a packed-document block that the attention kernels actually run.

A document boundary cuts a block into *segments*: per document, the block's query tokens of that document
against its key tokens of that document. FlashAttention's varlen path (and a FlexAttention block mask) runs each
segment as its own grid of tiles, so a block's cost is the sum over its segments, each rounded up to the tile;
the executor on CPU runs one flash kernel per segment (:func:`meshplan.model.blockmask.kernel_cover`).

Every segment is a *staircase*: with its query rows and keys in position order, query row a (0 ≤ a < nq) sees the
keys [0, hi(a)) of the segment, ``hi(a) = clip(a + c + 1, 0, nk)`` — ``c = ⌊(first query − first key) / stride⌋``
(a full rectangle when c ≥ nk − 1, a causal square when c = 0 and nq = nk). :func:`tile_count` counts the
tq × tk tiles such a segment touches (what a tiled kernel computes) in closed form; with 1 × 1 tiles it is the
segment's pairs.

:func:`block_segments` lists every block's segments as flat arrays, in batches (no per-document Python loop):

* per-document contiguous and zigzag layouts, in closed form from the real tokens of each document's pieces:
  chunk i holds, of document d, the pieces i (and 2N − 1 − i under zigzag), adjacent in its token order, so
  block (i, j) holds one segment per document — for j < i every query row of the document sees piece j whole
  (a rectangle of all of chunk i's rows × piece j), for j > i only the second piece's rows see chunk j's
  pieces whole, and the diagonal block is one causal square;
* any other layout (striped, or a layout cut over the whole sequence) by joining the chunks' segments
  restricted to each document, document by document in batches: one segment per (query segment, key segment)
  of one document; a document split over two segments of one chunk (a zigzag chunk's two pieces) counts as two.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import astuple, dataclass

import numpy as np

from meshplan.model import doc_place
from meshplan.model.pair_counts import doc_columns, restrict
from meshplan.model.workload import DOC_PLACE


@dataclass(frozen=True)
class Segments:
    """Segments of blocks as flat int64 arrays of one length: ``block`` = i·N + j (query chunk i, KV chunk j),
    ``nq`` query rows, ``nk`` keys, ``c`` the staircase offset (row a sees keys [0, clip(a + c + 1, 0, nk)))."""

    block: np.ndarray
    nq: np.ndarray
    nk: np.ndarray
    c: np.ndarray

    @property
    def rect(self) -> np.ndarray:
        """Bool per segment: every row sees every key (a kernel without a mask)."""
        return self.c >= self.nk - 1

    @property
    def pairs(self) -> np.ndarray:
        """Permitted (query, key) pairs per segment."""
        return tile_count(self.nq, self.nk, self.c, 1, 1)

    @property
    def kernels(self) -> np.ndarray:
        """Dense kernels per segment in the executor's cover: a staircase whose first row already sees keys is a
        rectangle plus a causal square (2), else one kernel."""
        return 1 + ((self.c > 0) & ~self.rect).astype(np.int64)


def floor_sum(n, m, a, b) -> np.ndarray:
    """Σ_{i=0}^{n−1} ⌊(a·i + b) / m⌋ elementwise (int64 arrays, n ≥ 0, m ≥ 1, a ≥ 0, b ≥ 0), by the Euclid-like
    reduction (O(log m) vectorised steps)."""
    n, m, a, b = (np.array(x, dtype=np.int64) for x in np.broadcast_arrays(n, m, a, b))
    out = np.zeros(n.shape, dtype=np.int64)
    live = n > 0
    while live.any():
        q = a // m
        out += np.where(live, q * (n * (n - 1) // 2), 0)
        a = a - q * m
        q = b // m
        out += np.where(live, n * q, 0)
        b = b - q * m
        y = a * n + b
        live &= y >= m
        n, b, m, a = (np.where(live, y // m, n), np.where(live, y % m, b), np.where(live, a, m),
                      np.where(live, m, a))
        m = np.maximum(m, 1)
    return out


def _ceil_div(x, d):
    return -((-np.asarray(x)) // d)


def tile_count(nq, nk, c, tq: int, tk: int) -> np.ndarray:
    """Tiles of tq rows × tk keys that a staircase segment touches (int64, elementwise).

    Row tile k holds rows [k·tq, min((k + 1)·tq, nq)); its rows see keys below the last row's
    h_k = clip(min((k + 1)·tq, nq) + c, 0, nk), so it computes ⌈h_k / tk⌉ key tiles (the partial tile counted
    whole, as a tiled kernel computes it). Summed in closed form: the row tiles that see nothing, those that see
    every key, and between them a floor sum. tq = tk = 1: the segment's pairs.
    """
    nq, nk, c = (np.asarray(x, dtype=np.int64) for x in (nq, nk, c))
    n_tiles = _ceil_div(nq, tq)                                 # K row tiles
    last = _ceil_div(np.clip(nq + c, 0, nk), tk)               # the last row tile ends at nq
    inner = np.maximum(n_tiles - 1, 0)                          # tiles j = 1 .. K − 1 end at j·tq
    j0 = np.clip((-c) // tq, 0, inner)                          # j <= j0: j·tq + c <= 0, nothing seen
    j1 = np.maximum(_ceil_div(nk - c, tq), j0 + 1)              # j >= j1: every key seen
    full = np.clip(inner - j1 + 1, 0, None)
    mid = np.clip(np.minimum(j1 - 1, inner) - j0, 0, None)      # j = j0 + 1 .. j0 + mid
    b = np.where(mid > 0, (j0 + 1) * tq + c + tk - 1, 0)
    between = floor_sum(mid, tk, tq, np.maximum(b, 0))
    return np.where(nq > 0, last + full * _ceil_div(nk, tk) + between, 0)


def block_segments(m, budget: int = 1 << 22) -> Iterator[Segments]:
    """The document segments of every block of an :class:`~meshplan.model.matrix.AttnMatrix` under a ``docs``
    mask, in batches of about ``budget`` candidates (only segments with permitted pairs are yielded)."""
    w, ch = m.workload, m.chunks
    if w.mask.kind != "docs":
        raise ValueError("document segments need a docs mask")
    width = doc_columns(w, ch)
    if width and ch.layout != "striped":
        yield from _piece_segments(w, m.n, width, budget)
    else:
        yield from _joined_segments(m, budget)


@dataclass(frozen=True)
class BlockTiles:
    """Per block [n, n] (float64): ``rect_work`` and ``stair_work``, the tiles × tq × tk of its full and of its
    masked segments; ``rect`` and ``stair``, how many segments of each kind."""

    rect_work: np.ndarray
    stair_work: np.ndarray
    rect: np.ndarray
    stair: np.ndarray


def block_tiles(m, tq: int, tk: int) -> BlockTiles:
    """Tile sums of every block's segments (:func:`block_segments` summed per block). Per-document contiguous and
    zigzag layouts in closed form — a rectangle's tiles are ⌈rows / tq⌉ · ⌈keys / tk⌉, so the off-diagonal sums
    over documents are matrix products, the diagonal's causal squares a sum per chunk — in O(n² · D) multiply-adds
    done by BLAS; other layouts by summing :func:`block_segments`."""
    n = m.n
    if m.chunks.layout == DOC_PLACE:
        return DocPlaceTiles(m.workload, n, tq, tk).dense()
    width = doc_columns(m.workload, m.chunks)
    if not (width and m.chunks.layout != "striped"):
        return summed_tiles(m, tq, tk)
    first, second, both = _piece_rows(m.workload, n, width)                  # [D, n] each, float64
    i, j = np.arange(n)[:, None], np.arange(n)[None, :]
    tiles_q = lambda x: np.ceil(x / tq)  # noqa: E731
    tiles_k = lambda x: np.ceil(x / tk)  # noqa: E731
    lower = (tiles_q(both).T @ tiles_k(first)) * (j < i)                     # rows of chunk i x piece j
    upper = (tiles_q(second).T @ tiles_k(both)) * (j > i)                    # second piece's rows x chunk j
    live = lambda x: (x > 0).astype(np.float64)  # noqa: E731
    count = (live(both).T @ live(first)) * (j < i) + (live(second).T @ live(both)) * (j > i)
    square = tile_count(both, both, 0, tq, tk).astype(np.float64)              # causal squares [D, n]
    one = both == 1                                                             # a 1-token square: a rectangle
    tile = float(tq * tk)
    return BlockTiles((lower + upper) * tile + np.diag(np.where(one, square, 0).sum(axis=0) * tile),
                      np.diag(np.where(one, 0, square).sum(axis=0) * tile),
                      count + np.diag(one.sum(axis=0).astype(np.float64)),
                      np.diag((both > 1).sum(axis=0).astype(np.float64)))


def summed_tiles(m, tq: int, tk: int) -> BlockTiles:
    """:func:`block_tiles` of any layout by summing its :func:`block_segments`."""
    n = m.n
    out = [np.zeros(n * n) for _ in range(4)]
    for seg in block_segments(m):
        work = tile_count(seg.nq, seg.nk, seg.c, tq, tk) * float(tq * tk)
        rect = seg.rect
        np.add.at(out[0], seg.block[rect], work[rect])
        np.add.at(out[1], seg.block[~rect], work[~rect])
        np.add.at(out[2], seg.block, rect)
        np.add.at(out[3], seg.block, ~rect)
    return BlockTiles(*(x.reshape(n, n) for x in out))


def tiles_at(m, tq: int, tk: int, qi: np.ndarray, kj: np.ndarray) -> BlockTiles:
    """:func:`block_tiles` read at the blocks (``qi``, ``kj``) only: [len(qi)] arrays. A doc-place layout's are
    computed without its dense [n, n] arrays (:class:`DocPlaceTiles`: at 512 ranks four such arrays per pass cost
    more, in fresh pages touched, than the sums themselves)."""
    if m.chunks.layout == DOC_PLACE:
        return DocPlaceTiles(m.workload, m.n, tq, tk).at(qi, kj)
    bt, b = block_tiles(m, tq, tk), qi * m.n + kj
    return BlockTiles(*(arr.ravel()[b] for arr in (bt.rect_work, bt.stair_work, bt.rect, bt.stair)))


class DocPlaceTiles:
    """:func:`block_tiles` of a doc-place layout (:mod:`meshplan.model.doc_place`) in closed form, kept sparse: the
    diagonal blocks as [n] arrays, the blocks among the members of each split group as one [g, g] matrix per group.

    Its pieces are contiguous runs of one document, so a query piece sees an earlier piece of its document whole (a
    rectangle of ⌈rows / tq⌉ · ⌈keys / tk⌉ tiles), itself as a causal square and a later one not at all. A document
    split over g members: member k holds pieces k and 2g − 1 − k, so with x1_k, x2_k a quantity of member k's first
    and second piece, block (k, k') holds the rectangles a1_k·b1_k' (k' < k) + a2_k·b1_k' + a2_k·b2_k' (k' > k) —
    rows a and key tiles b — and the diagonal the squares: O(g²) per document, against (2g)² segments summed;
    documents split over the same members summed as matrix products. Groups of different members may overlap (a
    document placed over part of another's ranks): each group goes to the first *layer* whose chunks it leaves
    free, and a block sums its groups over the layers (one layer in the common case)."""

    def __init__(self, w, n: int, tq: int, tk: int) -> None:
        p = doc_place.pieces(w.doc_ranks, w.mask.doc_lens, w.mask.doc_real_lens())
        real = np.clip(p["real_end"] - p["start"], 0, p["count"])
        tile = float(tq * tk)
        self.n = n
        square = tile_count(real, real, 0, tq, tk) * tile          # every piece against itself (its diagonal)
        one, many = real == 1, real > 1                             # a 1-token square is a rectangle
        chunk = p["chunk"]
        self.diag = [np.bincount(chunk[sel], weights=np.broadcast_to(val, real.shape)[sel], minlength=n)
                     for sel, val in ((one, square), (many, square), (one, 1.0), (many, 1.0))]
        doc = p["doc"]
        starts = np.flatnonzero(np.r_[True, doc[1:] != doc[:-1]])
        ends = np.r_[starts[1:], len(doc)]
        split = ends - starts > 1
        groups: dict[tuple[int, int], list[np.ndarray]] = {}       # documents split over the same members together
        for a, e in zip(starts[split], ends[split]):
            g = (e - a) // 2
            r = real[a:e]
            groups.setdefault((int(chunk[a]), g), []).append(np.stack([r[:g], r[2 * g - 1 - np.arange(g)]]))
        self.layers: list[tuple[np.ndarray, np.ndarray]] = []      # per layer: chunk -> its group, member index
        self.size, self.offset, work, count = [], [], [], []
        at = 0
        for gi, ((c0, g), docs) in enumerate(groups.items()):
            r1, r2 = (np.stack([d[i] for d in docs]).astype(np.float64) for i in (0, 1))   # [D, g]: each piece
            k = np.arange(g)
            below, above = k[None, :] < k[:, None], k[None, :] > k[:, None]     # k' < k, k' > k

            def rects(q1, q2, k1, k2, below=below, above=above):
                """Σ over the documents of the rectangles: [D, g] per-member quantities, as matrix products
                (einsum's own loops: BLAS would start threads for these thin products, beside the verifier's
                process)."""
                return (np.einsum("dk,dl->kl", q1, k1) * below + np.einsum("dk,dl->kl", q2, k1)
                        + np.einsum("dk,dl->kl", q2, k2) * above)

            work.append((tile * rects(np.ceil(r1 / tq), np.ceil(r2 / tq), np.ceil(r1 / tk),
                                      np.ceil(r2 / tk))).ravel())
            live1, live2 = (r1 > 0).astype(np.float64), (r2 > 0).astype(np.float64)
            count.append(rects(live1, live2, live1, live2).ravel())
            members = slice(c0, c0 + 2 * g, 2)                                     # member k's chunk: c0 + 2k
            layer = next((lay for lay in self.layers if (lay[0][members] < 0).all()), None)
            if layer is None:
                layer = (np.full(n, -1), np.zeros(n, dtype=np.int64))
                self.layers.append(layer)
            layer[0][members], layer[1][members] = gi, k
            self.size.append(g)
            self.offset.append(at)
            at += g * g
        self.size, self.offset = np.asarray(self.size, dtype=np.int64), np.asarray(self.offset, dtype=np.int64)
        self.work = np.concatenate(work) if work else np.zeros(0)
        self.count = np.concatenate(count) if count else np.zeros(0)

    def at(self, qi: np.ndarray, kj: np.ndarray) -> BlockTiles:
        """The four sums at blocks (``qi``, ``kj``) ([B] chunk indices): [B] arrays."""
        qi, kj = np.asarray(qi, dtype=np.int64), np.asarray(kj, dtype=np.int64)
        on_diag = qi == kj
        out = [np.where(on_diag, d[qi], 0.0) for d in self.diag]
        for group, member in self.layers:
            gq = group[qi]
            same = np.flatnonzero((gq >= 0) & (gq == group[kj]))
            if len(same):
                g = gq[same]
                idx = self.offset[g] + member[qi[same]] * self.size[g] + member[kj[same]]
                out[0][same] += self.work[idx]
                out[2][same] += self.count[idx]
        return BlockTiles(*out)

    def dense(self) -> BlockTiles:
        """The [n, n] arrays of :func:`block_tiles`."""
        i, j = np.divmod(np.arange(self.n * self.n), self.n)
        return BlockTiles(*(x.reshape(self.n, self.n) for x in astuple(self.at(i, j))))


def _piece_rows(w, n: int, width: int):
    """(first, second, both) [D, n]: real tokens of each document in chunk i's first piece (piece i), its second
    (piece 2n − 1 − i under zigzag, else 0) and both."""
    regions = np.asarray([(a, e, r) for a, e, r, _ in w.regions()], dtype=np.int64)          # [D, 3]
    pieces = width * n
    size = (regions[:, 1] - regions[:, 0]) // pieces
    real = np.clip(regions[:, 2] - regions[:, 0], 0, None)
    r = np.clip(real[:, None] - np.arange(pieces)[None, :] * size[:, None], 0, size[:, None])  # [D, pieces]
    first = r[:, :n]
    second = r[:, pieces - 1 - np.arange(n)] if width == 2 else np.zeros_like(first)
    return first, second, first + second


def _keep(block, nq, nk, c) -> Segments:
    ok = (nq > 0) & (nk > 0) & (nq + c > 0)
    return Segments(block[ok], nq[ok], nk[ok], c[ok])


def _piece_segments(w, n: int, width: int, budget: int) -> Iterator[Segments]:
    """Per-document contiguous (width 1) and zigzag (width 2) layouts: one segment per (block, document)."""
    first, second, both = _piece_rows(w, n, width)
    i, j = np.arange(n)[:, None], np.arange(n)[None, :]
    lower, diag = j < i, i == j
    block = np.broadcast_to(i * n + j, (n, n))
    step = max(1, budget // (n * n))
    for d0 in range(0, len(both), step):
        g = slice(d0, d0 + step)
        bq, fk, sq, bk = both[g][:, :, None], first[g][:, None, :], second[g][:, :, None], both[g][:, None, :]
        nq = np.where(lower | diag, bq, sq)
        nk = np.where(lower, fk, bk)
        c = np.where(diag, 0, nk)
        shape = nq.shape
        yield _keep(np.broadcast_to(block, shape).ravel(), nq.ravel(), nk.ravel(), c.ravel())


def _joined_segments(m, budget: int) -> Iterator[Segments]:
    """Any layout: the chunks' valid segments restricted to each document, joined document by document."""
    w, ch, n = m.workload, m.chunks, m.n
    bounds = w.mask.doc_bounds
    vs, vc, qc = m.valid_start, m.valid_count, m.q_count                     # [n, seg]
    stride = ch.stride
    live = vc > 0
    chunk = np.broadcast_to(np.arange(n)[:, None], vs.shape)[live]
    start, count, qcount, st = vs[live], vc[live], qc[live], stride[live]
    last = start + (count - 1) * st
    d_first = np.searchsorted(bounds, start, side="right") - 1
    d_last = np.searchsorted(bounds, last, side="right") - 1
    spans = d_last - d_first + 1                                            # documents each segment meets
    seg = np.repeat(np.arange(len(start)), spans)
    doc = np.repeat(d_first, spans) + np.arange(spans.sum()) - np.repeat(np.cumsum(spans) - spans, spans)
    s, k, _ = restrict(start[seg], st[seg], count[seg], bounds[doc], bounds[doc + 1])
    _, q, _ = restrict(start[seg], st[seg], qcount[seg], bounds[doc], bounds[doc + 1])
    ok = k > 0
    seg, doc, s, k, q = seg[ok], doc[ok], s[ok], k[ok], q[ok]
    order = np.argsort(doc, kind="stable")
    seg, doc, s, k, q = seg[order], doc[order], s[order], k[order], q[order]
    group_start = np.searchsorted(doc, doc, side="left")
    group_size = np.searchsorted(doc, doc, side="right") - group_start
    cost = np.cumsum(group_size)                        # pairs up to and including each entry (as query side)
    at = 0
    while at < len(doc):
        end = int(np.searchsorted(cost, cost[at] - group_size[at] + budget, side="right"))
        end = max(end, int(np.searchsorted(doc, doc[at], side="right")))       # a whole document at least
        end = int(np.searchsorted(doc, doc[end - 1], side="right"))
        e = np.arange(at, end)
        reps = group_size[e]
        qi = np.repeat(e, reps)
        kj = group_start[qi] + np.arange(reps.sum()) - np.repeat(np.cumsum(reps) - reps, reps)
        stride_q = st[seg[qi]]
        yield _keep(chunk[seg[qi]] * n + chunk[seg[kj]], q[qi], k[kj], (s[qi] - s[kj]) // stride_q)
        at = end
