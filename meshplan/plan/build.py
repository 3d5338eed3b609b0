"""Building schedules: :class:`ScheduleBuilder` (what algorithms call, one op per rank per call) and
:func:`assemble`, which turns its blocks of ops and tensors into the compact Schedule arrays."""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from meshplan.core.csr import csr_ptr, csr_take
from meshplan.model.matrix import AttnMatrix
from meshplan.model.workload import Workload
from meshplan.plan.quotient import QuotientCheck
from meshplan.plan.quotient_assemble import assemble_quotient
from meshplan.plan.schedule import (
    COMBINES,
    DTYPES,
    KIND,
    MASKS,
    PASS_NAMES,
    ROLES,
    TENSOR_KIND_NAMES,
    OpTable,
    Schedule,
    Streams,
    TensorTable,
    _one_or_each,
    tensor_bytes,
)

_SCALARS = {  # op field -> (dtype, default)
    "step": (np.int32, -1), "peer": (np.int32, -1), "tensor": (np.int64, -1), "size_bytes": (np.int64, 0),
    "dtype": (np.int8, -1), "combine": (np.int8, -1), "h0": (np.int32, 0), "h1": (np.int32, 0),
    "flops": (np.float64, 0.0), "s_q": (np.int64, 0), "s_kv": (np.int64, 0), "mask": (np.int8, 0),
}
_LISTS = {"deps": "dep_ptr", "inputs": "in_ptr", "outputs": "out_ptr", "q_chunks": "qc_ptr", "kv_chunks": "kvc_ptr"}


#: a list field is assembled as a dense [ops, width] table (rows gathered in rank order at once) at width 1, and up
#: to this width when at least half its slots are filled (measured: faster than CSR rows reordered there, slower
#: beyond)
DENSE_MAX_WIDTH = 2


def _scalar(blocks: list[dict], name: str, dtype, default, lengths: list[int], starts: np.ndarray,
            order: np.ndarray | None = None, block_of: np.ndarray | None = None) -> np.ndarray:
    """One field of every block's ops, concatenated in block order — or, with ``order``, gathered in that order
    (``block_of``: each position's block in that order, ``order``'s blocks: a field that is one scalar per block is
    read from a table of the blocks, not repeated and then gathered). A block holds a scalar (all its ops) or an
    array [k]; array blocks are copied into their slices, the scalars filled by one repeat (no array per block)."""
    values = [b.get(name, default) for b in blocks]
    arrays = [i for i, v in enumerate(values) if isinstance(v, (np.ndarray, list, tuple)) and np.ndim(v)]
    if not arrays:
        table = np.asarray(values, dtype=dtype)
        return table[block_of] if block_of is not None else np.repeat(table, lengths)
    for i in arrays:
        values[i] = default
    out = np.repeat(np.asarray(values, dtype=dtype), lengths)
    for i in arrays:
        out[starts[i]:starts[i + 1]] = blocks[i][name]
    return out if order is None else out[order]


