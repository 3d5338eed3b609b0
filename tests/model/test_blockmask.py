"""Masks as per-row key runs and their cover by dense kernels: exact against the dense rule, and the kernels run
over a cover (several pieces, merged by LSE) against float64."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from meshplan.model.workload import Mask

torch = pytest.importorskip("torch")

from helpers import reference_attention  # noqa: E402

from meshplan.executor.kernels import block_backward, block_backward_from_out, block_forward, cover  # noqa: E402
from meshplan.model.blockmask import (  # noqa: E402
    MAX_PIECES,
    Blocks,
    KeyRanges,
    Piece,
    cover_cost,
    kernel_cover,
    pieces,
    rows_overlap,
)

MASKS = [Mask("full"), Mask("causal"), Mask("window", window=5), Mask("docs", doc_lens=(7, 20, 13))]


def _kernel_area(p: Piece) -> np.ndarray:
    """The pairs one kernel of a cover computes, as a 0/1 matrix over its rows and keys."""
    block = np.ones((p.r1 - p.r0, p.c1 - p.c0), dtype=int)
    return np.triu(block) if p.anti else np.tril(block) if p.causal else block


def _positions(draw_set: set[int]) -> np.ndarray:
    return np.array(sorted(draw_set), dtype=np.int64)


@settings(max_examples=200, deadline=None)
@given(q=st.sets(st.integers(0, 39), min_size=1, max_size=40), k=st.sets(st.integers(0, 39), min_size=1,
       max_size=40), which=st.integers(0, len(MASKS) - 1))
def test_key_ranges_equal_the_dense_rule_and_the_cover_is_exact(q, k, which):
    mask = MASKS[which]
    qp, kp = _positions(q), _positions(k)
    rng = np.random.default_rng(len(q) * 41 + len(k))
    qp = rng.permutation(qp)                      # query rows in any order, keys ascending
    ranges = KeyRanges(*mask.key_ranges(qp, kp), len(kp))
    dense = mask.permits(qp, kp)
    assert np.array_equal(ranges.dense("cpu").numpy(), dense)
    plan = pieces(KeyRanges(*mask.key_ranges(np.sort(qp), kp), len(kp)))
    if plan is None:
        return
    assert len(plan) <= MAX_PIECES
    covered = np.zeros((len(qp), len(kp)), dtype=int)
    for p in plan:
        covered[p.r0:p.r1, p.c0:p.c1] += _kernel_area(p)
        if p.causal:
            assert p.r1 - p.r0 == p.c1 - p.c0
    assert np.array_equal(covered, mask.permits(np.sort(qp), kp).astype(int))    # every pair once, nothing else


def test_the_layouts_blocks_are_one_kernel():
    """Zigzag and contiguous diagonals, striped blocks from both sides, a zigzag off-diagonal block (half the
    rows): one kernel each, causal where the rule is a triangle; a causal staircase with an offset: two."""
    causal = Mask("causal")
    n, p = 4, 8                                              # 4 ranks, 8-token zigzag pieces
    zig = [np.r_[np.arange(r * p, r * p + p), np.arange((2 * n - 1 - r) * p, (2 * n - r) * p)] for r in range(n)]
    strip = [np.arange(r, 64, n) for r in range(n)]

    def plan(qp, kp):
        return pieces(KeyRanges(*causal.key_ranges(np.sort(qp), np.sort(kp)), len(kp)))

    assert plan(zig[1], zig[1]) == [Piece(0, 16, 0, 16, True)]
    assert plan(zig[2], zig[0]) == [Piece(0, 16, 0, 8, False)]                  # only piece 0 of rank 0 is seen
    assert plan(strip[2], strip[1]) == [Piece(0, 16, 0, 16, True)]               # q = 4i + 2 sees k = 4j + 1, j <= i
    assert plan(strip[1], strip[2]) == [Piece(1, 16, 0, 15, True)]               # j < i: rows 1.., keys ..14
    assert plan(np.arange(8, 12), np.arange(0, 12)) == [Piece(0, 4, 0, 8, False), Piece(0, 4, 8, 12, True)]
    assert plan(np.arange(0, 4), np.arange(8, 12)) == []


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_kernels_over_a_cover_of_several_pieces_match_float64(dtype):
    """Rows 0–3 see nothing, 4–9 a staircase with an offset (a rectangle and a causal square sharing rows, merged
    by LSE), 10–15 every key: forward, both backward paths, against float64."""
    g = torch.Generator().manual_seed(5)
    B, H, Sq, Skv, D = 1, 2, 16, 14, 8
    q, do = (torch.randn(B, H, Sq, D, generator=g).to(dtype) for _ in range(2))
    k, v = (torch.randn(B, 1, Skv, D, generator=g).to(dtype) for _ in range(2))     # GQA 2:1
    hi = np.r_[np.zeros(4), np.arange(6, 12), np.full(6, Skv)].astype(np.int64)
    ranges = KeyRanges(np.zeros(Sq, dtype=np.int64), hi, Skv)
    assert pieces(ranges) == [Piece(4, 10, 0, 5, False), Piece(4, 10, 5, 11, True), Piece(10, 16, 0, 14, False)]
    allowed = ranges.dense("cpu")
    scale = 1 / math.sqrt(D)
    o_ref, lse_ref, dq_ref, dk_ref, dv_ref = reference_attention(
        q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), do, scale, allowed)
    refs = (dq_ref, dk_ref.sum(1, keepdim=True), dv_ref.sum(1, keepdim=True))
    tol = {torch.bfloat16: 2e-2, torch.float32: 1e-5}[dtype]
    o, lse = block_forward(q, k, v, scale, ranges)
    assert o.dtype == dtype
    assert torch.isneginf(lse[..., :4]).all() and (o[:, :, :4] == 0).all()
    assert torch.allclose(o.double(), o_ref, atol=2 * tol)
    assert torch.allclose(lse[..., 4:].double(), lse_ref[..., 4:], atol=4 * tol)
    lse32, o_fin = lse_ref.float(), o_ref.to(dtype)
    delta = (do.float() * o_ref.float()).sum(-1)
    for grads in (block_backward_from_out(q, k, v, o_fin, do, lse32, scale, ranges),
                  block_backward(q, k, v, do, lse32, delta, scale, ranges)):
        for got, ref in zip(grads, refs):
            assert got.dtype == torch.float32
            assert torch.allclose(got.double(), ref, atol=4 * tol * ref.abs().max().item())


def test_a_window_inside_a_block_falls_back_to_the_dense_bias():
    w = Mask("window", window=3)
    ranges = KeyRanges(*w.key_ranges(np.arange(32), np.arange(32)), 32)
    assert pieces(ranges) is None
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(1, 1, 32, 8, generator=g) for _ in range(3))
    o, lse = block_forward(q, k, v, 0.5, ranges)
    o2, lse2 = block_forward(q, k, v, 0.5, ranges.dense("cpu"))
    assert torch.equal(o, o2) and torch.equal(lse, lse2)


def test_an_op_over_interleaved_striped_chunks_runs_block_by_block_and_matches_float64():
    """A 2 x 2 op of a 4-rank striped causal layout (query chunks 1 and 0, KV chunks 3 and 0): in position order
    its key runs grow by 2 every 2 rows (no short cover); chunk by chunk, :class:`Blocks` covers it with one
    causal kernel per block, rows shared by kernels with different row spans (rows 1.. of chunk 1 against chunk
    3, all its rows against chunk 0), which must merge by LSE. Forward and both backward paths against float64
    on the dense rule."""
    causal, n, S = Mask("causal"), 4, 48
    strip = [np.arange(r, S, n) for r in range(n)]
    q_chunks, kv_chunks = (1, 0), (3, 0)
    pos = np.concatenate([strip[c] for c in q_chunks])
    kpos = np.concatenate([strip[c] for c in kv_chunks])
    merged = KeyRanges(*causal.key_ranges(np.sort(pos), np.sort(kpos)), len(kpos))
    assert pieces(merged) is None
    parts, c = [], len(strip[0])
    for a, qc in enumerate(q_chunks):
        for b, kc in enumerate(kv_chunks):
            parts.append((a * c, (a + 1) * c, b * c, (b + 1) * c,
                          KeyRanges(*causal.key_ranges(strip[qc], strip[kc]), c)))
    blocks = Blocks(tuple(parts), 2 * c, 2 * c)
    plan = cover(blocks, 2 * c, 2 * c)
    assert plan == [Piece(1, 12, 0, 11, True), Piece(0, 12, 12, 24, True),
                    Piece(13, 24, 0, 11, True), Piece(12, 24, 12, 24, True)]
    assert rows_overlap(plan) and not rows_overlap([plan[0], plan[2]])
    allowed = blocks.dense("cpu")
    assert np.array_equal(allowed.numpy(), causal.permits(pos, kpos)) and blocks.pairs == int(allowed.sum())
    g = torch.Generator().manual_seed(9)
    q, do = (torch.randn(1, 4, 2 * c, 16, generator=g) for _ in range(2))
    k, v = (torch.randn(1, 2, 2 * c, 16, generator=g) for _ in range(2))       # GQA 2:1
    scale = 0.25
    o_ref, lse_ref, dq_ref, dk_ref, dv_ref = reference_attention(
        q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), do, scale, allowed)
    refs = (dq_ref, dk_ref.unflatten(1, (-1, 2)).sum(2), dv_ref.unflatten(1, (-1, 2)).sum(2))  # per KV head
    o, lse = block_forward(q, k, v, scale, blocks)
    assert torch.allclose(o.double(), o_ref, atol=1e-5) and torch.allclose(lse.double(), lse_ref, atol=1e-5)
    delta = (do * o_ref.float()).sum(-1)
    for grads in (block_backward_from_out(q, k, v, o_ref.float(), do, lse_ref.float(), scale, blocks),
                  block_backward(q, k, v, do, lse_ref.float(), delta, scale, blocks)):
        for got, ref in zip(grads, refs):
            assert torch.allclose(got.double(), ref, atol=1e-4 * ref.abs().max().item())


@settings(max_examples=150, deadline=None)
@given(n=st.sampled_from([4, 6, 8]), data=st.data())
def test_the_models_by_block_rule_is_the_executors_cover(n, data):
    """The model's :func:`runs_by_block` (on segments cut to ``PERIODS`` tokens) and its closed form
    :func:`striped_runs_by_block` (also after a common cyclic shift of the residues) say "by block" exactly
    when the op's whole position-ordered key runs have no short cover — the executor's own test
    (:mod:`meshplan.executor.ops`) — for causal striped ops over any chunk sets, 40 tokens a chunk."""
    from meshplan.model.blockmask import PERIODS, runs_by_block, striped_runs_by_block
    a = data.draw(st.lists(st.integers(0, n - 1), min_size=1, max_size=n, unique=True))
    b = data.draw(st.lists(st.integers(0, n - 1), min_size=1, max_size=n, unique=True))
    mask = Mask("causal")
    c = 40
    assert c > PERIODS
    q = np.sort(np.concatenate([np.arange(i, n * c, n) for i in a]))
    k = np.sort(np.concatenate([np.arange(j, n * c, n) for j in b]))
    whole = pieces(KeyRanges(*mask.key_ranges(q, k), len(k))) is None
    assert runs_by_block(mask, [(i, n, c) for i in a], [(j, n, c) for j in b]) == whole
    assert striped_runs_by_block(a, b) == whole
    shift = data.draw(st.integers(1, n - 1))                # the closed form holds up to a common cyclic shift
    assert striped_runs_by_block([(i + shift) % n for i in a], [(j + shift) % n for j in b]) == whole


def _covered(plan, n_q, n_k):
    out = np.zeros((n_q, n_k), dtype=int)
    for p in plan:
        out[p.r0:p.r1, p.c0:p.c1] += _kernel_area(p)
    return out


@pytest.mark.parametrize("docs", [(300, 500, 100, 150, 98, 200, 100, 300, 300), (16,) * 100 + (448,)])
def test_document_boundaries_are_covered_per_segment_not_by_a_dense_bias(docs, monkeypatch):
    """A block cut by many documents: more kernels than a short cover allows, fewer elements than the dense
    block — the executor runs one kernel per document segment (forward and backward against float64) and never
    builds the dense mask."""
    mask = Mask("docs", doc_lens=docs)
    total = sum(docs)
    qp, kp = np.arange(total // 2, total), np.arange(total)          # a later chunk against everything
    ranges = KeyRanges(*mask.key_ranges(qp, kp), len(kp))
    assert pieces(ranges) is None
    plan = kernel_cover(ranges)
    assert plan is not None and len(plan) > MAX_PIECES and cover_cost(plan) < len(qp) * len(kp)
    assert np.array_equal(_covered(plan, len(qp), len(kp)), mask.permits(qp, kp).astype(int))
    monkeypatch.setattr(KeyRanges, "dense", lambda self, device: pytest.fail("dense mask built"))
    g = torch.Generator().manual_seed(3)
    q, do = (torch.randn(1, 2, len(qp), 16, generator=g, dtype=torch.float64).float() for _ in range(2))
    k, v = (torch.randn(1, 1, len(kp), 16, generator=g, dtype=torch.float64).float() for _ in range(2))
    o, lse = block_forward(q, k, v, 0.25, ranges)
    allowed = torch.from_numpy(mask.permits(qp, kp))
    o_ref, lse_ref, dq_ref, dk_ref, dv_ref = reference_attention(
        q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), do, 0.25, allowed)
    torch.testing.assert_close(o.double(), o_ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse.double(), lse_ref, atol=1e-5, rtol=1e-5)
    dq, dk, dv = block_backward_from_out(q, k, v, o, do, lse, 0.25, ranges)
    torch.testing.assert_close(dq.double(), dq_ref, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(dk.double(), dk_ref.unflatten(1, (-1, 2)).sum(2), atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(dv.double(), dv_ref.unflatten(1, (-1, 2)).sum(2), atol=1e-4, rtol=1e-4)


def test_a_window_inside_a_block_stays_one_dense_kernel():
    """A sliding window: a kernel per row would cost more than the dense block, so there is no cover."""
    mask = Mask("window", window=5)
    qp = kp = np.arange(64)
    ranges = KeyRanges(*mask.key_ranges(qp, kp), len(kp))
    assert pieces(ranges) is None and kernel_cover(ranges) is None


@pytest.mark.parametrize("window, q0", [(256, 0), (256, 1024), (700, 512), (1024, 1024)])
def test_a_wide_window_is_covered_by_strips_not_by_a_dense_bias(window, q0, monkeypatch):
    """A sliding window of W tokens inside a block: a staircase while rows see fewer than W keys, then strips of
    W rows (a reversed square on the window's far edge, a causal square on its near one) — exact, cheaper than
    the dense block, and run (forward, both backward paths) without the dense mask, against float64."""
    mask = Mask("window", window=window)
    qp, kp = np.arange(q0, q0 + 1024), np.arange(2048)
    ranges = KeyRanges(*mask.key_ranges(qp, kp), len(kp))
    plan = kernel_cover(ranges)
    assert plan is not None and any(p.anti for p in plan) and cover_cost(plan) < len(qp) * len(kp)
    assert np.array_equal(_covered(plan, len(qp), len(kp)), mask.permits(qp, kp).astype(int))
    assert all(p.r1 - p.r0 == p.c1 - p.c0 for p in plan if p.causal)              # squares, for the kernels
    monkeypatch.setattr(KeyRanges, "dense", lambda self, device: pytest.fail("dense mask built"))
    g = torch.Generator().manual_seed(4)
    q, do = (torch.randn(1, 2, len(qp), 16, generator=g, dtype=torch.float64).float() for _ in range(2))
    k, v = (torch.randn(1, 1, len(kp), 16, generator=g, dtype=torch.float64).float() for _ in range(2))
    allowed = torch.from_numpy(mask.permits(qp, kp))
    o_ref, lse_ref, dq_ref, dk_ref, dv_ref = reference_attention(
        q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), do, 0.25, allowed)
    o, lse = block_forward(q, k, v, 0.25, ranges)
    torch.testing.assert_close(o.double(), o_ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse.double(), lse_ref, atol=1e-5, rtol=1e-5)
    delta = (do.double() * o_ref).sum(-1).float()
    for dq, dk, dv in (block_backward_from_out(q, k, v, o, do, lse, 0.25, ranges),
                       block_backward(q, k, v, do, lse, delta, 0.25, ranges)):
        torch.testing.assert_close(dq.double(), dq_ref, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(dk.double(), dk_ref.unflatten(1, (-1, 2)).sum(2), atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(dv.double(), dv_ref.unflatten(1, (-1, 2)).sum(2), atol=1e-4, rtol=1e-4)


def test_a_window_edge_is_a_reversed_square_and_a_rectangle():
    """Rows of a later chunk against an earlier one under a window: row t sees keys t+1 … 7 (its far edge moves
    one key per row, the near edge is the block's end) — two kernels, the reversed square first."""
    ranges = KeyRanges(np.arange(1, 9), np.full(8, 12), 12)
    assert pieces(ranges) == [Piece(0, 8, 1, 9, True, anti=True), Piece(0, 8, 9, 12, False)]
    band = KeyRanges(np.arange(6), np.arange(6) + 4, 10)        # row t sees keys t … t+3: a band of width 4
    assert pieces(band, budget=1 << 30) == [
        Piece(0, 4, 0, 4, True, anti=True), Piece(1, 4, 4, 7, True),
        Piece(4, 6, 4, 6, True, anti=True), Piece(4, 6, 6, 8, False), Piece(5, 6, 8, 9, True)]
