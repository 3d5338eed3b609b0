"""Records read by their skeletons (plan/json/skeleton.py, record_columns.py) against pydantic's reading of the same
text: equal columns wherever the fast path accepts, and a refusal (None) wherever pydantic would raise."""

from __future__ import annotations

import json

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import TypeAdapter, ValidationError

from meshplan.algorithms import get
from meshplan.core.errors import UserError
from meshplan.model.topology import Topology
from meshplan.model.workload import resolve
from meshplan.plan.json.format import RankJSON, TensorJSON
from meshplan.plan.json.io import to_json_bytes
from meshplan.plan.json.number_scan import parse_digits
from meshplan.plan.json.read_parts import _rank_objects, _tensor_batches
from meshplan.plan.json.record_columns import op_reader, rank_columns, tensor_columns, tensor_reader
from meshplan.plan.json.to_arrays import OpColumns, TensorColumns
from meshplan.plan.schedule import Streams


def build(name, knobs=None, gpus=4, **kw):
    w = resolve(**({"seq_len": "8K"} | kw))
    t = Topology.load("h100x8", gpus=gpus)
    alg = get(name)
    return alg.schedule(alg.plan(w, t, gpus, alg.normalize(knobs or {})), t)


CASES = [("ring", None, {}), ("usp", {"ulysses_degree": "2"}, {}), ("mesh", {"tile": "2x2"}, {"layout": "striped"}),
         ("charm", {"domains": "2"}, {}), ("startrail", None, {"mask": "docs:3000,5192"}),
         ("loongtrain", None, {"passes": "fwd"}), ("pass-q", None, {"mask": "window:700", "valid_len": 8000}),
         ("ulysses", None, {})]


def parts(sched):
    """(rank texts, tensor batch texts, the schedule) of a schedule as meshplan writes it."""
    raw = to_json_bytes(sched)
    t_key, r_key = raw.find(b',"tensors":['), raw.rfind(b'],"ranks":[')
    ranks = [bytes(r) for r in _rank_objects(raw, r_key + len(b'],"ranks":['), len(raw) - 2)]   # views: bytes
    batches = [b"[" + bytes(b) + b"]" for b in _tensor_batches(raw, t_key + len(b',"tensors":'), r_key + 1)]
    return ranks, batches, sched


def slow_ops(sched, texts):
    """What pydantic makes of rank texts: (columns by key, ranks stated), or the error it raises."""
    ops, model, listed = OpColumns(sched.streams, sched.workload, sched.n_chunks), TypeAdapter(RankJSON), []
    for text in texts:
        rank = model.validate_json(text)
        listed.append(rank.rank)
        ops.parts.append(ops.columns(rank.ops, rank.rank))
    return {k: np.concatenate([p[k] for p in ops.parts]) for k in ops.parts[0]}, listed


def fast_ops(sched, texts):
    idx = {name: i for i, name in enumerate(sched.streams.names)}
    return rank_columns(op_reader(), texts, idx, sched.workload.n_heads, sched.n_chunks)


def assert_same(fast: dict, slow: dict):
    assert set(fast) == set(slow)
    for k in slow:
        assert fast[k].dtype == slow[k].dtype and np.array_equal(fast[k], slow[k]), k


@pytest.mark.parametrize("name,knobs,kw", CASES)
def test_every_method_is_read_by_its_skeletons_into_pydantic_s_columns(name, knobs, kw):
    ranks, batches, s = parts(build(name, knobs, **kw))
    got = fast_ops(s, ranks)
    assert got is not None                              # what meshplan writes takes the fast path
    slow, listed = slow_ops(s, ranks)
    assert_same(got[0], slow)
    assert got[1] == listed == list(range(s.n_ranks))
    tensors, count = TensorColumns(), 0
    for text in batches:
        recs = tensor_reader().records([text[1:-1]])
        assert recs is not None
        fast = tensor_columns(recs[0], count)
        tensors.add(TypeAdapter(list[TensorJSON]).validate_json(text))
        assert_same(fast, tensors.parts[-1])
        count = tensors.count


