"""Assemble a ScheduleBuilder's blocks of ops and tensors into the compact Schedule arrays."""

from __future__ import annotations

from typing import Any

import numpy as np

from meshplan.csr import csr_ptr, csr_take
from meshplan.schedule import OpTable, Schedule, TensorTable

_SCALARS = {  # op field -> (dtype, default)
    "step": (np.int32, -1), "peer": (np.int32, -1), "tensor": (np.int64, -1), "size_bytes": (np.int64, 0),
    "dtype": (np.int8, -1), "combine": (np.int8, -1), "h0": (np.int32, 0), "h1": (np.int32, 0),
    "flops": (np.float64, 0.0), "s_q": (np.int64, 0), "s_kv": (np.int64, 0), "mask": (np.int8, 0),
}
_LISTS = {"deps": "dep_ptr", "inputs": "in_ptr", "outputs": "out_ptr", "q_chunks": "qc_ptr", "kv_chunks": "kvc_ptr"}


def _scalar(blocks: list[dict], name: str, dtype, default) -> np.ndarray:
    values = [b.get(name, default) for b in blocks]
    lengths = [len(b["rank"]) for b in blocks]
    if all(np.ndim(v) == 0 for v in values):
        return np.repeat(np.asarray(values, dtype=dtype), lengths)
    parts = [np.full(k, v, dtype=dtype) if np.ndim(v) == 0 else np.asarray(v, dtype=dtype)
             for v, k in zip(values, lengths)]
    return np.concatenate(parts) if parts else np.zeros(0, dtype=dtype)


def _ragged(blocks: list[dict], name: str) -> tuple[np.ndarray, np.ndarray]:
    """Concatenate per-block [k, m] arrays (−1 = empty slot) into CSR (ptr, values)."""
    counts, values = [], []
    for b in blocks:
        k = len(b["rank"])
        arr = np.asarray(b.get(name, np.full((k, 0), -1)), dtype=np.int64).reshape(k, -1)
        keep = arr >= 0
        counts.append(keep.sum(axis=1))
        values.append(arr[keep])
    cat = lambda xs: np.concatenate(xs) if xs else np.zeros(0, dtype=np.int64)  # noqa: E731
    return csr_ptr(cat(counts)), cat(values)


def assemble(builder, topology: dict[str, Any]) -> Schedule:
    """Build the Schedule: stable-sort ops by rank, remap op ids in deps, allocs and frees."""
    blocks = builder._ops
    rank = _scalar(blocks, "rank", np.int64, 0)
    order = np.argsort(rank, kind="stable")
    new_id = np.empty(len(order), dtype=np.int64)
    new_id[order] = np.arange(len(order))
    fields: dict[str, np.ndarray] = {"rank": rank[order]}
    for name in ("kind", "stream", "phase"):
        fields[name] = _scalar(blocks, name, np.int8 if name != "stream" else np.int16, 0)[order]
    for name, (dtype, default) in _SCALARS.items():
        fields[name] = _scalar(blocks, name, dtype, default)[order]
    for name, ptr_name in _LISTS.items():
        ptr, values = _ragged(blocks, name)
        ptr, values = csr_take(ptr, values, order)
        fields[ptr_name], fields[name] = ptr, (new_id[values] if name == "deps" else values)
    ops = OpTable(**fields)
    tensors = _tensors(builder, new_id)
    return Schedule(algorithm=builder.algorithm, knobs=builder.knobs, workload=builder.w, n_ranks=builder.n,
                    n_chunks=builder.m.n, device_of_rank=builder.device_of_rank, topology=topology,
                    streams=builder.streams, ops=ops, tensors=tensors)


def _tensors(builder, new_id: np.ndarray) -> TensorTable:
    blocks = builder._tensors
    n = builder._n_tensors
    rank = np.concatenate([b["rank"] for b in blocks]) if blocks else np.zeros(0, dtype=np.int64)
    rep = lambda key, dt: np.concatenate(  # noqa: E731
        [np.full(len(b["rank"]), b[key], dtype=dt) for b in blocks]) if blocks else np.zeros(0, dtype=dt)
    chunk_ptr, chunks = _ragged([dict(rank=b["rank"], c=b["chunks"]) for b in blocks], "c")
    alloc = np.full(n, -1, dtype=np.int64)
    for t, o in builder._alloc:
        alloc[t] = new_id[o]
    if builder._free:
        t = np.concatenate([f[0] for f in builder._free]).astype(np.int64)
        o = new_id[np.concatenate([f[1] for f in builder._free]).astype(np.int64)]
        srt = np.lexsort((o, t))
        free_ptr, free_after = csr_ptr(np.bincount(t, minlength=n)), o[srt]
    else:
        free_ptr, free_after = np.zeros(n + 1, dtype=np.int64), np.zeros(0, dtype=np.int64)
    return TensorTable(rank=rank, kind=rep("kind_code", np.int8),
                       chunk_ptr=chunk_ptr, chunks=chunks, h0=rep("h0", np.int32), h1=rep("h1", np.int32),
                       dtype=rep("dtype", np.int8), role=rep("role", np.int8), phase=rep("phase", np.int8),
                       size_bytes=rep("size", np.int64), alloc_op=alloc, free_ptr=free_ptr, free_after=free_after)
