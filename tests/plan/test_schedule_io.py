"""Schedule JSON: round trip, the golden schema, schema-version and validation errors."""

from __future__ import annotations

import dataclasses
import gzip
import json
from pathlib import Path

import numpy as np
import pytest
from conftest import DATA

from meshplan.algorithms import get
from meshplan.core.errors import UserError
from meshplan.core.gzip_members import member_spans
from meshplan.model.topology import Topology
from meshplan.model.workload import resolve
from meshplan.plan.json.io import read_schedule, schema, to_json_dict, write_schedule
from meshplan.plan.verify import verify

OP_FIELDS = ("rank", "kind", "stream", "phase", "step", "peer", "tensor", "size_bytes", "dtype", "combine", "h0",
             "h1", "s_q", "s_kv", "mask", "deps", "dep_ptr", "inputs", "outputs", "q_chunks", "kv_chunks")
TENSOR_FIELDS = ("rank", "kind", "chunks", "chunk_ptr", "h0", "h1", "dtype", "role", "phase", "size_bytes",
                 "alloc_op", "free_ptr", "free_after")


def build(name, knobs=None, **kw):
    w = resolve(**({"seq_len": "8K"} | kw))
    t = Topology.load("h100x8", gpus=4)
    alg = get(name)
    return alg.schedule(alg.plan(w, t, 4, alg.normalize(knobs or {})), t)


@pytest.mark.parametrize("name", ["ring", "pass-q", "mesh"])
@pytest.mark.parametrize("suffix", [".json", ".json.gz"])
@pytest.mark.parametrize("kw", [{}, {"mask": "window:700", "layout": "striped", "valid_len": 8000}])
def test_round_trip(tmp_path, name, suffix, kw):
    s = build(name, {"tile": "2x2"} if name == "mesh" else None, **kw)
    path = write_schedule(s, tmp_path / f"s{suffix}")
    back = read_schedule(path)
    for f in OP_FIELDS:
        assert np.array_equal(getattr(s.ops, f), getattr(back.ops, f)), f
    for f in TENSOR_FIELDS:
        assert np.array_equal(getattr(s.tensors, f), getattr(back.tensors, f)), f
    np.testing.assert_allclose(back.ops.flops, s.ops.flops, rtol=1e-12)
    assert back.workload == s.workload and back.knobs == s.knobs and verify(back).ok


def test_skeleton_keys():
    d = to_json_dict(build("ring", passes="fwd"))
    for k in ("schema_version", "algorithm", "knobs", "workload", "topology", "device_of_rank", "tensors", "ranks"):
        assert k in d
    assert d["workload"]["permutation"] == {"name": "zigzag", "seed": 0}
    op = next(op for op in d["ranks"][1]["ops"] if op["kind"] == "compute")
    assert {"id", "kind", "stream", "deps", "q_chunks", "kv_chunks", "q_rows", "kv_cols", "mask", "heads",
            "combine", "inputs", "outputs"} <= set(op)
    comm = next(op for op in d["ranks"][1]["ops"] if op["kind"] == "send")
    assert {"peer", "tensor", "size_bytes", "dtype", "step"} <= set(comm)


def test_golden_schema():
    golden = json.loads((DATA / "schedule_schema.json").read_text())
    assert schema() == golden, ("the Schedule schema changed: bump SCHEMA_VERSION if files are no longer compatible, "
                                "then regenerate tests/data/schedule_schema.json")


def test_other_schema_version_is_refused(tmp_path):
    p = tmp_path / "old.json"
    p.write_text('{"schema_version": "0", "ranks": []}')
    with pytest.raises(UserError, match="schema_version"):
        read_schedule(p)


@pytest.mark.parametrize("edit,field", [
    (lambda d: d["ranks"][0]["ops"][0].update(kind="teleport"), "kind"),
    (lambda d: d["ranks"][0]["ops"][0].update(colour="red"), "colour"),
    (lambda d: d["ranks"][0]["ops"][0].update(stream="nope"), "stream"),
    (lambda d: d["tensors"][0].update(dtype="fp8"), "dtype"),
])
def test_invalid_files_give_one_line(tmp_path, edit, field):
    d = to_json_dict(build("ring", passes="fwd"))
    edit(d)
    p = tmp_path / "bad.json.gz"
    p.write_bytes(gzip.compress(json.dumps(d).encode()))
    with pytest.raises(UserError) as err:
        read_schedule(p)
    assert field in str(err.value) and "\n" not in str(err.value)


