"""The columns of ops and tensors read by :mod:`meshplan.plan.json.skeleton`: the arrays, dtypes and checks that
:class:`~meshplan.plan.json.to_arrays.OpColumns` and :class:`~meshplan.plan.json.to_arrays.TensorColumns` make of
pydantic's objects — or None where those would raise, so the caller reads the part with pydantic and its error
names the field.
"""

from __future__ import annotations

import re

import numpy as np
from pydantic import TypeAdapter

from meshplan.plan.json.format import Op, TensorJSON
from meshplan.plan.json.skeleton import ID_MAX, INT32_MAX, Reader, Records
from meshplan.plan.schedule import COMBINES, DTYPES, KIND, MASKS, PASS_NAMES, ROLES, TENSOR_KIND_NAMES

#: each number field's bound by its type in :mod:`meshplan.plan.json.format` (``Id``, ``Int32``)
OP_BOUNDS = {"id": ID_MAX, "deps": ID_MAX, "peer": INT32_MAX, "tensor": ID_MAX, "parts": ID_MAX,
             "size_bytes": ID_MAX, "step": INT32_MAX, "q_chunks": ID_MAX, "kv_chunks": ID_MAX, "heads": INT32_MAX,
             "q_rows": ID_MAX, "kv_cols": ID_MAX, "inputs": ID_MAX, "outputs": ID_MAX}
TENSOR_BOUNDS = {"id": ID_MAX, "rank": ID_MAX, "chunks": ID_MAX, "heads": ID_MAX, "size_bytes": ID_MAX,
                 "alloc_op": ID_MAX, "free_after": ID_MAX}
_RANK_HEAD = re.compile(rb'\{"rank":(0|[1-9][0-9]{0,18}),"ops":\[')


def op_reader() -> Reader:
    """A reader of a file's ops."""
    return Reader(TypeAdapter(Op), OP_BOUNDS, ("flops",))


def tensor_reader() -> Reader:
    """A reader of a file's tensors."""
    return Reader(TypeAdapter(TensorJSON), TENSOR_BOUNDS)


def rank_columns(reader: Reader, texts: list[bytes], stream_idx: dict[str, int], n_heads: int,
                 n_chunks: int) -> tuple[dict[str, np.ndarray], list[int]] | None:
    """(the op columns of consecutive ranks' ``{"rank":K,"ops":[...]}`` texts, the K they state — each op's rank),
    or None."""
    bodies, listed = [], []
    for text in texts:
        m = _RANK_HEAD.match(text)
        if m is None or text[-2:] != b"]}" or int(m.group(1)) > ID_MAX:
            return None
        bodies.append(memoryview(text)[m.end():-2])     # no copy: joined by the reader
        listed.append(int(m.group(1)))
    got = reader.records(bodies)
    if got is None:
        return None
    recs, counts = got
    rank = np.repeat(np.asarray(listed, dtype=np.int64), counts)
    cols = op_columns(recs, rank, stream_idx, n_heads, n_chunks)
    return None if cols is None else (cols, listed)


def op_columns(recs: Records, rank: np.ndarray, stream_idx: dict[str, int], n_heads: int,
               n_chunks: int) -> dict[str, np.ndarray] | None:
    """The columns :meth:`OpColumns._columns <meshplan.plan.json.to_arrays.OpColumns>` makes of the same ops (rank
    ``rank[i]`` for op i), or None where it raises (an unknown stream, a head range or chunk id out of range)."""
    t = [tp.record for tp in recs.templates]
    if any(r["stream"] not in stream_idx for r in t):
        return None
    n = len(recs)
    comm = [r["kind"] in ("send", "recv") for r in t]
    work = [r["kind"] == "compute" for r in t]

    def per(values: list, dtype) -> np.ndarray:
        return np.asarray(values, dtype=dtype).reshape(-1)[recs.code] if t else np.zeros(0, dtype=dtype)

    a = {"id": _scalar(recs, "id", n, np.int64, -1), "rank": rank,
         "kind": per([KIND[r["kind"]] for r in t], np.int8),
         "stream": per([stream_idx[r["stream"]] for r in t], np.int16),
         "phase": per([r["pass"] == "bwd" for r in t], np.int8),
         "step": _scalar(recs, "step", n, np.int32, -1), "peer": _scalar(recs, "peer", n, np.int32, -1),
         "tensor": _scalar(recs, "tensor", n, np.int64, -1), "size_bytes": _scalar(recs, "size_bytes", n, np.int64, 0),
         "dtype": per([DTYPES.index(r["dtype"]) if c else -1 for r, c in zip(t, comm)], np.int8),
         "combine": per([COMBINES.index(r["combine"]) if c else -1 for r, c in zip(t, work)], np.int8),
         "h0": _scalar(recs, "heads.0", n, np.int32, 0), "h1": _scalar(recs, "heads.1", n, np.int32, 0),
         "s_q": _widths(recs, "q_rows"), "s_kv": _widths(recs, "kv_cols"),
         "mask": per([MASKS.index(r["mask"]) if c else 0 for r, c in zip(t, work)], np.int8)}
    for name, fields in (("deps", ("deps",)), ("inputs", ("inputs", "parts")), ("outputs", ("outputs",)),
                         ("q_chunks", ("q_chunks",)), ("kv_chunks", ("kv_chunks",))):
        a["n_" + name], a[name] = _list(recs, fields)
    computes = per(work, bool)
    bad_heads = computes & ~((a["h0"] >= 0) & (a["h0"] < a["h1"]) & (a["h1"] <= n_heads))
    if bad_heads.any() or (a["q_chunks"] >= n_chunks).any() or (a["kv_chunks"] >= n_chunks).any():
        return None
    return a