def test_ranks_without_ops_and_a_stream_named_with_digits():
    """An empty rank keeps its place; digits inside a string (a stream ``kv2``, ``"bf16"``) are no number."""
    s = build("ring", passes="fwd")
    ranks, _, _ = parts(s)
    streams = Streams()
    for name, kind in zip(s.streams.names, s.streams.kinds):
        streams.add("kv2" if name == "kv" else name, kind)
    s.streams = streams
    ranks = [t.replace(b'"stream":"kv"', b'"stream":"kv2"') for t in ranks]
    ranks.insert(2, b'{"rank":2,"ops":[]}')
    ranks = ranks[:3] + [t.replace(b'{"rank":%d,' % k, b'{"rank":%d,' % (k + 1)) for k, t in
                         zip(range(2, len(ranks)), ranks[3:])]
    got = fast_ops(s, ranks)
    assert got is not None and b'"stream":"kv2"' in ranks[0]
    slow, listed = slow_ops(s, ranks)
    assert_same(got[0], slow)
    assert got[1] == listed and 2 not in got[0]["rank"]


def _edit_first_op(text: bytes, old: bytes, new: bytes) -> bytes:
    assert old in text
    return text.replace(old, new, 1)


@pytest.mark.parametrize("old,new,pydantic_accepts", [
    (b'{"id":0,', b'{"id":00,', False),                          # a leading zero: not JSON
    (b'"peer":1,', b'"peer":2147483648,', False),                 # beyond Int32
    (b'"peer":1,', b'"peer":2147483647,', True),                  # the bound itself
    (b'"size_bytes":', b'"size_bytes":9', True),                  # longer, still a number
    (b'"dtype":"bf16"', b'"dtype":"bf1"', False),
    (b'"dtype":"bf16"', b'"dtype":"fp32"', True),
    (b'{"id":0,', b'{"id":4611686018427387905,', False),          # beyond 2**62
    (b'{"id":0,"kind":"send",', b'{"kind":"send","id":0,', True),  # keys in another order: valid, not our layout
    (b'{"id":0,', b'{ "id":0,', True),                            # a space: valid, not our layout
    (b'"step":0}', b'"step":0,"step":1}', True),                  # a repeated key: JSON keeps the last
    (b'"step":0}', b'"step":null}', True),
    (b'"step":0}', b'"step":-1}', False),
    (b'"step":0}', b'"step":0.0}', True),                         # a float for an integer: pydantic takes it
    (b'"size_bytes":', b'"size_bytes":1.', False),                # ... unless it has a fraction
    (b'"deps":[]', b'"deps":[1,]', False),
    (b'"pass":"fwd"', b'"pass":"fw\\u0064"', True),               # an escape: not our layout
    (b'{"id":0,', b'{"id":"0",', True),                           # pydantic reads a string of digits as a number
    (b'"peer":1,', b'"peer":true,', True),                        # ... and true as 1
    (b'"size_bytes":', b'"size_bytes":"8388608","x":', False),
    (b'"pass":"fwd"', b'"pass_":"fwd"', True),                    # the field's own name: pydantic takes it
])
def test_a_number_or_string_the_layout_does_not_hold_is_read_by_pydantic(old, new, pydantic_accepts):
    s = build("ring", passes="fwd")
    ranks, _, _ = parts(s)
    ranks[0] = _edit_first_op(ranks[0], old, new)
    got = fast_ops(s, ranks)
    try:
        slow = slow_ops(s, ranks)
    except (ValidationError, UserError):
        slow = None
    assert (slow is not None) == pydantic_accepts
    if got is not None:              # accepted by the fast path only with pydantic's very reading
        assert slow is not None
        assert_same(got[0], slow[0])
    if new in (b'"peer":2147483647,', b'"dtype":"fp32"', b'"step":null}'):
        assert got is not None       # in the layout: still the fast path


@pytest.mark.parametrize("old,new", [
    (b'"pass":"fwd"', b'"pass_":"fwd"'),                           # the field's own name (found by review)
    (b',"alloc_op":null', b''),                                    # an optional key left out
    (b',"free_after":[]', b''),
    (b'"size_bytes":', b'"size_bytes":"1",'),                     # a string of digits, then the key again
])
def test_a_tensor_written_otherwise_is_read_as_pydantic_reads_it(old, new):
    _, batches, _ = parts(build("ring", passes="fwd"))
    text = batches[0].replace(old, new, 1)
    assert text != batches[0]
    recs = tensor_reader().records([text[1:-1]])
    fast = None if recs is None else tensor_columns(recs[0], 0)
    try:
        slow = TensorColumns()
        slow.add(TypeAdapter(list[TensorJSON]).validate_json(text))
    except (ValidationError, UserError):
        slow = None
    if fast is not None:
        assert slow is not None
        assert_same(fast, slow.parts[0])
    if old != b'"size_bytes":':
        assert fast is not None                   # valid, and in a form the fast path reads


