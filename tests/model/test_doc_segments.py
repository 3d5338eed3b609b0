"""Document segments against references: tile counts against a brute-force loop over tiles, segment pairs against
the matrix's exact pair counts, and per-document segments against the executor's own kernel cover."""

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from meshplan.cost.doc_kernels import op_cover
from meshplan.model.doc_segments import block_segments, floor_sum, tile_count
from meshplan.model.matrix import attn_matrix
from meshplan.model.workload import resolve


def brute_tiles(nq, nk, c, tq, tk):
    """Tiles touched, by walking every row tile (row a sees keys [0, clip(a + c + 1, 0, nk)))."""
    total = 0
    for k in range(-(-nq // tq)):
        last = min((k + 1) * tq, nq) - 1
        total += -(-min(max(last + c + 1, 0), nk) // tk)
    return total


@settings(max_examples=400, deadline=None)
@given(st.integers(0, 400), st.integers(0, 400), st.integers(-500, 500), st.sampled_from([1, 3, 64, 128]),
       st.sampled_from([1, 5, 64, 128]))
def test_tile_count_matches_walking_the_tiles(nq, nk, c, tq, tk):
    assert int(tile_count(nq, nk, c, tq, tk)) == brute_tiles(nq, nk, c, tq, tk)


@given(st.integers(0, 60), st.integers(1, 50), st.integers(0, 50), st.integers(0, 100))
def test_floor_sum(n, m, a, b):
    assert int(floor_sum(n, m, a, b)) == sum((a * i + b) // m for i in range(n))


def test_tile_count_closed_forms():
    # a causal square of t full tiles touches t(t + 1)/2 of them; a 140-token one 2 x 2 tiles, 3 of them touched
    assert int(tile_count(1024, 1024, 0, 128, 128)) == 8 * 9 // 2
    assert int(tile_count(140, 140, 0, 128, 128)) == 3
    assert int(tile_count(140, 300, 300, 128, 64)) == 2 * 5                   # a rectangle: every tile
    assert int(tile_count(100, 100, 0, 1, 1)) == 100 * 101 // 2                # 1 x 1 tiles: the pairs


def _workload(layout: str, doc_layout: str, n: int, seed: int = 0):
    rng = np.random.default_rng(seed)
    lens = [int(x) for x in rng.integers(1, 600, 24)]
    unit = 2 * n if layout == "zigzag" else n
    if doc_layout == "per-doc":
        spec = "docs:" + ",".join(f"{x}+{(-x) % unit}" if x % unit else str(x) for x in lens)
        seq = sum(x + (-x) % unit for x in lens)
    else:
        lens[-1] += (-sum(lens)) % unit
        spec, seq = "docs:" + ",".join(map(str, lens)), sum(lens)
    return resolve(seq_len=seq, heads=2, kv_heads=2, head_dim=16, mask=spec, layout=layout, doc_layout=doc_layout)


@pytest.mark.parametrize("layout", ["zigzag", "contiguous", "striped"])
@pytest.mark.parametrize("doc_layout", ["per-doc", "packed"])
def test_segment_pairs_are_the_matrix_pairs(layout, doc_layout):
    m = attn_matrix(_workload(layout, doc_layout, 4), 4)
    total = np.zeros(16, dtype=np.int64)
    for seg in block_segments(m, budget=500):           # small batches: the batching is exercised
        np.add.at(total, seg.block, seg.pairs)
    np.testing.assert_array_equal(total.reshape(4, 4), m.pairs)


@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
def test_per_document_segments_are_the_executors_kernels(layout):
    """Each block's closed-form segments are exactly the kernels the executor's cover runs (unlimited, as the
    varlen path does): the same count and the same tiles at FlashAttention-2's 128 x 64."""
    n = 3
    m = attn_matrix(_workload(layout, "per-doc", n, seed=3), n)
    tiles, count = np.zeros(n * n, dtype=np.int64), np.zeros(n * n, dtype=np.int64)
    for seg in block_segments(m):
        np.add.at(tiles, seg.block, tile_count(seg.nq, seg.nk, seg.c, 128, 64))
        np.add.at(count, seg.block, 1)
    for i in range(n):
        for j in range(n):
            plan = op_cover(m, (i,), (j,), unlimited=True)
            rows = np.array([p.r1 - p.r0 for p in plan])
            cols = np.array([p.c1 - p.c0 for p in plan])
            causal = np.array([p.causal for p in plan])
            want = tile_count(rows, cols, np.where(causal, 0, cols), 128, 64).sum() if plan else 0
            assert (count[i * n + j], tiles[i * n + j]) == (len(plan), want), (i, j)


@pytest.mark.parametrize("layout,doc_layout", [("zigzag", "per-doc"), ("contiguous", "per-doc"),
                                               ("striped", "per-doc"), ("zigzag", "packed")])
def test_block_tiles_closed_form_sums_the_segments(layout, doc_layout):
    """The matrix-product tile sums of the per-document layouts equal the segments summed one by one."""
    from meshplan.model.doc_segments import block_tiles

    n, (tq, tk) = 4, (128, 64)
    m = attn_matrix(_workload(layout, doc_layout, n, seed=5), n)
    want = np.zeros((4, n * n))
    for seg in block_segments(m):
        work = tile_count(seg.nq, seg.nk, seg.c, tq, tk) * tq * tk
        for k, sel in enumerate((seg.rect, ~seg.rect)):
            np.add.at(want[k], seg.block[sel], work[sel])
            np.add.at(want[2 + k], seg.block[sel], 1)
    got = block_tiles(m, tq, tk)
    for k, arr in enumerate((got.rect_work, got.stair_work, got.rect, got.stair)):
        np.testing.assert_array_equal(arr.ravel(), want[k])