def test_garbage_file(tmp_path):
    p = tmp_path / "x.json"
    p.write_text("not json")
    with pytest.raises(UserError, match="cannot read"):
        read_schedule(p)


def test_gzip_members_beside_the_text_are_the_plain_file(tmp_path, monkeypatch):
    """The .gz writer compresses a member per batch of text in two threads: members smaller than a rank's text and
    one for the whole file give the plain file's bytes, to any gzip reader and to meshplan's, which finds the
    members by their headers and inflates them on two threads."""
    import meshplan.plan.json.io as io

    s = build("ring")
    plain = write_schedule(s, tmp_path / "s.json").read_bytes()
    for batch, members in ((1000, -(-len(plain) // 1000)), (1 << 30, 1)):
        monkeypatch.setattr(io, "COMPRESS_BATCH_BYTES", batch)
        data = write_schedule(s, tmp_path / f"s{batch}.json.gz").read_bytes()
        assert gzip.decompress(data) == plain == io.gunzip(data)
        assert len(member_spans(data)) == members


@pytest.mark.parametrize("fork", [False, True])
def test_a_gzip_file_inflated_as_it_is_read_is_the_plain_file(tmp_path, monkeypatch, fork):
    """A file of sized members is inflated as its parts are read (``MemberText``): the frame and tensors first,
    then each group of ranks by the process that reads it, cut at the first rank that starts in its first member.
    Members of 1 KB (a rank spans many: groups with no rank's start, read empty) and of 64 KB, groups of one member
    and of several, forked or not: the same Schedule as the plain file's, array by array."""
    import meshplan.plan.json.io as io
    import meshplan.plan.json.read_parts as rp

    monkeypatch.setattr(rp, "FORK_MIN_BYTES", 0 if fork else 1 << 40)
    monkeypatch.setattr(io, "_validate", lambda *a: pytest.fail("read whole, not a part at a time"))
    s = build("ring")
    plain = read_schedule(write_schedule(s, tmp_path / "s.json"))
    for batch, group in ((1000, 1000), (1000, 5000), (1 << 16, 1)):
        monkeypatch.setattr(io, "COMPRESS_BATCH_BYTES", batch)
        monkeypatch.setattr(rp, "RANK_GROUP_BYTES", group)
        back = read_schedule(write_schedule(s, tmp_path / f"s{batch}-{group}.json.gz"))
        for tab in ("ops", "tensors"):
            for f in dataclasses.fields(getattr(plain, tab)):
                a, b = getattr(getattr(plain, tab), f.name), getattr(getattr(back, tab), f.name)
                assert a.dtype == b.dtype and np.array_equal(a, b), (batch, group, tab, f.name)


def test_a_corrupted_or_foreign_gzip_file(tmp_path, monkeypatch):
    """A plain gzip stream (no member sizes) reads as before; a damaged member is one line naming the file."""
    import meshplan.plan.json.io as io

    monkeypatch.setattr(io, "COMPRESS_BATCH_BYTES", 1000)
    s = build("ring", passes="fwd")
    plain = write_schedule(s, tmp_path / "s.json").read_bytes()
    (tmp_path / "foreign.json.gz").write_bytes(gzip.compress(plain))
    assert len(read_schedule(tmp_path / "foreign.json.gz").ops) == len(s.ops)
    data = bytearray(write_schedule(s, tmp_path / "s.json.gz").read_bytes())
    assert len(member_spans(bytes(data))) > 1
    spans = member_spans(bytes(data))
    huge = bytearray(data)
    huge[spans[0][1] - 4:spans[0][1]] = (2**32 - 1).to_bytes(4, "little")     # a member stating 4 GB of text
    late = bytearray(data)
    late[(spans[-2][0] + spans[-2][1]) // 2] ^= 0xFF     # a member of the ranks, inflated only as they are read
    data[len(data) // 2] ^= 0xFF                         # inside the deflate data of a member
    for name, bad in (("bad.json.gz", data), ("huge.json.gz", huge), ("late.json.gz", late)):
        (tmp_path / name).write_bytes(bytes(bad))
        with pytest.raises(UserError) as err:
            read_schedule(tmp_path / name)
        assert name in str(err.value) and "\n" not in str(err.value)


def test_failed_write_leaves_nothing(tmp_path, monkeypatch):
    s = build("ring", passes="fwd")
    import meshplan.plan.json.io as io

    def boom(_):
        yield b'{"schema_version":'       # part of the file is written, then the disk fills up
        raise RuntimeError("disk full")
    monkeypatch.setattr(io, "json_chunks", boom)
    for name in ("s.json", "s.json.gz"):
        with pytest.raises(RuntimeError):
            write_schedule(s, tmp_path / name)
    assert list(Path(tmp_path).iterdir()) == []


@pytest.mark.parametrize("layout", ["zigzag", "striped", "contiguous"])
@pytest.mark.parametrize("tile", ["4x4", "2x8", "8x2"])
def test_mesh_multi_chunk_descriptors_round_trip(tmp_path, layout, tile):
    """Multi-chunk compute ops: the descriptors written equal those computed op by op."""
    w = resolve(seq_len="16K", layout=layout)
    t = Topology.load("h100x16")
    alg = get("mesh")
    plan = alg.plan(w, t, 16, alg.normalize({"tile": tile}))
    s = alg.schedule(plan, t)
    back = read_schedule(write_schedule(s, tmp_path / "m.json"))
    for f in ("s_q", "s_kv", "mask", "q_chunks", "kv_chunks"):
        assert np.array_equal(getattr(s.ops, f), getattr(back.ops, f)), f
    d = to_json_dict(s)
    multi = [op for r in d["ranks"] for op in r["ops"] if op["kind"] == "compute" and
             len(op["q_chunks"]) * len(op["kv_chunks"]) > 1]
    assert multi or tile == "2x8"        # with one remote row every group can be a single block
    _assert_descriptors_op_by_op(multi, plan.matrix)


def _assert_descriptors_op_by_op(ops: list[dict], matrix):
    """Every op's written q_rows, kv_cols and mask are :meth:`AttnMatrix.op_descriptor` of its own chunks (the
    writer makes them once per distinct chunk set: an op given another set's shows)."""
    refs = {}
    for op in ops:
        key = (tuple(op["q_chunks"]), tuple(op["kv_chunks"]))
        if key not in refs:
            refs[key] = matrix.op_descriptor(op["q_chunks"], op["kv_chunks"])
        ref = refs[key]
        assert (op["q_rows"], op["kv_cols"], op["mask"]) == (ref["q_rows"], ref["kv_cols"], ref["mask"])


@pytest.mark.parametrize("mask", ["causal", "window:3000", "docs:4992,3200,8192"])
def test_usp_ops_sharing_chunk_sets_are_written_with_their_own_descriptors(mask):
    """USP's compute ops span whole groups of chunks, the same sets on many ranks (its Ulysses groups'): each op's
    descriptor still is its own chunks'."""
    w = resolve(seq_len="16K", layout="zigzag", mask=mask)
    t = Topology.load("h100x16")
    alg = get("usp")
    plan = alg.plan(w, t, 16, alg.normalize({"ulysses_degree": 4}))
    d = to_json_dict(alg.schedule(plan, t))
    multi = [op for r in d["ranks"] for op in r["ops"] if op["kind"] == "compute" and
             len(op["q_chunks"]) * len(op["kv_chunks"]) > 1]
    sets = {(tuple(op["q_chunks"]), tuple(op["kv_chunks"])) for op in multi}
    assert len(multi) > 2 * len(sets)                       # sets shared among ops
    _assert_descriptors_op_by_op(multi, plan.matrix)


def _parts_equal_whole(path):
    """The file read a part at a time (read_parts) and read whole (read_document + from_json): every array equal."""
    from meshplan.plan.json.io import _read_raw, from_json, read_document
    from meshplan.plan.json.read_parts import read_in_parts

    parts = read_in_parts([_read_raw(Path(path))])
    assert parts is not None
    whole = from_json(read_document(path)[0])
    for f in OP_FIELDS + ("flops", "in_ptr", "out_ptr", "qc_ptr", "kvc_ptr"):
        a, b = getattr(parts.ops, f), getattr(whole.ops, f)
        assert a.dtype == b.dtype and np.array_equal(a, b), f
    for f in TENSOR_FIELDS:
        a, b = getattr(parts.tensors, f), getattr(whole.tensors, f)
        assert a.dtype == b.dtype and np.array_equal(a, b), f
    assert parts.workload == whole.workload and parts.knobs == whole.knobs
    return parts


@pytest.mark.parametrize("name,knobs,kw", [
    ("ring", None, {}), ("usp", {"ulysses_degree": "2"}, {}), ("mesh", {"tile": "2x2"}, {"layout": "striped"}),
    ("charm", {"domains": "2"}, {}), ("startrail", None, {"mask": "docs:3000,5192"}),
])
def test_a_file_meshplan_wrote_is_read_a_part_at_a_time(tmp_path, name, knobs, kw, monkeypatch):
    """What meshplan writes is read rank by rank and tensors in batches (the whole-document reader never runs)
    into exactly the arrays the whole-document reader makes, FLOPs included."""
    import meshplan.plan.json.io as io
    import meshplan.plan.json.read_parts as rp

    s = build(name, knobs, **kw)
    path = write_schedule(s, tmp_path / "s.json.gz")
    monkeypatch.setattr(rp, "TENSOR_BATCH_BYTES", 2000)               # several batches
    monkeypatch.setattr(rp, "FORK_MIN_BYTES", 0 if name in ("usp", "mesh") else 1 << 40)     # forked, or not
    back = _parts_equal_whole(path)
    np.testing.assert_allclose(back.ops.flops, s.ops.flops, rtol=1e-12)

    def whole(*a):
        raise AssertionError("read whole")

    monkeypatch.setattr(io, "_validate", whole)
    assert len(read_schedule(path).ops) == len(s.ops)


def test_a_file_laid_out_otherwise_is_read_whole(tmp_path):
    """Indented JSON, op ids renumbered: not meshplan's layout, read whole, the same schedule."""
    s = build("ring", passes="fwd")
    d = to_json_dict(s)
    ids = {op["id"]: 10 * op["id"] + 7 for r in d["ranks"] for op in r["ops"]}
    for r in d["ranks"]:
        for op in r["ops"]:
            op["id"], op["deps"] = ids[op["id"]], [ids[x] for x in op["deps"]]
    for t in d["tensors"]:
        t["alloc_op"] = None if t["alloc_op"] is None else ids[t["alloc_op"]]
        t["free_after"] = [ids[x] for x in t["free_after"]]
    p = tmp_path / "pretty.json"
    p.write_text(json.dumps(d, indent=1))
    back = read_schedule(p)
    for f in OP_FIELDS:
        assert np.array_equal(getattr(s.ops, f), getattr(back.ops, f)), f
    for f in TENSOR_FIELDS:
        assert np.array_equal(getattr(s.tensors, f), getattr(back.tensors, f)), f
    compact = tmp_path / "compact.json"                   # renumbered but compact: read a part at a time
    compact.write_text(json.dumps(d, separators=(",", ":")))
    assert np.array_equal(_parts_equal_whole(compact).ops.deps, s.ops.deps)


@pytest.mark.parametrize("edit,field", [
    (lambda d: d["ranks"][2]["ops"][3].update(peer="x"), "ranks.2.ops.3"),
    (lambda d: d["ranks"][1]["ops"][0].update(stream="nope"), "stream"),
    (lambda d: d["tensors"][5].update(size_bytes=-1), "tensors.5.size_bytes"),
    (lambda d: d["ranks"].pop(), "ranks"),
    (lambda d: d["ranks"][3].update(rank=2), "ranks"),
])
def test_a_bad_part_is_reported_as_the_whole_file_would_be(tmp_path, edit, field):
    d = to_json_dict(build("ring", passes="fwd"))
    edit(d)
    p = tmp_path / "bad.json"
    p.write_text(json.dumps(d, separators=(",", ":")))
    with pytest.raises(UserError) as err:
        read_schedule(p)
    assert field in str(err.value) and "\n" not in str(err.value)
