"""Schedule assembly's field gathering (meshplan/plan/build.py): each op's scalar field and list field, in rank order,
against a per-op reference — for scalar and array blocks mixed, and list widths on both sides of the dense table's
limit (dense [ops, width] table vs CSR rows reordered)."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from meshplan.plan.build import DENSE_MAX_WIDTH, _ragged, _scalar, _starts


@st.composite
def blocks_of(draw):
    """Builder blocks: k ops each on random ranks, a scalar or per-op ``step``, a [k, w] ``deps`` list with −1 slots."""
    out = []
    for _ in range(draw(st.integers(1, 6))):
        k = draw(st.integers(0, 5))
        w = draw(st.integers(0, DENSE_MAX_WIDTH + 2))
        ints = st.integers(-1, 30)
        block = {"rank": np.asarray(draw(st.lists(st.integers(0, 3), min_size=k, max_size=k)), dtype=np.int64)}
        if draw(st.booleans()):
            block["step"] = np.asarray(draw(st.lists(ints, min_size=k, max_size=k)), dtype=np.int64)
        elif draw(st.booleans()):
            block["step"] = draw(ints)
        if w and draw(st.booleans()):
            block["deps"] = np.asarray(draw(st.lists(ints, min_size=k * w, max_size=k * w)),
                                       dtype=np.int64).reshape(k, w)
        out.append(block)
    return out


def _per_op(blocks, name, default):
    """[(rank, scalar value, list without −1)] of every op, in block order."""
    rows = []
    for b in blocks:
        k = len(b["rank"])
        v = b.get(name, default)
        lst = b.get("deps")
        for i in range(k):
            value = v[i] if np.ndim(v) else v
            row = [] if lst is None else [x for x in np.asarray(lst).reshape(k, -1)[i].tolist() if x >= 0]
            rows.append((int(b["rank"][i]), int(value), row))
    return rows


@settings(max_examples=150, deadline=None)
@given(blocks_of())
def test_fields_in_rank_order_match_each_op(blocks):
    lengths = [len(b["rank"]) for b in blocks]
    starts = _starts(lengths)
    rank = _scalar(blocks, "rank", np.int64, 0, lengths, starts)
    order = np.argsort(rank, kind="stable")
    block_of = np.repeat(np.arange(len(blocks), dtype=np.int32), lengths)[order]
    step = _scalar(blocks, "step", np.int32, -1, lengths, starts, order, block_of)
    ptr, deps = _ragged(blocks, "deps", lengths, starts, order)
    expect = sorted(_per_op(blocks, "step", -1), key=lambda r: r[0])       # stable: block order within a rank
    assert step.dtype == np.int32
    assert step.tolist() == [e[1] for e in expect]
    assert len(ptr) == len(expect) + 1
    assert [deps[ptr[i]:ptr[i + 1]].tolist() for i in range(len(expect))] == [e[2] for e in expect]
    # without an order: block order, as the tensor table is assembled
    ptr0, deps0 = _ragged(blocks, "deps", lengths, starts)
    assert [deps0[ptr0[i]:ptr0[i + 1]].tolist() for i in range(len(expect))] == \
        [e[2] for e in _per_op(blocks, "step", -1)]
