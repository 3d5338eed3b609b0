"""The attention matrix: the Nq x Nkv chunk grid of a layout and the exact work of every block.

No ranks, no topology: this module describes the work, algorithms decide the split (docs/style.md rule 4).

A *chunk* is the token set a layout gives one rank: ``contiguous`` chunk i = [i·c, (i+1)·c);
``zigzag`` chunk i = pieces i and 2N−1−i of p = S/(2N) tokens; ``striped`` chunk i = {t : t mod N = i}.
Every chunk is stored as *segments*, arithmetic progressions ``(start, stride, count)`` of global token
positions, so one closed form counts query-key pairs for every layout and mask
(:func:`count_pairs`). Block (i, j) = query chunk i against KV chunk j.

Exact work (docs/algorithms.md, zigzag oracle): an off-diagonal zigzag block holds exactly 2p² of 4p² pairs, a
diagonal one 2p² + p (fraction ½ + 1/(4p)); the causal total is S(S+1)/2. FLOPs per block (FlashAttention
convention): forward 4·B·H·D·pairs, backward 2.5× forward.
"""

from __future__ import annotations

import functools
from functools import cached_property

import numpy as np

from meshplan.core.csr import unique_rows
from meshplan.model import doc_place
from meshplan.model.chunking import Chunking
from meshplan.model.granularity import granularity_error
from meshplan.model.pair_counts import UNBOUNDED, count_pairs, doc_columns, piece_pairs, restrict, same_doc_pairs
from meshplan.model.workload import DOC_PLACE, Workload

KV_KINDS = ("kv", "dkv")   # tensor kinds over every token of their chunks; the rest hold query tokens only
BWD_FLOP_FACTOR = 2.5  # FlashAttention-2 paper (arXiv 2307.08691) §3: backward = 2.5x forward matmul FLOPs