@pytest.mark.parametrize("flops,accepted", [(b"1.5e+15", True), (b"0", True), (b"12.0", True), (b"3e-05", True),
                                            (b"1e+400", False), (b"-1.0", False), (b"01.5", False),
                                            (b"1.5E+15", False), (b"1.e+5", False), (b"NaN", False)])
def test_a_compute_op_s_flops_as_repr_writes_them(flops, accepted):
    """FLOPs are recomputed from the matrix; the text must still be a finite, non-negative JSON number."""
    s = build("ring", passes="fwd")
    ranks, _, _ = parts(s)
    at = ranks[0].index(b'"flops":') + len(b'"flops":')
    stop = ranks[0].index(b"}", at)
    ranks[0] = ranks[0][:at] + flops + ranks[0][stop:]
    got = fast_ops(s, ranks)
    assert (got is not None) == accepted
    if accepted:
        assert_same(got[0], slow_ops(s, ranks)[0])


def test_an_empty_record_is_not_taken_for_the_gap_between_ranks():
    s = build("ring", passes="fwd")
    ranks, _, _ = parts(s)
    ranks[1] = ranks[1].replace(b'"ops":[{', b'"ops":[{},{', 1)
    assert fast_ops(s, ranks) is None
    with pytest.raises(ValidationError):
        slow_ops(s, ranks)


_BYTES = [b"0", b"1", b"9", b"-", b".", b"e", b"+", b'"', b"{", b"}", b"[", b"]", b",", b":", b" ", b"a", b"x",
          b"", b"00", b"},{", b'"id":', b"null"]


@settings(max_examples=500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_fuzz_the_fast_path_accepts_only_what_pydantic_reads_the_same(data):
    """Any edit of a rank's or a tensor batch's bytes: the fast path refuses it, or pydantic reads the same columns
    from it."""
    s = _FUZZ_SCHEDULE
    ranks, batches, _ = _FUZZ_PARTS
    ranks = list(ranks)
    k = data.draw(st.integers(0, len(ranks) - 1))
    text = ranks[k]
    for _ in range(data.draw(st.integers(1, 3))):
        at = data.draw(st.integers(0, len(text)))
        cut = data.draw(st.integers(0, 3))
        text = text[:at] + data.draw(st.sampled_from(_BYTES)) + text[at + cut:]
    ranks[k] = text
    got = fast_ops(s, ranks)
    if got is not None:
        try:
            slow = slow_ops(s, ranks)
        except (ValidationError, UserError) as err:
            raise AssertionError(f"the fast path took what pydantic refuses: {err}") from None
        assert_same(got[0], slow[0])
        assert got[1] == slow[1]
    batch = batches[0]
    at = data.draw(st.integers(1, len(batch) - 2))
    batch = batch[:at] + data.draw(st.sampled_from(_BYTES)) + batch[at + data.draw(st.integers(0, 2)):]
    recs = tensor_reader().records([batch[1:-1]]) if batch[:1] == b"[" and batch[-1:] == b"]" else None
    fast = None if recs is None else tensor_columns(recs[0], 0)
    if fast is not None:
        slow_t = TensorColumns()
        slow_t.add(TypeAdapter(list[TensorJSON]).validate_json(batch))     # raises: a defect
        assert_same(fast, slow_t.parts[0])


_FUZZ_SCHEDULE = build("usp", {"ulysses_degree": "2"}, passes="fwd", seq_len="4K")
_FUZZ_PARTS = parts(_FUZZ_SCHEDULE)


@given(st.lists(st.integers(0, 10**19 - 1), min_size=1, max_size=50))
def test_digit_runs_parse_to_their_integers(values):
    text = b",".join(str(v).encode() for v in values) + b","
    b = np.frombuffer(text, dtype=np.uint8)
    length = np.array([len(str(v)) for v in values])
    ends = np.cumsum(length + 1) - 1
    assert parse_digits(b, ends, length).tolist() == values


def test_a_tensor_batch_whose_ids_skip_is_refused_as_tensor_columns_would():
    _, batches, _ = parts(build("ring", passes="fwd"))
    recs = tensor_reader().records([batches[0][1:-1]])
    assert tensor_columns(recs[0], 0) is not None and tensor_columns(recs[0], 1) is None
    with pytest.raises(UserError):
        TensorColumns().add([TensorJSON.model_validate(json.loads(batches[0])[0] | {"id": 1})])