def _ragged(blocks: list[dict], name: str, lengths: list[int], starts: np.ndarray,
            order: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Per-block [k, m] arrays (−1 = empty slot) as CSR (ptr, values), rows in block order or, with ``order``, in
    that order. Up to :data:`DENSE_MAX_WIDTH` slots the blocks are copied into one [ops, width] table padded with −1
    whose rows are gathered at once; wider, every block is flattened and joined once, each op's row counted by one
    reduction, and the rows reordered as CSR."""
    flat, widths = [], []
    for b, k in zip(blocks, lengths):
        v = b.get(name)
        arr = np.zeros(0, dtype=np.int64) if v is None else np.asarray(v, dtype=np.int64).ravel()
        flat.append(arr)
        widths.append(len(arr) // k if k else 0)
    n_ops = int(starts[-1])
    width = max(widths, default=0)
    if n_ops == 0 or width == 0:
        return np.zeros(n_ops + 1, dtype=np.int64), np.zeros(0, dtype=np.int64)
    if width == 1 or (width <= DENSE_MAX_WIDTH and n_ops * width <= 2 * sum(len(a) for a in flat)):
        dense = np.full((n_ops, width), -1, dtype=np.int64)
        for i, (arr, w) in enumerate(zip(flat, widths)):
            if w:
                dense[starts[i]:starts[i + 1], :w] = arr.reshape(-1, w)
        if order is not None:
            dense = dense[order]
        keep = dense >= 0
        return csr_ptr(keep.sum(axis=1)), dense[keep]
    values = np.concatenate(flat)
    per_op = np.repeat(np.asarray(widths, dtype=np.int64), lengths)              # [n_ops] slots per op
    keep = values >= 0
    row_end = np.cumsum(per_op)
    kept = np.concatenate([[0], np.cumsum(keep)])
    ptr, values = csr_ptr(kept[row_end] - kept[row_end - per_op]), values[keep]
    return (ptr, values) if order is None else csr_take(ptr, values, order)


def _starts(lengths: list[int]) -> np.ndarray:
    """[blocks + 1] where each block's ops (or tensors) begin in the concatenation."""
    return csr_ptr(np.asarray(lengths, dtype=np.int64))


def assemble(builder, topology: dict[str, Any]) -> Schedule:
    """Build the Schedule: stable-sort ops by rank, remap op ids in deps, allocs and frees."""
    blocks = builder._ops
    lengths = [len(b["rank"]) for b in blocks]
    starts = _starts(lengths)
    rank = _scalar(blocks, "rank", np.int64, 0, lengths, starts)
    order = np.argsort(rank, kind="stable")
    new_id = np.empty(len(order), dtype=np.int64)
    new_id[order] = np.arange(len(order))
    block_of = np.repeat(np.arange(len(blocks), dtype=np.int32), lengths)[order]
    fields: dict[str, np.ndarray] = {"rank": rank[order]}
    for name in ("kind", "stream", "phase"):
        fields[name] = _scalar(blocks, name, np.int8 if name != "stream" else np.int16, 0, lengths, starts, order,
                               block_of)
    for name, (dtype, default) in _SCALARS.items():
        fields[name] = _scalar(blocks, name, dtype, default, lengths, starts, order, block_of)
    for name, ptr_name in _LISTS.items():
        ptr, values = _ragged(blocks, name, lengths, starts, order)
        fields[ptr_name], fields[name] = ptr, (new_id[values] if name == "deps" else values)
    ops = OpTable(**fields)
    tensors = _tensors(builder, new_id)
    return Schedule(algorithm=builder.algorithm, knobs=builder.knobs, workload=builder.w, n_ranks=builder.n,
                    n_chunks=builder.m.n, device_of_rank=builder.device_of_rank, topology=topology,
                    streams=builder.streams, ops=ops, tensors=tensors)


def _tensors(builder, new_id: np.ndarray) -> TensorTable:
    blocks = builder._tensors
    n = builder._n_tensors
    lengths = [len(b["rank"]) for b in blocks]
    starts = _starts(lengths)
    col = lambda key, dt: _scalar(blocks, key, dt, 0, lengths, starts)  # noqa: E731
    rank = np.concatenate([b["rank"] for b in blocks]) if blocks else np.zeros(0, dtype=np.int64)
    chunk_ptr, chunks = _ragged(blocks, "chunks", lengths, starts)
    alloc = np.full(n, -1, dtype=np.int64)
    for t, o in builder._alloc:
        alloc[t] = new_id[o]
    if builder._free:
        t = np.concatenate([f[0] for f in builder._free]).astype(np.int64)
        o = new_id[np.concatenate([f[1] for f in builder._free]).astype(np.int64)]
        srt = np.argsort(t * (len(new_id) + 1) + o)           # by tensor, then op (one int64 key: no lexsort)
        free_ptr, free_after = csr_ptr(np.bincount(t, minlength=n)), o[srt]
    else:
        free_ptr, free_after = np.zeros(n + 1, dtype=np.int64), np.zeros(0, dtype=np.int64)
    return TensorTable(rank=rank, kind=col("kind_code", np.int8),
                       chunk_ptr=chunk_ptr, chunks=chunks, h0=col("h0", np.int32), h1=col("h1", np.int32),
                       dtype=col("dtype", np.int8), role=col("role", np.int8), phase=col("phase", np.int8),
                       size_bytes=col("size", np.int64), alloc_op=alloc, free_ptr=free_ptr, free_after=free_after)


class ScheduleBuilder:
    """Vectorised construction of a Schedule: each call adds one op per element of ``ranks``.

    Ops are appended in program order per rank (calls in the order each rank runs them); ids are
    assigned at :meth:`build` after a stable sort by rank. Deps and ``free_after`` refer to the ids
    returned by earlier calls. Tensor sizes come from :func:`tensor_bytes`.
    """

    def __init__(self, workload: Workload, matrix: AttnMatrix, n_ranks: int, *, algorithm: str,
                 knobs: dict[str, Any], device_of_rank: Sequence[int] | None = None,
                 quotient: QuotientCheck | None = None) -> None:
        self.w, self.m, self.n = workload, matrix, n_ranks
        self.q = quotient          # a quotient build (meshplan.plan.quotient): only the representatives' ops kept
        self.algorithm, self.knobs = algorithm, dict(knobs)
        self.device_of_rank = np.arange(n_ranks) if device_of_rank is None else np.asarray(device_of_rank)
        self.streams = Streams()
        self._ops: list[dict[str, Any]] = []
        self._tensors: list[dict[str, Any]] = []
        self._n_ops = self._n_tensors = 0
        self._free: list[tuple[np.ndarray, np.ndarray]] = []
        self._alloc: list[tuple[np.ndarray, np.ndarray]] = []
        self._tensor_starts: list[int] = []
        self._starts_array = np.zeros(0, dtype=np.int64)      # _tensor_starts as an array, for searchsorted
        self.phase = 0

    # ------------------------------------------------------------------ streams and tensors
    def stream(self, name: str, kind: str) -> None:
        """Declare a stream (``compute`` or ``comm``)."""
        self.streams.add(name, kind)

    def tensor(self, ranks, kind: str, chunks, *, dtype: str | None = None, role: str = "buffer",
               heads: tuple[int, int] | None = None) -> np.ndarray:
        """New tensors, one per element of ``ranks``; ``chunks`` is [k] or [k, m] chunk ids; ``heads`` the query
        heads [h0, h1) (scalars, or one pair per rank of equal width; default all). Returns ids."""
        ranks = np.atleast_1d(np.asarray(ranks, dtype=np.int64))
        if len(ranks) == 0:
            return np.zeros(0, dtype=np.int64)
        ch = np.asarray(chunks, dtype=np.int64).reshape(len(ranks), -1)
        h0, h1, width = self._heads(heads, len(ranks))
        dt = dtype or self.w.dtype
        tokens = _one_or_each(self.m.tokens_of(kind, ch))
        size = tensor_bytes(self.w, kind, tokens, width, dt)
        ids = np.arange(self._n_tensors, self._n_tensors + len(ranks))
        self._n_tensors += len(ranks)
        self._tensor_starts.append(int(ids[0]))
        block = dict(rank=ranks, kind=kind, kind_code=TENSOR_KIND_NAMES.index(kind), chunks=ch, h0=h0, h1=h1,
                     width=width, dtype=DTYPES.index(dt), role=ROLES.index(role), phase=self.phase, size=size,
                     ids=ids, id0=int(ids[0]), id_end=int(ids[-1]) + 1)
        if self.q is not None:          # the representatives' entries kept; every rank's tokens for _tokens
            keep = self.q.tensors(ranks, ids, size, (block["kind_code"], block["dtype"], self.phase, width,
                                                     ch.shape[1]), block["kind_code"])
            block = _subset(block, keep, len(ranks)) | {"tokens_all": tokens}
        self._tensors.append(block)
        return ids

    def alloc_at(self, tensors, ops) -> None:
        """Tensors ``tensors[k]`` are allocated when op ``ops[k]`` starts (default: at their pass start)."""
        self._alloc.append((np.asarray(tensors), np.asarray(ops)))

    def free_after(self, tensors, ops) -> None:
        """Tensor ``tensors[k]`` may be freed once op ``ops[k]`` has ended (call again to add more ops)."""
        t, o = np.broadcast_arrays(np.asarray(tensors), np.asarray(ops))
        keep = (t >= 0) & (o >= 0)
        self._free.append((t[keep], o[keep]))

    # ------------------------------------------------------------------ ops
    def _add(self, ranks, kind: str, stream: str, deps=(), **fields) -> np.ndarray:
        ranks = np.atleast_1d(np.asarray(ranks, dtype=np.int64))
        k = len(ranks)
        ids = np.arange(self._n_ops, self._n_ops + k)
        self._n_ops += k
        dep = np.full((k, 0), -1, dtype=np.int64) if not len(deps) else \
            np.stack([np.broadcast_to(np.asarray(d, dtype=np.int64), (k,)) for d in deps], axis=1)
        block = dict(rank=ranks, kind=KIND[kind], stream=self.streams.names.index(stream), phase=self.phase, deps=dep,
                     ids=ids, **fields)
        if self.q is not None:          # the representatives' ops kept, once the call is proved invariant
            keep, extra = self.q.ops(ranks, ids, dep, fields, kind=KIND[kind], stream=block["stream"],
                                     phase=self.phase)
            block = _subset(block, keep, k) | extra
        self._ops.append(block)
        return ids

    def transfer(self, src, dst, src_tensor, dst_tensor, *, stream: str, step: int = -1, dtype: str | None = None,
                 send_deps=(), recv_deps=()) -> tuple[np.ndarray, np.ndarray]:
        """Matched send (on ``src``) and recv (on ``dst``) pairs; the recv allocates ``dst_tensor``.

        ``src_tensor`` is [k] (one tensor per send) or [k, p]: a *packed* send of p parts (one kind, heads and
        dtype) moved as one buffer, their tokens concatenated in order, landing as one tensor over the parts'
        chunks in that order (an all-to-all's output sent on as one piece). ``dtype`` is the wire dtype (default:
        the source tensor's); bytes follow the tensor's kind. Returns (send ids, recv ids).
        """
        src, dst = np.atleast_1d(src), np.atleast_1d(dst)
        if len(src) == 0:
            return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)
        parts = np.asarray(src_tensor, dtype=np.int64).reshape(len(src), -1)
        dst_tensor = np.atleast_1d(dst_tensor)
        kind, width, _, t_dtype = self._tensor_info(parts[0, 0])
        dt = dtype or DTYPES[t_dtype]
        tokens = np.zeros(len(src), dtype=np.int64)
        for c in range(parts.shape[1]):
            tokens += self._tokens(parts[:, c])
        size = tensor_bytes(self.w, kind, _one_or_each(tokens), width, dt)
        common = dict(step=step, size_bytes=size, dtype=DTYPES.index(dt))
        packed = {"inputs": parts} if parts.shape[1] > 1 else {}
        s = self._add(src, "send", stream, send_deps, peer=dst, tensor=parts[:, 0], **common, **packed)
        r = self._add(dst, "recv", stream, recv_deps, peer=src, tensor=dst_tensor, **common)
        if self.q is not None:          # each kept op's partner: its peer's representative's op of this call
            src, dst = np.asarray(src, dtype=np.int64), np.asarray(dst, dtype=np.int64)
            self._ops[-2]["partner"] = self.q.partners(src, dst, r, np.flatnonzero(self.q.keep_rank[src]))
            self._ops[-1]["partner"] = self.q.partners(dst, src, s, np.flatnonzero(self.q.keep_rank[dst]))
        self.alloc_at(dst_tensor, r)
        return s, r

    def compute(self, ranks, q_chunks, kv_chunks, *, inputs, outputs, combine: str, deps=(),
                stream: str = "compute", heads: tuple[int, int] | None = None) -> np.ndarray:
        """Attention blocks q_chunks x kv_chunks (cartesian; each [k] or [k, m]) on ``ranks``.

        ``inputs``/``outputs``: lists of tensor-id arrays (one entry per op each). An op over several query
        chunks has one output accumulator per query chunk (and, backward, per KV chunk), in chunk order.
        """
        ranks = np.atleast_1d(np.asarray(ranks, dtype=np.int64))
        if len(ranks) == 0:
            return np.zeros(0, dtype=np.int64)
        qc = np.asarray(q_chunks, dtype=np.int64).reshape(len(ranks), -1)
        kc = np.asarray(kv_chunks, dtype=np.int64).reshape(len(ranks), -1)
        h0, h1, width = self._heads(heads, len(ranks))
        flops, s_q, s_kv, mask = self._describe(qc, kc, width)
        return self._add(ranks, "compute", stream, deps, combine=COMBINES.index(combine), h0=h0, h1=h1,
                         flops=flops, s_q=s_q, s_kv=s_kv, mask=mask, q_chunks=qc, kv_chunks=kc,
                         inputs=np.stack([np.broadcast_to(x, len(ranks)) for x in inputs], axis=1),
                         outputs=np.stack([np.broadcast_to(x, len(ranks)) for x in outputs], axis=1))

    def combine_op(self, ranks, kind: str, *, src, dst, deps=(), stream: str = "compute") -> np.ndarray:
        """A ``merge`` (LSE merge of partial (O, LSE) ``src`` into ``dst``) or ``accumulate`` (dst += src).
        ``dst`` is [k] or [k, p]: p outputs, each taking the tokens of its own chunks out of ``src`` (a packed
        partial added into per-chunk accumulators)."""
        src = np.atleast_1d(src)
        if len(src) == 0:
            return np.zeros(0, dtype=np.int64)
        dst = np.asarray(dst, dtype=np.int64).reshape(len(src), -1)
        kind_t, width, _, src_dtype = self._tensor_info(src[0])   # the src's heads are the ones touched
        tokens = self._tokens(src)
        touched = 2 * tensor_bytes(self.w, kind_t, tokens, width, "fp32") + \
            tensor_bytes(self.w, kind_t, tokens, width, DTYPES[src_dtype])
        return self._add(ranks, kind, stream, deps, size_bytes=touched, inputs=src[:, None], outputs=dst)

    def _describe(self, qc: np.ndarray, kc: np.ndarray, heads: int):
        m, ph = self.m, PASS_NAMES[self.phase]
        if qc.shape[1] == 1 and kc.shape[1] == 1:
            i, j = qc[:, 0], kc[:, 0]
            flops = m.flops(ph, heads)[i, j]
            mask = np.where(m.elementwise[i, j], MASKS.index(self.w.mask.kind), 0)
            return flops, m.s_q[i, j], m.s_kv[i, j], mask
        flops, s_q, s_kv, elementwise = m.op_shape(qc, kc, ph, heads)
        return flops, s_q, s_kv, np.where(elementwise, MASKS.index(self.w.mask.kind), 0)

    def _tensor_info(self, tid: int):
        import bisect
        block = self._tensors[bisect.bisect_right(self._tensor_starts, int(tid)) - 1]
        return block["kind"], block["width"], block["chunks"].shape[1], block["dtype"]

    def _tokens(self, tids: np.ndarray):
        """Tokens of each tensor in ``tids``: an int when they agree, else an array (:func:`_one_or_each`)."""
        tids = np.asarray(tids, dtype=np.int64)
        if len(self._starts_array) != len(self._tensor_starts):      # tensors added since: the array again
            self._starts_array = np.asarray(self._tensor_starts, dtype=np.int64)
        which = np.searchsorted(self._starts_array, tids, side="right") - 1
        if len(which) and which.min() == which.max():        # one builder block (the usual case)
            blk = self._tensors[int(which[0])]
            if "tokens_all" in blk:                          # a quotient build's block: every rank's tokens kept
                return _one_or_each(np.broadcast_to(blk["tokens_all"], (int(blk["id_end"] - blk["id0"]),))[
                    tids - blk["id0"]])
            return _one_or_each(np.asarray(self.m.tokens_of(blk["kind"], blk["chunks"][tids - blk["id0"]]),
                                           dtype=np.int64).reshape(len(tids)))
        tokens = np.zeros(len(tids), dtype=np.int64)
        for b in np.unique(which).tolist():                  # one lookup per builder block they come from
            sel, blk = which == b, self._tensors[b]
            if "tokens_all" in blk:
                tokens[sel] = np.broadcast_to(blk["tokens_all"], (int(blk["id_end"] - blk["id0"]),))[
                    tids[sel] - blk["id0"]]
            else:
                tokens[sel] = self.m.tokens_of(blk["kind"], blk["chunks"][tids[sel] - blk["id0"]])
        return _one_or_each(tokens)

    def _heads(self, heads, k: int):
        """(h0, h1, width) of a call's ``heads``: scalars or [k] arrays of one width."""
        if heads is None:
            return 0, self.w.n_heads, self.w.n_heads
        h0, h1 = (np.broadcast_to(np.asarray(x, dtype=np.int64), (k,)) for x in heads)
        widths = np.unique(h1 - h0)
        if len(widths) != 1 or widths[0] <= 0 or h0.min() < 0 or h1.max() > self.w.n_heads:
            raise ValueError(f"head ranges must be non-empty, inside 0..{self.w.n_heads} and of one width")
        return (int(h0[0]), int(h1[0]), int(widths[0])) if np.ndim(heads[0]) == 0 else (h0, h1, int(widths[0]))

    # ------------------------------------------------------------------ build
    def build(self, topology: dict[str, Any] | None = None) -> Schedule:
        """Assemble the Schedule (ops sorted by rank, ids remapped); a quotient build's of the representatives'
        ops (:func:`meshplan.plan.quotient.assemble_quotient`).

        Raises:
            NotSymmetric: a quotient build whose kept ops refer to ops or tensors not kept.
        """
        if self.q is not None:
            return assemble_quotient(self, topology or {}, assemble)
        return assemble(self, topology or {})


def _subset(block: dict, keep: np.ndarray, k: int) -> dict:
    """A builder block with only the entries ``keep`` of its ``k`` (per-entry arrays sliced, scalars kept)."""
    return {name: v[keep] if isinstance(v, np.ndarray) and v.ndim and v.shape[0] == k else v
            for name, v in block.items()}