def tensor_columns(recs: Records, first_id: int) -> dict[str, np.ndarray] | None:
    """The columns :meth:`TensorColumns.add <meshplan.plan.json.to_arrays.TensorColumns.add>` makes of the same
    tensors (ids from ``first_id``), or None where it raises (ids not the next in order) or would not hold them
    (head ranges beyond int32)."""
    n = len(recs)
    t = [tp.record for tp in recs.templates]

    def per(values: list, dtype) -> np.ndarray:
        return np.asarray(values, dtype=dtype).reshape(-1)[recs.code] if t else np.zeros(0, dtype=dtype)

    ids = _scalar(recs, "id", n, np.int64, -1)
    h0, h1 = _scalar(recs, "heads.0", n, np.int64, 0), _scalar(recs, "heads.1", n, np.int64, 0)
    if not np.array_equal(ids, np.arange(first_id, first_id + n)) or (h1 > INT32_MAX).any() or \
            (h0 > INT32_MAX).any():
        return None
    chunk_n, chunks = _list(recs, ("chunks",))
    free_n, free_after = _list(recs, ("free_after",))
    return {"rank": _scalar(recs, "rank", n, np.int64, -1),
            "kind": per([TENSOR_KIND_NAMES.index(r["kind"]) for r in t], np.int8), "chunk_n": chunk_n,
            "chunks": chunks, "h0": h0.astype(np.int32), "h1": h1.astype(np.int32),
            "dtype": per([DTYPES.index(r["dtype"]) for r in t], np.int8),
            "role": per([ROLES.index(r["role"]) for r in t], np.int8),
            "phase": per([PASS_NAMES.index(r["pass"]) for r in t], np.int8),
            "size_bytes": _scalar(recs, "size_bytes", n, np.int64, 0),
            "alloc_op": _scalar(recs, "alloc_op", n, np.int64, -1),
            "alloc_given": per([r["alloc_op"] is not None for r in t], bool), "free_n": free_n,
            "free_after": free_after}


def _scalar(recs: Records, name: str, n: int, dtype, default: int) -> np.ndarray:
    """[n] each record's number of field ``name`` (``default`` where it has none)."""
    out = np.full(n, default, dtype=dtype)
    rec, value = recs.take(name)
    out[rec] = value
    return out


def _list(recs: Records, fields: tuple[str, ...]) -> tuple[np.ndarray, np.ndarray]:
    """([n] how many numbers each record lists in ``fields``, those numbers in order) as int64."""
    count, value = recs.listed(*fields)
    return count, value.astype(np.int64)


def _widths(recs: Records, name: str) -> np.ndarray:
    """[n] each record's summed ``end − start`` over its ``[start, end)`` pairs of field ``name``: the differences'
    running sum (int64, wrapping as a sum in any order does) at each record's last pair less at its first."""
    count, start = recs.listed(name + ".0")
    _, end = recs.listed(name + ".1")
    total = np.concatenate([[0], np.cumsum(end.astype(np.int64) - start.astype(np.int64))])
    upto = np.concatenate([[0], np.cumsum(count)])
    return total[upto[1:]] - total[upto[:-1]]
