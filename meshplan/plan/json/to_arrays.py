"""Convert a validated Schedule document into the compact arrays (ids remapped to indices)."""

from __future__ import annotations

import numpy as np

from meshplan.core.csr import csr_ptr
from meshplan.core.errors import UserError
from meshplan.model.matrix import AttnMatrix
from meshplan.model.workload import Workload
from meshplan.plan.json.format import ScheduleJSON
from meshplan.plan.schedule import (
    COMBINES,
    DTYPES,
    KIND,
    MASKS,
    PASS_NAMES,
    ROLES,
    TENSOR_KIND_NAMES,
    OpTable,
    Streams,
    TensorTable,
)

_LISTS = ("deps", "inputs", "outputs", "q_chunks", "kv_chunks")
_PTRS = {"deps": "dep_ptr", "inputs": "in_ptr", "outputs": "out_ptr", "q_chunks": "qc_ptr", "kv_chunks": "kvc_ptr"}


def _fail(field: str, problem: str) -> UserError:
    return UserError(field, problem, "fix the file or regenerate it")


def op_table(doc: ScheduleJSON, streams: Streams, m: AttnMatrix, w: Workload) -> OpTable:
    """Op arrays in rank/program order (column-wise); ``id_map`` (JSON id -> index) is attached."""
    ops = [op for r in doc.ranks for op in r.ops]
    n = len(ops)
    id_map = {op.id: i for i, op in enumerate(ops)}
    if len(id_map) != n:
        raise _fail("ranks[*].ops[*].id", "op ids must be unique")
    stream_idx = {name: i for i, name in enumerate(streams.names)}
    unknown = next((op for op in ops if op.stream not in stream_idx), None)
    if unknown is not None:
        raise _fail(f"op {unknown.id}.stream", f"unknown stream {unknown.stream!r}")
    kinds = [op.kind for op in ops]
    a = {
        "rank": np.repeat(np.arange(len(doc.ranks)), [len(r.ops) for r in doc.ranks]),
        "kind": np.fromiter((KIND[k] for k in kinds), dtype=np.int8, count=n),
        "stream": np.fromiter((stream_idx[op.stream] for op in ops), dtype=np.int16, count=n),
        "phase": np.fromiter((op.pass_ == "bwd" for op in ops), dtype=np.int8, count=n),
    }
    for name, dt, default in (("step", np.int32, -1), ("peer", np.int32, -1), ("tensor", np.int64, -1),
                              ("size_bytes", np.int64, 0), ("dtype", np.int8, -1), ("combine", np.int8, -1),
                              ("h0", np.int32, 0), ("h1", np.int32, 0), ("s_q", np.int64, 0), ("s_kv", np.int64, 0),
                              ("mask", np.int8, 0), ("flops", np.float64, 0.0)):
        a[name] = np.full(n, default, dtype=dt)
    comm = [i for i, k in enumerate(kinds) if k in ("send", "recv")]
    sub = [ops[i] for i in comm]
    a["peer"][comm] = [op.peer for op in sub]
    a["tensor"][comm] = [op.tensor for op in sub]
    a["size_bytes"][comm] = [op.size_bytes for op in sub]
    a["dtype"][comm] = [DTYPES.index(op.dtype) for op in sub]
    a["step"][comm] = [-1 if op.step is None else op.step for op in sub]
    side = [i for i, k in enumerate(kinds) if k in ("merge", "accumulate")]
    a["size_bytes"][side] = [ops[i].size_bytes for i in side]
    for i, k in enumerate(kinds):
        if k == "compute":
            _compute_fields(ops[i], i, a, m, w)
    has = {"deps": None, "inputs": ("compute", "merge", "accumulate"), "outputs": ("compute", "merge", "accumulate"),
           "q_chunks": ("compute",), "kv_chunks": ("compute",)}
    for name in _LISTS:
        rows = [op.deps for op in ops] if has[name] is None else \
            [getattr(op, name) if k in has[name] else op.parts if name == "inputs" and k == "send" else ()
             for op, k in zip(ops, kinds)]
        a[_PTRS[name]] = csr_ptr(np.fromiter(map(len, rows), dtype=np.int64, count=n))
        flat = [x for row in rows for x in row]
        if name == "deps":
            try:
                flat = [id_map[d] for d in flat]
            except KeyError as err:
                raise _fail("deps", f"op id {err.args[0]} does not exist") from None
        a[name] = np.asarray(flat, dtype=np.int64)
    a["combine"], a["mask"] = a["combine"].astype(np.int8), a["mask"].astype(np.int8)
    table = OpTable(**a)
    table.id_map = id_map
    return table


