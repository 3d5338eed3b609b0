"""The verifier accepts what the algorithms build and rejects broken schedules with a reason."""

from __future__ import annotations

import numpy as np
import pytest

from meshplan.algorithms import get
from meshplan.core.csr import csr_ptr
from meshplan.model.topology import Topology
from meshplan.model.workload import resolve
from meshplan.plan.schedule import COMPUTE, RECV, SEND, OpTable, Schedule
from meshplan.plan.verify import verify


def build(name="ring", n=4, passes="fwd+bwd", **kw):
    w = resolve(passes=passes, **({"seq_len": 64 * n} | kw))
    t = Topology.load("cpu-local", gpus=n)
    alg = get(name)
    return alg.schedule(alg.plan(w, t, n, alg.normalize({})), t)


@pytest.mark.parametrize("name", ["ring", "pass-q"])
@pytest.mark.parametrize("n", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("layout,mask", [("zigzag", "causal"), ("contiguous", "causal"), ("striped", "window:40"),
                                         ("contiguous", "docs:100,20,8"), ("zigzag", "docs:90+6,13+3,8+8"),
                                         ("zigzag", "full")])
def test_built_schedules_verify(name, n, layout, mask):
    seq = 128 if mask.startswith("docs") else 64 * n
    unit = 2 * n if layout == "zigzag" else n
    per_doc = "+" in mask
    slots = [96, 16, 16] if per_doc else [128]
    if mask.startswith("docs") and any(x % unit for x in slots):
        pytest.skip("documents not divisible")
    kw = {"doc_layout": "per-doc" if per_doc else "packed"} if mask.startswith("docs") else {}
    report = verify(build(name, n, layout=layout, mask=mask, seq_len=seq, **kw))
    assert report.ok, report.violations


def drop_ops(s: Schedule, drop: np.ndarray) -> Schedule:
    """The schedule without some ops (ids renumbered; deps on dropped ops removed)."""
    keep = np.ones(len(s.ops), dtype=bool)
    keep[drop] = False
    new_id = np.cumsum(keep) - 1
    o = s.ops
    fields = {}
    for name in ("rank", "kind", "stream", "phase", "step", "peer", "tensor", "size_bytes", "dtype", "combine",
                 "h0", "h1", "flops", "s_q", "s_kv", "mask"):
        fields[name] = getattr(o, name)[keep]
    for ptr, val in (("dep_ptr", "deps"), ("in_ptr", "inputs"), ("out_ptr", "outputs"), ("qc_ptr", "q_chunks"),
                     ("kvc_ptr", "kv_chunks")):
        p, v = getattr(o, ptr), getattr(o, val)
        owner = np.repeat(np.arange(len(o)), np.diff(p))
        ok = keep[owner] & (keep[v] if val == "deps" else True)
        fields[ptr] = csr_ptr(np.bincount(new_id[owner[ok]], minlength=int(keep.sum())))
        fields[val] = new_id[v[ok]] if val == "deps" else v[ok]
    t = s.tensors
    t.alloc_op = np.where(t.alloc_op >= 0, np.where(keep[t.alloc_op], new_id[t.alloc_op], -1), -1)
    owner = np.repeat(np.arange(len(t.rank)), np.diff(t.free_ptr))
    ok = keep[t.free_after]
    t.free_ptr, t.free_after = csr_ptr(np.bincount(owner[ok], minlength=len(t.rank))), new_id[t.free_after[ok]]
    return Schedule(s.algorithm, s.knobs, s.workload, s.n_ranks, s.n_chunks, s.device_of_rank, s.topology,
                    s.streams, OpTable(**fields), t)


def test_rejects_a_dropped_block():
    s = build(passes="fwd")
    comp = np.flatnonzero(s.ops.kind == COMPUTE)
    report = verify(drop_ops(s, comp[3:4]))
    assert not report.ok and any("never computed" in v for v in report.violations)


def test_rejects_a_duplicated_block():
    s = build(passes="fwd")
    o = s.ops
    a, b = np.flatnonzero((o.kind == COMPUTE) & (o.rank == 1))[:2]
    o.kv_chunks[o.kvc_ptr[b]] = o.kv_chunks[o.kvc_ptr[a]]        # op b now computes op a's block again
    report = verify(s)
    assert not report.ok
    assert any("computed twice" in v for v in report.violations)
    assert any("never computed" in v for v in report.violations)
    from meshplan.model.matrix import attn_matrix
    from meshplan.plan.verify import _coverage
    m = attn_matrix(s.workload, s.n_chunks)          # every op all heads: checked without merging runs, same lines
    assert _coverage(s, m, 0) == _coverage(s, m, 0, runs=True) and len(_coverage(s, m, 0)) >= 2


def test_two_ops_over_one_chunk_set_are_named_as_computed_twice():
    """Every op computes every head: two ops over the same chunks are found by the block check and then named by
    the merged runs of heads, as where heads are split."""
    s = build(passes="fwd")
    o = s.ops
    a, b = np.flatnonzero((o.kind == COMPUTE) & (o.rank == 1))[:2]
    for ptr, val in ((o.qc_ptr, o.q_chunks), (o.kvc_ptr, o.kv_chunks)):
        assert ptr[b + 1] - ptr[b] == ptr[a + 1] - ptr[a]
        val[ptr[b]:ptr[b + 1]] = val[ptr[a]:ptr[a + 1]]              # op b now computes op a's chunks again
    lines = verify(s).violations
    assert any(f"that op {a} computes over the same chunks (computed twice)" in v for v in lines), lines


def test_rejects_an_unmatched_send():
    s = build(passes="fwd")
    recv = np.flatnonzero(s.ops.kind == RECV)[0]
    report = verify(drop_ops(s, [recv]))
    assert not report.ok and any("no matching partner" in v for v in report.violations)


def test_rejects_mismatched_bytes():
    s = build(passes="fwd")
    recv = np.flatnonzero(s.ops.kind == RECV)[0]
    s.ops.size_bytes[recv] += 2
    assert any("receives" in v for v in verify(s).violations)


def test_rejects_a_tensor_of_the_wrong_size_and_a_wire_size_off_its_tensor():
    # both sides of a transfer grown alike (so they still match): the tensor check and the wire check both fire
    s = build(passes="fwd")
    t = s.ops.tensor[np.flatnonzero(s.ops.kind == RECV)[0]]
    s.tensors.size_bytes[t] += 8
    sends = np.flatnonzero((s.ops.kind == SEND) | (s.ops.kind == RECV))[:2]
    s.ops.size_bytes[sends] += 4
    got = verify(s).violations
    assert any(f"tensor {t} " in v and "the workload needs" in v for v in got)
    assert any("on the wire" in v for v in got)


def test_size_classes_pack_large_token_counts():
    from meshplan.plan.verify import _unique_rows

    rng = np.random.default_rng(0)
    cols = (rng.integers(0, 12, 500), rng.integers(0, 2**38, 500), rng.integers(1, 4000, 500), rng.integers(0, 8, 500))
    rows, inv = _unique_rows(*cols)
    assert (rows[inv] == np.stack(cols, axis=1)).all() and len(rows) == len({tuple(r) for r in np.stack(cols, 1)})


def test_rejects_a_missing_dependency_as_a_hazard():
    s = build(passes="fwd")
    o = s.ops
    owner = np.repeat(np.arange(len(o)), np.diff(o.dep_ptr))
    keep = o.kind[owner] != COMPUTE
    o.deps = o.deps[keep]
    o.dep_ptr = csr_ptr(np.bincount(owner[keep], minlength=len(o)))
    report = verify(s)
    assert not report.ok and any("still writes it" in v for v in report.violations)


def test_rejects_a_deadlock():
    """Two ranks that each send before they receive, unbatched (blocking sends), never finish."""
    s = build(n=2, passes="fwd")
    o = s.ops
    for r in (0, 1):
        mine = np.flatnonzero((o.rank == r) & ((o.kind == SEND) | (o.kind == RECV)))
        send, recv = mine[o.kind[mine] == SEND][0], mine[o.kind[mine] == RECV][0]
        assert send < recv
        o.step[send], o.step[recv] = 1, 0         # no longer one batch: the send must complete first
    rep = verify(s)
    assert not rep.ok and any("deadlock" in v for v in rep.violations)


def test_rejects_a_dependency_on_a_later_op():
    s = build(passes="fwd")
    o = s.ops
    k = np.flatnonzero(np.diff(o.dep_ptr) > 0)[0]
    o.deps[o.dep_ptr[k]] = k + 1
    assert any("not an earlier op" in v for v in verify(s).violations)


def test_memory_limit():
    s = build(n=8, passes="fwd", seq_len="64K")
    assert verify(s, memory_bytes=80e9).ok and verify(s).peak_memory_bytes > 1e6
    assert any("more than the device" in v for v in verify(s, memory_bytes=1e6).violations)


def test_head_ranges_of_ops_over_the_same_chunks_must_tile_the_heads():
    """USP's Ulysses members compute the same blocks for disjoint head ranges (merged by the coverage check into
    one run per chunk set): a range cut short leaves heads missing, a range stretched over its neighbour's computes
    them twice."""
    def usp():
        w, t, alg = resolve(passes="fwd", seq_len=256), Topology.load("cpu-local", gpus=4), get("usp")
        return alg.schedule(alg.plan(w, t, 4, alg.normalize({"ulysses_degree": 2})), t)

    s = usp()
    comp = np.flatnonzero((s.ops.kind == COMPUTE) & (s.ops.h0 > 0))
    assert verify(s).ok and len(comp)
    short = usp()
    short.ops.h0[comp[0]] += 1                               # its first head now computed by no one
    assert any("gap" in v or "covers heads" in v for v in verify(short).violations)
    wide = usp()
    wide.ops.h0[comp[0]] -= 1                                # reaches into the previous member's heads
    assert any("computed twice" in v for v in verify(wide).violations)


@pytest.mark.parametrize("fork", ["1", "0"])
def test_both_passes_checked_at_once_give_the_same_report(fork, monkeypatch):
    """verify(both_cores=True) checks the coverage, rows and the forward in a forked process (a thread without
    fork): the same violations in the same order, counts and peak — for a valid schedule, one with a hazard in both
    passes, one over a memory limit in both and one that computes a block twice (its passes checked, unreported)."""
    import meshplan.plan.verify as v

    monkeypatch.setenv("MESHPLAN_FORK", fork)
    monkeypatch.setattr(v, "PHASES_FORK_MIN_OPS", 0)
    hazard = build()
    o = hazard.ops
    owner = np.repeat(np.arange(len(o)), np.diff(o.dep_ptr))
    keep = o.kind[owner] != COMPUTE
    o.deps, o.dep_ptr = o.deps[keep], csr_ptr(np.bincount(owner[keep], minlength=len(o)))
    twice = build()                                 # a coverage violation: the passes' checks are not reported
    twice.ops.h0[np.flatnonzero(twice.ops.kind == COMPUTE)[1]] -= 1
    later = build()                                 # a structure violation: reported alone, the side stopped
    k = np.flatnonzero(np.diff(later.ops.dep_ptr) > 0)[0]
    later.ops.deps[later.ops.dep_ptr[k]] = k + 1
    split = build("ulysses", n=2)                   # a batch order violation, found by the side
    o = split.ops
    first = np.flatnonzero((o.rank == 0) & (o.phase == 0) & ((o.kind == SEND) | (o.kind == RECV)) & (o.step == 0))
    o.step[first[2:]] = 7
    for s, memory in ((build(), None), (hazard, None), (build(), 1e3), (twice, None), (later, None), (split, None)):
        one, two = verify(s, memory), verify(s, memory, both_cores=True)
        assert (one.violations, one.counts, one.peak_memory_bytes) == (two.violations, two.counts,
                                                                        two.peak_memory_bytes)
        assert two.ok == (memory is None and s is not hazard and s is not twice and s is not later and s is not split)
        assert ("batch order" in two.counts) == (s is split)
        assert ("coverage" in two.counts) == (s is twice)
        if memory is not None:                                    # one memory line from each pass, fwd first
            assert [x.split(" in ")[-1][:3] for x in two.violations if "GB of buffers" in x] == ["fwd", "bwd"]
