"""The attention matrix against closed forms and brute force."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from meshplan.core.errors import UserError
from meshplan.model.matrix import AttnMatrix
from meshplan.model.pair_counts import count_pairs, piece_pairs, restrict, same_doc_pairs
from meshplan.model.workload import Mask, Workload


def wl(S, layout="zigzag", mask="causal", valid=None, H=1, B=1, D=1, doc_layout="per-doc", prefix=0):
    return Workload(batch=B, seq_len=S, n_heads=H, n_kv_heads=1, head_dim=D, mask=Mask.parse(mask), layout=layout,
                    valid_len=valid, doc_layout=doc_layout, prefix_len=prefix, passes="fwd" if prefix else "fwd+bwd")


def brute_pairs(w: Workload, m: AttnMatrix) -> np.ndarray:
    """Permitted pairs per block by enumerating tokens (reference)."""
    n = m.n
    out = np.zeros((n, n), dtype=np.int64)
    for i in range(n):
        q = m.chunks.positions(i)
        for j in range(n):
            k = m.chunks.positions(j)
            qq, kk = q[:, None], k[None, :]
            ok = np.ones_like(qq * kk, dtype=bool)
            if w.mask.kind in ("causal", "window", "docs"):
                ok &= kk <= qq
            if w.mask.kind == "window":
                ok &= qq - kk < w.mask.window
            if w.mask.kind == "docs":
                bounds = np.cumsum((0,) + w.mask.doc_lens)
                ok &= np.searchsorted(bounds, qq, side="right") == np.searchsorted(bounds, kk, side="right")
                real_end = bounds[:-1] + np.asarray(w.mask.doc_real_lens())
                dq, dk = (np.searchsorted(bounds, x, side="right") - 1 for x in (qq, kk))
                ok &= (qq < real_end[dq]) & (kk < real_end[dk])
            ok &= (qq < w.n_valid) & (kk < w.n_valid) & (qq >= w.prefix_len)
            out[i, j] = ok.sum()
    return out


@given(qs=st.integers(0, 60), qc=st.integers(0, 12), ks=st.integers(0, 60), kc=st.integers(0, 12),
       stride=st.integers(1, 7), lo=st.integers(-40, 40), width=st.integers(0, 80))
@settings(max_examples=300, deadline=None)
def test_count_pairs_matches_brute_force(qs, qc, ks, kc, stride, lo, width):
    q = qs + stride * np.arange(qc)
    k = ks + stride * np.arange(kc)
    d = q[:, None] - k[None, :]
    expect = int(((d >= lo) & (d < lo + width)).sum())
    assert int(count_pairs(qs, qc, ks, kc, stride, lo, lo + width)) == expect


@pytest.mark.parametrize("n,p", [(2, 1), (4, 3), (8, 16)])
def test_zigzag_oracle(n, p):
    m = AttnMatrix(wl(2 * n * p), n)
    off = ~np.eye(n, dtype=bool)
    assert (m.pairs[off] == 2 * p * p).all()          # off-diagonal: exactly half of 4p^2
    assert (np.diag(m.pairs) == 2 * p * p + p).all()  # diagonal: fraction 1/2 + 1/(4p)
    S = 2 * n * p
    assert m.pairs.sum() == S * (S + 1) // 2


@pytest.mark.parametrize("layout", ["contiguous", "zigzag", "striped"])
@pytest.mark.parametrize("mask", ["full", "causal", "window:5", "window:17", "docs:7,9,8", "docs:24"])
@pytest.mark.parametrize("valid", [None, 19])
@pytest.mark.parametrize("rows_at_once", ["all", "one"])
def test_pairs_match_brute_force(layout, mask, valid, rows_at_once, monkeypatch):
    """Counted all at once or a query chunk at a time (SEG_PAIRS_BLOCK), the same pairs."""
    import meshplan.model.matrix as matrix
    if rows_at_once == "one":
        monkeypatch.setattr(matrix, "SEG_PAIRS_BLOCK", 1)
    w = wl(24, layout, mask, valid, doc_layout="packed")
    m = AttnMatrix(w, 3 if layout != "zigzag" else 4)
    assert np.array_equal(m.pairs, brute_pairs(w, m))
    assert np.array_equal(m.q_involved.any(axis=2) | (m.pairs == 0), np.ones_like(m.pairs, dtype=bool))


@pytest.mark.parametrize("layout,n,mask", [
    ("zigzag", 2, "docs:7+1,9+3,5+3"), ("zigzag", 2, "docs:8,4,16"), ("contiguous", 3, "docs:7+2,9,8+1"),
    ("striped", 3, "docs:7+2,9,8+1"), ("zigzag", 4, "docs:3+5,16,1+7")])
def test_per_document_layout_matches_brute_force(layout, n, mask):
    """Each document is cut by the layout on its own; in-document padding never counts."""
    w = wl(sum(Mask.parse(mask).doc_lens), layout, mask)
    m = AttnMatrix(w, n)
    assert np.array_equal(m.pairs, brute_pairs(w, m))
    real = sum(Mask.parse(mask).doc_real_lens())
    assert m.valid_count.sum() == real                       # every real token on exactly one rank


@pytest.mark.parametrize("layout,n,mask,valid", [
    ("zigzag", 2, "docs:7+1,9+3,5+3", None), ("zigzag", 4, "docs:3+5,16,1+7,24,8", None),
    ("zigzag", 4, "docs:16,5+3,24,8", 30), ("contiguous", 3, "docs:7+2,9,8+1", None),
    ("contiguous", 2, "docs:7+1,9+1,6", 13), ("striped", 3, "docs:7+2,9,8+1,3", None)])
def test_per_document_pairs_equal_every_segment_against_every_other(layout, n, mask, valid, monkeypatch):
    """The per-document paths (each document's pieces in closed form; a document's segments against its own, in
    batches) give what pairing every segment with every other gives: pairs, and which segments take part."""
    w = wl(sum(Mask.parse(mask).doc_lens), layout, mask, valid)
    ch = AttnMatrix(w, n).chunks
    vs, vc, _ = restrict(ch.start, ch.stride, ch.count, 0, ch.real_end)
    width = 2 if layout == "zigzag" else 1
    ways = [same_doc_pairs(vs, vc, vc, ch.stride[0, 0], width, budget=8)]
    if layout != "striped":
        ways.append(piece_pairs(w, n, width))
    monkeypatch.setattr("meshplan.model.matrix.doc_columns", lambda workload, chunks: 0)
    every = AttnMatrix(w, n)
    for pairs, q_involved, kv_involved in ways:
        assert np.array_equal(pairs, every.pairs)
        assert np.array_equal(q_involved, every.q_involved) and np.array_equal(kv_involved, every.kv_involved)


def test_per_document_zigzag_by_hand():
    """Documents of 8 and 16 tokens on 2 ranks: rank 0 holds pieces 0 and 3 of each document (zigzag)."""
    m = AttnMatrix(wl(24, "zigzag", "docs:8,16"), 2)
    assert m.chunks.positions(0).tolist() == [0, 1, 6, 7, 8, 9, 10, 11, 20, 21, 22, 23]
    assert m.chunks.positions(1).tolist() == [2, 3, 4, 5, 12, 13, 14, 15, 16, 17, 18, 19]
    # causal pairs per document: 8·9/2 + 16·17/2 = 172; split evenly, as zigzag promises within each document
    assert m.pairs.sum() == 172 and m.pairs.sum(axis=1).tolist() == [86, 86]


def test_only_padding_rank():
    """A document of 1 real token padded to 8 on 4 zigzag ranks: ranks 1-3 hold only its padding."""
    m = AttnMatrix(wl(8, "zigzag", "docs:1+7"), 4)
    assert m.pairs.tolist() == [[1, 0, 0, 0], [0] * 4, [0] * 4, [0] * 4]
    assert m.valid_count.sum(axis=1).tolist() == [1, 0, 0, 0]


@pytest.mark.parametrize("layout,n,S,P", [("zigzag", 2, 24, 8), ("contiguous", 4, 24, 8), ("striped", 3, 18, 6),
                                          ("zigzag", 4, 19, 16), ("contiguous", 4, 14, 12)])
def test_prefix_matches_brute_force(layout, n, S, P):
    """A cached prefix: its tokens are keys only; new tokens are cut on their own (decode: round-robin)."""
    w = wl(S, layout, "causal", prefix=P)
    m = AttnMatrix(w, n)
    assert np.array_equal(m.pairs, brute_pairs(w, m))
    T = S - P
    assert m.pairs.sum() == T * P + T * (T + 1) // 2
    assert m.chunks.q_tokens.sum() == T and m.chunks.tokens.sum() == S


def test_region_granularity_errors():
    with pytest.raises(UserError, match=r"--mask.*document 1 has 7 tokens.*docs:7\+1,9\+3 --seq-len 20"):
        AttnMatrix(wl(16, "zigzag", "docs:7,9"), 2)
    with pytest.raises(UserError, match="--prefix-len"):
        AttnMatrix(wl(16, "zigzag", prefix=6), 2)
    with pytest.raises(UserError, match="new tokens"):
        AttnMatrix(wl(22, "zigzag", prefix=16), 2)


def test_striped_closed_form():
    n, c = 4, 6
    m = AttnMatrix(wl(n * c, "striped"), n)
    lower = np.tril(np.ones((n, n), dtype=bool))
    assert (m.pairs[lower] == c * (c + 1) // 2).all() and (m.pairs[~lower] == c * (c - 1) // 2).all()


def test_window_and_docs_counts():
    # contiguous c = 16, window 10: a diagonal block holds sum(min(i+1, 10)) = 115 pairs, the one below 45
    m = AttnMatrix(wl(64, "contiguous", "window:10"), 4)
    assert m.pairs[0, 0] == 115 and m.pairs[1, 0] == 45 and m.pairs[2, 0] == 0
    # two documents of 8 and 8 tokens on 2 contiguous chunks: causal inside each, nothing across
    m = AttnMatrix(wl(16, "contiguous", "docs:8,8", doc_layout="packed"), 2)
    assert m.pairs.tolist() == [[36, 0], [0, 36]]


def test_flops_and_kernel_shapes():
    w = wl(64, "zigzag", H=4, B=2, D=8)
    m = AttnMatrix(w, 4)
    assert np.allclose(m.flops("fwd"), 4 * 2 * 4 * 8 * m.pairs)
    assert np.allclose(m.flops("bwd"), 2.5 * m.flops("fwd"))
    c = 16
    assert (m.s_q[2, 1], m.s_kv[2, 1]) == (c, c // 2)   # i > j: both query pieces vs the first KV piece
    assert (m.s_q[1, 2], m.s_kv[1, 2]) == (c // 2, c)   # i < j: the second query piece vs both KV pieces
    assert m.block_descriptor(2, 1) == {"q_rows": [[0, 16]], "kv_cols": [[0, 8]], "mask": "full"}
    assert m.block_descriptor(1, 2) == {"q_rows": [[8, 16]], "kv_cols": [[0, 16]], "mask": "full"}
    assert m.block_descriptor(1, 1)["mask"] == "causal"


def test_padding_never_contributes():
    m = AttnMatrix(wl(8, "contiguous", "full", valid=7), 2)
    assert m.pairs.tolist() == [[16, 12], [12, 9]]
    assert m.block_descriptor(1, 1) == {"q_rows": [[0, 3]], "kv_cols": [[0, 3]], "mask": "full"}


def test_layout_granularity_error_suggests_padding():
    with pytest.raises(UserError) as err:
        AttnMatrix(wl(2999, "zigzag"), 4)
    text = str(err.value)
    assert "2·N = 8" in text and "--seq-len 3000 --valid-len 2999" in text


@settings(max_examples=25, deadline=None)
@given(st.lists(st.integers(1, 3), min_size=1, max_size=150), st.sampled_from([2, 4]), st.integers(0, 2**31))
def test_op_shape_counts_the_segments_that_take_part(units, n, seed):
    """Rows and keys of an op over several chunks (packed words and byte tables) against the segment-by-segment
    definition: a segment takes part when it does with any chunk on the other side. Per-document zigzag over up
    to 150 documents (one segment per document in every chunk), so the segment axis spans several 64-bit words."""
    lens = [2 * n * u for u in units]
    w = wl(sum(lens), mask="docs:" + ",".join(map(str, lens)))
    m = AttnMatrix(w, n)
    rng = np.random.default_rng(seed)
    k, mq, mk = 12, int(rng.integers(1, n + 1)), int(rng.integers(1, n + 1))
    qc = np.stack([rng.permutation(n)[:mq] for _ in range(k)])
    kc = np.stack([rng.permutation(n)[:mk] for _ in range(k)])
    if seed % 2:                          # many ops alike but for their heads: priced once each, then spread
        pick = rng.integers(0, k, 600)
        qc, kc = qc[pick], kc[pick]
    _, rows, cols, _ = m.op_shape(qc, kc, "fwd", 1)
    qi, kj = qc[:, :, None], kc[:, None, :]
    assert (rows == (m.q_involved[qi, kj].any(axis=2) * m.q_count[qc]).sum(axis=(1, 2))).all()
    assert (cols == (m.kv_involved[qi, kj].any(axis=1) * m.valid_count[kc]).sum(axis=(1, 2))).all()
    for a, b in ((qc, kc), (qc[:, :1], kc), (qc, kc[:, :1]), (qc[:, :1], kc[:, :1])):   # one chunk a side: sums
        r, c = m.op_rows_cols(a, b)
        ai, bj = a[:, :, None], b[:, None, :]
        assert (r == (m.q_involved[ai, bj].any(axis=2) * m.q_count[a]).sum(axis=(1, 2))).all()
        assert (c == (m.kv_involved[ai, bj].any(axis=1) * m.valid_count[b]).sum(axis=(1, 2))).all()