def _compute_fields(op, i: int, a: dict, m: AttnMatrix, w: Workload) -> None:
    h0, h1 = op.heads
    if not 0 <= h0 < h1 <= w.n_heads:
        raise _fail(f"op {op.id}.heads", f"[{h0}, {h1}) is not a head range within 0..{w.n_heads}")
    if not all(c < m.n for c in op.q_chunks + op.kv_chunks):
        raise _fail(f"op {op.id}", f"chunk ids must be below n_chunks = {m.n}")
    flops = m.flops(op.pass_, h1 - h0)
    a["h0"][i], a["h1"][i] = h0, h1
    a["combine"][i], a["mask"][i] = COMBINES.index(op.combine), MASKS.index(op.mask)
    a["flops"][i] = float(sum(flops[q, k] for q in op.q_chunks for k in op.kv_chunks))
    a["s_q"][i] = sum(b - x for x, b in op.q_rows)
    a["s_kv"][i] = sum(b - x for x, b in op.kv_cols)


def tensor_table(doc: ScheduleJSON, id_map: dict[int, int]) -> TensorTable:
    """Tensor arrays; tensors must be listed with ids 0, 1, 2, ... in order."""
    ts = doc.tensors
    if [t.id for t in ts] != list(range(len(ts))):
        raise _fail("tensors", "tensor ids must be 0, 1, 2, ... in order")
    bad = [t.id for t in ts if (t.alloc_op is not None and t.alloc_op not in id_map)
           or any(f not in id_map for f in t.free_after)]
    if bad:
        raise _fail(f"tensors[{bad[0]}]", "alloc_op/free_after name an op that does not exist")
    bad = [t.id for t in ts if t.rank >= doc.n_ranks or any(c >= doc.n_chunks for c in t.chunks)]
    if bad:
        raise _fail(f"tensors[{bad[0]}]", f"its rank or chunks are out of range (n_ranks {doc.n_ranks}, n_chunks "
                    f"{doc.n_chunks})")
    arr = lambda f, dt=np.int64: np.asarray([f(t) for t in ts], dtype=dt)  # noqa: E731
    return TensorTable(
        rank=arr(lambda t: t.rank), kind=arr(lambda t: TENSOR_KIND_NAMES.index(t.kind), np.int8),
        chunk_ptr=csr_ptr(arr(lambda t: len(t.chunks))),
        chunks=np.asarray([c for t in ts for c in t.chunks], dtype=np.int64),
        h0=arr(lambda t: t.heads[0], np.int32), h1=arr(lambda t: t.heads[1], np.int32),
        dtype=arr(lambda t: DTYPES.index(t.dtype), np.int8), role=arr(lambda t: ROLES.index(t.role), np.int8),
        phase=arr(lambda t: PASS_NAMES.index(t.pass_), np.int8), size_bytes=arr(lambda t: t.size_bytes),
        alloc_op=arr(lambda t: -1 if t.alloc_op is None else id_map[t.alloc_op]),
        free_ptr=csr_ptr(arr(lambda t: len(t.free_after))),
        free_after=np.asarray([id_map[f] for t in ts for f in t.free_after], dtype=np.int64))