def _cut(layout: str, n: int, a: int, length: int, decode: bool):
    """[n, k] (start, stride, count) of one region [a, a + length) cut by the layout into n chunks.

    A decode region (fewer new tokens than chunks) gives token t to chunk t (round-robin, as Meta appends
    each decode step's KV to the next rank).
    """
    idx = np.arange(n, dtype=np.int64)[:, None]
    if decode:
        return idx + a, np.full_like(idx, n if layout == "striped" else 1), (idx < length).astype(np.int64)
    if layout == "contiguous":
        c = length // n
        return a + idx * c, np.ones_like(idx), np.full_like(idx, c)
    if layout == "zigzag":
        p = length // (2 * n)
        start = a + np.concatenate([idx * p, (2 * n - 1 - idx) * p], axis=1)
        return start, np.ones_like(start), np.full_like(start, p)
    return a + idx, np.full_like(idx, n), np.full_like(idx, length // n)


def chunking(workload: Workload, n: int) -> Chunking:
    """Cut every region of the workload (:meth:`Workload.regions`) into ``n`` chunks by its layout.

    Chunk i holds its piece of each region, in region order (a document's zigzag pieces i and 2N−1−i, then
    the next document's). A region of new tokens shorter than N (decode) goes round-robin, one token a chunk.

    Raises:
        UserError: a region is not a multiple of the layout's granularity (N, or 2N for zigzag); the message
            gives the padding to use.
    """
    layout = workload.layout
    if layout == DOC_PLACE:
        return doc_place.chunking_of(workload, n)
    unit = 2 * n if layout == "zigzag" else n
    regions = workload.regions()
    decode = [q and workload.prefix_len > 0 and (e - a) < n for a, e, _, q in regions]
    bad = [(k, e - a) for k, (a, e, _, _) in enumerate(regions) if (e - a) % unit and not decode[k]]
    if bad:
        raise granularity_error(workload, n, unit, bad)
    parts = [_cut(layout, n, a, e - a, d) for (a, e, _, _), d in zip(regions, decode)]
    start, stride, count = (np.concatenate([p[k] for p in parts], axis=1) for k in range(3))
    widths = [p[0].shape[1] for p in parts]
    holds_q = np.repeat([q for *_, q in regions], widths).astype(bool)
    real_end = np.broadcast_to(np.repeat([r for _, _, r, _ in regions], widths).astype(np.int64), start.shape)
    if workload.mask.kind == "docs" and workload.mask.doc_pad and workload.doc_layout != "per-doc":
        start, stride, count, real_end = _split_at_documents(workload, start, stride, count)
        holds_q = np.ones(start.shape[1], dtype=bool)          # documents take no cached prefix
    offset = np.cumsum(count, axis=1) - count
    return Chunking(layout, n, start, stride, count, offset, holds_q, np.ascontiguousarray(real_end))


def _split_at_documents(w: Workload, start: np.ndarray, stride: np.ndarray, count: np.ndarray):
    """Packed documents with padding inside: every segment cut at the document slots it spans, so that each
    piece's padding is its tail (``real_end`` = its document's real end, or ``valid_len`` if sooner).

    The pieces of a segment keep its local order (positions rise along a segment); each chunk's pieces are
    compacted to the left and the rows padded with empty segments to one width. Returns (start, stride, count,
    real_end), each [n, n_seg'].
    """
    bounds = w.mask.doc_bounds
    real = np.minimum(w.mask.doc_real_ends, w.n_valid)
    s, c, _ = restrict(start[:, :, None], stride[:, :, None], count[:, :, None], bounds[None, None, :-1],
                       bounds[None, None, 1:])                                   # [n, k, docs]
    n = start.shape[0]
    st = np.broadcast_to(stride[:, :, None], s.shape).reshape(n, -1)
    re = np.broadcast_to(real[None, None, :], s.shape).reshape(n, -1)
    s, c = s.reshape(n, -1), c.reshape(n, -1)
    keep = c > 0
    order = np.argsort(~keep, axis=1, kind="stable")[:, :max(int(keep.sum(axis=1).max()), 1)]
    pick = lambda a: np.take_along_axis(a, order, axis=1)  # noqa: E731
    return pick(s), pick(st), pick(c), pick(re)


#: (query segment, KV segment) pairs counted at once by :class:`AttnMatrix` (its temporaries stay in cache)
SEG_PAIRS_BLOCK = 1 << 20


def _small_axis_sums(seg_pairs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(``seg_pairs.sum(axis=3)``, ``seg_pairs.sum(axis=2)``) of a [rows, n, seg, seg] array: by adding its slices
    where ``seg`` is small (a zigzag chunk's 2 segments) — numpy's reduction over a short trailing axis walks it
    element by element, 3x slower here."""
    seg = seg_pairs.shape[3]
    if seg > 8:
        return seg_pairs.sum(axis=3), seg_pairs.sum(axis=2)
    q_sum, kv_sum = seg_pairs[..., 0].copy(), seg_pairs[:, :, 0, :].copy()
    for k in range(1, seg):
        q_sum += seg_pairs[..., k]
        kv_sum += seg_pairs[:, :, k, :]
    return q_sum, kv_sum


class AttnMatrix:
    """Exact work of every (query chunk, KV chunk) block of a workload cut into ``n`` chunks.

    Attributes (arrays of shape [n, n] unless said):
        pairs: permitted query-key pairs per (batch, head) — the mask and padding applied.
        s_q, s_kv: the kernel's shape in tokens: query rows and key columns that take part.
        elementwise: True where the block needs an elementwise mask (a causal diagonal, a window, a
            document boundary); False where the participating rectangle is fully permitted.
        q_involved, kv_involved: [n, n, n_seg] which segments of the chunks take part.
    """

    def __init__(self, workload: Workload, n: int) -> None:
        self.workload, self.n = workload, n
        self._flops: dict = {}
        self.chunks = chunking(workload, n)
        self._count()

    def _count(self) -> None:
        ch = self.chunks
        # Padding: only real tokens (before their region's real end) exist as queries and keys; queries only
        # in query regions (not the cached prefix).
        vs, vc, v0 = restrict(ch.start, ch.stride, ch.count, 0, ch.real_end)
        self.valid_start, self.valid_count, self.valid_first = vs, vc, v0
        self.q_count = vc * ch.holds_q[None, :]
        qs, qc = vs[:, None, :, None], self.q_count[:, None, :, None]       # [n, 1, seg, 1]
        ks, kc = vs[None, :, None, :], vc[None, :, None, :]       # [1, n, 1, seg]
        stride = ch.stride[0, 0]
        width = doc_columns(self.workload, ch)
        if ch.layout == DOC_PLACE:      # placed documents: closed forms over the pieces of each document
            self.pairs, self.q_involved, self.kv_involved = doc_place.block_work(self.workload, ch)
        elif width and ch.layout != "striped":    # per-document pieces: closed forms over the documents at once
            self.pairs, self.q_involved, self.kv_involved = piece_pairs(self.workload, self.n, width)
        elif width:                      # per-document layout: only a document's own segments meet
            self.pairs, self.q_involved, self.kv_involved = same_doc_pairs(vs, self.q_count, vc, stride, width)
        else:                           # [rows, n, seg, seg] a block of query chunks at a time: ~1M pairs
            n_seg = qs.shape[2]
            self.pairs = np.empty((self.n, self.n), dtype=np.int64)
            self.q_involved = np.empty((self.n, self.n, n_seg), dtype=bool)
            self.kv_involved = np.empty((self.n, self.n, n_seg), dtype=bool)
            rows = max(1, SEG_PAIRS_BLOCK // (self.n * n_seg * n_seg))
            for i in range(0, self.n, rows):     # temporaries that stay in cache (2048 chunks' count: 2.8 → 0.4 s)
                seg_pairs = self._seg_pairs(qs[i:i + rows], qc[i:i + rows], ks, kc, stride)
                q_sum, kv_sum = _small_axis_sums(seg_pairs)
                self.q_involved[i:i + rows] = q_sum > 0
                self.kv_involved[i:i + rows] = kv_sum > 0
                self.pairs[i:i + rows] = q_sum.sum(axis=2)
        # rows and columns that take part (einsum casts in buffers: no [n, n, seg] int64 temporary)
        self.s_q = np.einsum("ijk,ik->ij", self.q_involved, self.q_count)
        self.s_kv = np.einsum("ijk,jk->ij", self.kv_involved, vc)
        self.elementwise = (self.pairs > 0) & (self.pairs != self.s_q * self.s_kv)


    def _seg_pairs(self, qs, qc, ks, kc, stride) -> np.ndarray:
        mask = self.workload.mask
        if mask.kind == "full":
            return np.broadcast_to(qc * kc, np.broadcast_shapes(qc.shape, kc.shape)).astype(np.int64)
        if mask.kind in ("causal", "window"):
            hi = mask.window if mask.kind == "window" else UNBOUNDED
            return count_pairs(qs, qc, ks, kc, stride, 0, hi)
        total = np.zeros(np.broadcast_shapes(qc.shape, kc.shape), dtype=np.int64)
        bounds = mask.doc_bounds
        for lo, hi in zip(bounds[:-1], bounds[1:]):
            dqs, dqc, _ = restrict(qs, stride, qc, lo, hi)
            dks, dkc, _ = restrict(ks, stride, kc, lo, hi)
            total += count_pairs(dqs, dqc, dks, dkc, stride, 0, UNBOUNDED)
        return total

    @cached_property
    def permitted(self) -> np.ndarray:
        """[n, n] bool: blocks with at least one permitted pair (the ones that must be computed)."""
        return self.pairs > 0

    @property
    def tokens_per_chunk(self) -> int:
        """c = S / N (the smallest chunk's tokens; see :attr:`Chunking.tokens_per_chunk`)."""
        return self.chunks.tokens_per_chunk

    @property
    def q_tokens_per_chunk(self) -> int:
        """Query tokens of the smallest chunk: c without a prefix, (S − P) / N with one, 0 in decode."""
        return int(self.chunks.q_tokens.min())

    def chunk_tokens(self, kind: str) -> int:
        """Tokens of the smallest chunk's tensor of ``kind``: :attr:`tokens_per_chunk` for KV kinds, else
        :attr:`q_tokens_per_chunk` (what closed forms use, so they stay lower bounds)."""
        return self.tokens_per_chunk if kind in KV_KINDS else self.q_tokens_per_chunk

    def tokens_of(self, kind: str, chunks: np.ndarray) -> np.ndarray:
        """Tokens a tensor of ``kind`` over ``chunks`` ([k, m] chunk ids) holds: [k]. KV kinds (kv, dkv) hold
        every token of their chunks; the others (q, out, dq, ...) only the query tokens."""
        per = self.chunks.tokens if kind in KV_KINDS else self.chunks.q_tokens
        ch = np.asarray(chunks, dtype=np.int64).reshape(len(chunks), -1)
        if (ch < 0).any():
            raise ValueError("a tensor's chunk list holds an empty slot (-1)")
        return per[ch].sum(axis=1)

    def flops(self, pass_: str = "fwd", heads: int | None = None) -> np.ndarray:
        """[n, n] FLOPs per block: 4·B·h·D·pairs forward, 2.5x that backward (h = ``heads`` or H). Cached."""
        key = (pass_, self.workload.n_heads if heads is None else heads)     # one array for H given or not
        if key not in self._flops:
            self._flops[key] = self.flops_per_pair(pass_, heads) * self.pairs
        return self._flops[key]

    def flops_per_pair(self, pass_: str = "fwd", heads: int | None = None) -> float:
        """FLOPs of one permitted query-key pair for the batch: 4·B·h·D forward, 2.5x that backward."""
        w = self.workload
        f = 4.0 * w.batch * (w.n_heads if heads is None else heads) * w.head_dim
        return f * BWD_FLOP_FACTOR if pass_ == "bwd" else f

    def op_shape(self, qc: np.ndarray, kc: np.ndarray, pass_: str, heads: int):
        """Cost-relevant description of compute ops over q chunks ``qc`` [k, mq] x KV chunks ``kc`` [k, mk].

        Returns (flops [k], s_q [k], s_kv [k], elementwise [k]): the FLOPs of all blocks; the rows and columns
        of the concatenation that take part; whether that rectangle needs an elementwise mask.
        """
        if len(qc) > 256 and qc.shape[1] * kc.shape[1] > 1:       # ops alike but for their heads: one each
            first, again = unique_rows(np.concatenate([qc, kc], axis=1))
            if len(first) < len(qc) // 2:
                return tuple(x[again] for x in self.op_shape(qc[first], kc[first], pass_, heads))
        qi, kj = qc[:, :, None], kc[:, None, :]
        flops = self.flops(pass_, heads)[qi, kj].sum(axis=(1, 2))
        pairs = self.pairs[qi, kj].sum(axis=(1, 2))
        rows = self._involved_tokens(qc, kc, 0, axis=2)
        cols = self._involved_tokens(kc, qc, 1, axis=1)
        return flops, rows, cols, (pairs > 0) & (pairs != rows * cols)

    def op_rows_cols(self, qc: np.ndarray, kc: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """([k] rows, [k] columns) of :meth:`op_shape` alone, for compute ops over q chunks ``qc`` [k, mq] x KV
        chunks ``kc`` [k, mk]: over one KV chunk, the rows are the sum of each block's (:attr:`s_q`), no union of
        segments to take; over one q chunk, the columns likewise (:attr:`s_kv`)."""
        if kc.shape[1] == 1:
            rows = self.s_q[qc, kc].sum(axis=1)
        else:
            rows = self._involved_tokens(qc, kc, 0, axis=2)
        if qc.shape[1] == 1:
            cols = self.s_kv[qc, kc].sum(axis=1)
        else:
            cols = self._involved_tokens(kc, qc, 1, axis=1)
        return rows, cols

    @cached_property
    def _involved_words(self) -> tuple[np.ndarray, np.ndarray]:
        """q_involved and kv_involved with the segment axis packed into 64-bit words: [n, n, ⌈seg/64⌉] uint64."""
        def pack(x):
            pad = -x.shape[2] % 64
            bits = np.packbits(np.pad(x, ((0, 0), (0, 0), (0, pad))), axis=2, bitorder="little")
            return np.ascontiguousarray(bits).view(np.uint64)
        return pack(self.q_involved), pack(self.kv_involved)

    @cached_property
    def _byte_tokens(self) -> tuple[np.ndarray, np.ndarray]:
        """Per chunk, the tokens of the segments each byte value of its packed involvement words selects:
        [n, bytes, 256] for the query counts and for the valid counts (bytes = 8 · words)."""
        bits = np.unpackbits(np.arange(256, dtype=np.uint8)[:, None], axis=1, bitorder="little")   # [256, 8]

        def table(count):
            n, seg = count.shape
            width = self._involved_words[0].shape[2] * 64
            c = np.pad(count, ((0, 0), (0, width - seg))).reshape(n, width // 8, 8).astype(np.int64)
            return c @ bits.T.astype(np.int64)                                      # [n, bytes, 256]
        return table(self.q_count), table(self.valid_count)

    def _involved_tokens(self, own, other, which: int, axis: int) -> np.ndarray:
        """[k]: tokens of the ``own`` chunks [k, m] whose segments take part with any of the ``other`` chunks:
        the involved segments of each (own, other) block OR-ed over ``other`` as packed words, then the tokens
        of each byte of the result looked up (:attr:`_byte_tokens`)."""
        words = self._involved_words[which]
        pick = words[own[:, :, None], other[:, None, :]] if axis == 2 else words[other[:, :, None], own[:, None, :]]
        held = np.bitwise_or.reduce(pick, axis=axis)                                # [k, m, W] uint64
        by_byte = held.view(np.uint8)                                               # [k, m, 8W]
        table = self._byte_tokens[which]
        total = np.zeros(own.shape, dtype=np.int64)
        for j in range(-(-self.q_involved.shape[2] // 8)):                     # the bytes that hold segments
            total += table[own, j, by_byte[:, :, j]]
        return total.sum(axis=1)

    def op_descriptor(self, q_chunks: list[int], kv_chunks: list[int]) -> dict:
        """The compute-op descriptor of a cartesian op: ``q_rows``/``kv_cols`` index the concatenation of the
        chunks' tokens; ``mask`` is ``full`` when the participating rectangle is entirely permitted."""
        if len(q_chunks) == 1 and len(kv_chunks) == 1:
            return self.block_descriptor(q_chunks[0], kv_chunks[0])
        qi, kj = np.asarray(q_chunks)[:, None], np.asarray(kv_chunks)[None, :]
        q_at = np.cumsum([0] + [int(self.chunks.q_tokens[i]) for i in q_chunks])
        k_at = np.cumsum([0] + [int(self.chunks.tokens[j]) for j in kv_chunks])
        rows = [[a + int(q_at[t]), b + int(q_at[t])] for t, i in enumerate(q_chunks)
                for a, b in self.local_ranges(i, self.q_involved[i, kv_chunks].any(axis=0), query=True)]
        cols = [[a + int(k_at[t]), b + int(k_at[t])] for t, j in enumerate(kv_chunks)
                for a, b in self.local_ranges(j, self.kv_involved[q_chunks, j].any(axis=0))]
        pairs = int(self.pairs[qi, kj].sum())
        size = lambda rs: sum(b - a for a, b in rs)  # noqa: E731
        full = pairs == size(rows) * size(cols)
        return {"q_rows": _merge(rows), "kv_cols": _merge(cols), "mask": "full" if full else self.workload.mask.kind}

    def block_descriptor(self, i: int, j: int) -> dict:
        """How to compute block (i, j) with no decisions left (the Schedule's compute-op descriptor).

        ``q_rows`` / ``kv_cols``: [start, end) ranges of chunk-local token indices that take part;
        ``mask``: ``full`` (the rectangle is entirely permitted) or the workload's elementwise rule
        (``causal``, ``window``, ``docs``) applied with the tokens' global positions.
        """
        rows = self.local_ranges(i, self.q_involved[i, j], query=True)
        cols = self.local_ranges(j, self.kv_involved[i, j])
        mask = self.workload.mask.kind if self.elementwise[i, j] else "full"
        return {"q_rows": rows, "kv_cols": cols, "mask": mask}

    def local_ranges(self, chunk: int, involved: np.ndarray, query: bool = False) -> list[list[int]]:
        """[start, end) chunk-local index ranges of the valid tokens of the ``involved`` segments (indices into
        the chunk's query tokens when ``query``, else into all its tokens)."""
        out: list[list[int]] = []
        ch = self.chunks
        offset = ch.q_offset if query else ch.offset
        for k in np.flatnonzero(involved):
            a = int(offset[chunk, k] + self.valid_first[chunk, k])
            b = a + int(self.valid_count[chunk, k])
            if out and out[-1][1] == a:
                out[-1][1] = b
            else:
                out.append([a, b])
        return out


def _merge(ranges: list[list[int]]) -> list[list[int]]:
    out: list[list[int]] = []
    for a, b in ranges:
        if out and out[-1][1] == a:
            out[-1][1] = b
        else:
            out.append([a, b])
    return out


@functools.lru_cache(maxsize=16)
def attn_matrix(workload: Workload, n: int) -> AttnMatrix:
    """A cached AttnMatrix (workloads are frozen, so equal workloads share one): the last 16 asked for are kept
    (a search's layouts; a schedule read and then verified counts its 1024-chunk matrix once, 0.75-2.5 s)."""
    return AttnMatrix(workload, n)
