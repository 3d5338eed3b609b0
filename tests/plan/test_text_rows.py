"""JSON text laid out column by column (meshplan.plan.json.text_rows) against the same rows written one at a time
with f-strings, and a schedule's text against the canonical compact dump of its own parse."""

from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from meshplan.algorithms import get
from meshplan.model.topology import Topology
from meshplan.model.workload import resolve
from meshplan.plan.json import compiled
from meshplan.plan.json.io import to_json_bytes
from meshplan.plan.json.text_rows import Rows

TABLE = ["send", "compute", "", '"a\\u00e9"']
BIG_TABLE = [f'"{"x" * k}{k}"' for k in range(20)]      # past the literal-per-string path: copied byte by byte

#: numpy's stores, and the compiled ones where built: the same bytes
WAYS = [False, pytest.param(True, marks=pytest.mark.skipif(not compiled.built(), reason="the compiled loops are not "
                                                                                        "built"))]
row = st.tuples(st.integers(0, 2**62), st.integers(-1, 10**7), st.booleans(), st.integers(0, 3),
                st.lists(st.integers(0, 10**12), max_size=5), st.integers(0, len(BIG_TABLE) - 1))


@pytest.mark.parametrize("compiled_stores", WAYS)
@settings(max_examples=60, deadline=None)
@given(rows=st.lists(row, max_size=40), literal=st.text("ab:,", min_size=1, max_size=19))
def test_rows_equal_f_strings(rows, literal, compiled_stores):
    """Integers of every width (0 and int64's), nulls, a piece only in some rows, choices (an empty one; a large
    table), lists (empty ones), literals of every length up to 19 (stored 1, 2, 4 and 8 bytes at a time)."""
    n = len(rows)
    big, small, some, code, lists, wide = (list(x) for x in zip(*rows)) if rows else ([], [], [], [], [], [])
    ptr = np.r_[0, np.cumsum([len(v) for v in lists])].astype(np.int64)
    flat = np.array([x for v in lists for x in v], dtype=np.int64)
    r = Rows(n).text('{"a":').ints(np.array(big, dtype=np.int64)).text(',"b":')
    r.ints(np.array(small, dtype=np.int64), null_below_zero=True).text(',"c":', np.array(some, dtype=bool))
    r.choice(np.array(code, dtype=np.int64), TABLE, np.array(some, dtype=bool)).text(',"d":').int_lists(ptr, flat)
    r.text(literal).choice(np.array(wide, dtype=np.int64), BIG_TABLE).text("}")
    text, offsets = r.render(compiled=compiled_stores)
    want = [f'{{"a":{a},"b":{"null" if b < 0 else b}' + (f',"c":{TABLE[c]}' if s else "")
            + f',"d":[{",".join(map(str, v))}]{literal}{BIG_TABLE[x]}}}' for a, b, s, c, v, x in rows]
    got = [text[offsets[i]:offsets[i + 1]].tobytes().decode() for i in range(n)]
    assert got == want


def test_a_negative_number_is_refused():
    with pytest.raises(ValueError):
        Rows(1).ints(np.array([-1]))
    with pytest.raises(ValueError):
        Rows(1).int_lists(np.array([0, 1]), np.array([-3]))


def _doc_place_heads():
    """A doc-place schedule whose head-parallel group sends packed tensors (``parts``)."""
    w = resolve(seq_len=4096, heads=8, kv_heads=2, head_dim=16, dtype="bf16", mask="docs:3000,600,496")
    topo = Topology.load("dgx-h100", gpus=8)
    alg = get("doc-place")
    return alg.schedule(alg.plan(w, topo, 8, alg.normalize({})), topo)


def _built(name, knobs, n, topo, **kw):
    t = Topology.load(topo, gpus=n)
    alg = get(name)
    return alg.schedule(alg.plan(resolve(**kw), t, n, alg.normalize(knobs)), t)


@pytest.mark.parametrize("make", [
    lambda: _built("mesh", {"tile": "4x4"}, 16, "h100x16", seq_len="32K", layout="striped"),     # multi-chunk ops
    lambda: _built("usp", {"ulysses_degree": 4}, 16, "h100x16", seq_len="32K", mask="window:1000"),
    lambda: _built("pass-q", {}, 8, "h100x8", seq_len="16K", prefix_len="8K", passes="fwd"),
    _doc_place_heads,
])
@pytest.mark.parametrize("compiled_stores", WAYS)
def test_a_schedule_text_is_its_canonical_compact_dump(make, compiled_stores, monkeypatch):
    """What the writer lays out is exactly ``json.dumps`` of its own parse (no space, the keys in order, floats as
    Python writes them, ``null``), and the parse holds every op: a field left out or misplaced shows — by numpy's
    stores and by the compiled ones."""
    if not compiled_stores:
        monkeypatch.setattr(compiled, "text", None)
    sched = make()
    raw = to_json_bytes(sched)
    doc = json.loads(raw)
    assert raw.decode() == json.dumps(doc, separators=(",", ":"))
    ops = [op for r in doc["ranks"] for op in r["ops"]]
    assert [op["id"] for op in ops] == list(range(len(sched.ops)))
    assert [len(op["deps"]) for op in ops] == np.diff(sched.ops.dep_ptr).tolist()
    flops = [op["flops"] for op in ops if op["kind"] == "compute"]
    assert flops == sched.ops.flops[sched.ops.kind == 0].tolist()
    if make is _doc_place_heads:
        assert any(op.get("parts") for op in ops)


def test_distinct_signatures_group_equal_rows():
    """Compute ops' descriptors are computed once per distinct signature, rows grouped by a hash then checked: the
    groups are exactly np.unique's (wide rows too, past any fixed table of multipliers)."""
    from meshplan.plan.json.schedule_text import _distinct

    rng = np.random.default_rng(1)
    for width in (1, 5, 1300):
        base = rng.integers(0, 3, size=(7, width))
        rows = base[rng.integers(0, 7, size=200)]
        first, inverse = _distinct(rows)
        assert np.array_equal(rows[first[inverse]], rows)
        assert len(first) == len(np.unique(rows, axis=0))
