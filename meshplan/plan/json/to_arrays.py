"""Convert validated Schedule document parts into the compact arrays (ids remapped to indices).

Column by column and a rank (or a batch of tensors) at a time, so a reader can validate a large file in parts and
drop each part's objects once converted (:func:`meshplan.plan.json.io.read_schedule`).
"""

from __future__ import annotations

from itertools import chain

import numpy as np

from meshplan.core.csr import csr_ptr
from meshplan.core.errors import UserError
from meshplan.model.matrix import BWD_FLOP_FACTOR, AttnMatrix
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
    chunk_matrices,
)

_LISTS = ("deps", "inputs", "outputs", "q_chunks", "kv_chunks")
_PTRS = {"deps": "dep_ptr", "inputs": "in_ptr", "outputs": "out_ptr", "q_chunks": "qc_ptr", "kv_chunks": "kvc_ptr"}
_HAS = {"deps": None, "inputs": ("compute", "merge", "accumulate"), "outputs": ("compute", "merge", "accumulate"),
        "q_chunks": ("compute",), "kv_chunks": ("compute",)}
_SCALARS = (("step", np.int32, -1), ("peer", np.int32, -1), ("tensor", np.int64, -1), ("size_bytes", np.int64, 0),
            ("dtype", np.int8, -1), ("combine", np.int8, -1), ("h0", np.int32, 0), ("h1", np.int32, 0),
            ("s_q", np.int64, 0), ("s_kv", np.int64, 0), ("mask", np.int8, 0))


def _fail(field: str, problem: str) -> UserError:
    return UserError(field, problem, "fix the file or regenerate it")


def op_table(doc: ScheduleJSON, streams: Streams, m: AttnMatrix, w: Workload) -> OpTable:
    """Op arrays in rank/program order (column-wise); ``id_map`` (JSON id -> index) is attached."""
    cols = OpColumns(streams, w, m.n)
    for r in doc.ranks:
        cols.add_rank(r.ops)
    return cols.table(m)


class OpColumns:
    """An OpTable built a rank at a time (:meth:`add_rank` in rank order from rank 0, then :meth:`table`;
    the ``parts`` of several, in rank order, make one)."""

    def __init__(self, streams: Streams, w: Workload, n_chunks: int) -> None:
        self.stream_idx = {name: i for i, name in enumerate(streams.names)}
        self.w, self.n_chunks = w, n_chunks
        self.parts: list[dict[str, np.ndarray]] = []

    def add_rank(self, ops: list) -> None:
        """Convert one rank's validated ops (program order).

        Raises:
            UserError: an unknown stream, a head range or chunk id out of range.
        """
        self.parts.append(self.columns(ops, len(self.parts)))

    def columns(self, ops: list, rank: int) -> dict[str, np.ndarray]:
        """The columns of one rank's validated ops (program order), a part of the table.

        Raises:
            UserError: an unknown stream, a head range or chunk id out of range.
        """
        n = len(ops)
        unknown = next((op for op in ops if op.stream not in self.stream_idx), None)
        if unknown is not None:
            raise _fail(f"op {unknown.id}.stream", f"unknown stream {unknown.stream!r}")
        kinds = [op.kind for op in ops]
        a = {"id": np.fromiter((op.id for op in ops), dtype=np.int64, count=n),
             "rank": np.full(n, rank, dtype=np.int64),
             "kind": np.fromiter((KIND[k] for k in kinds), dtype=np.int8, count=n),
             "stream": np.fromiter((self.stream_idx[op.stream] for op in ops), dtype=np.int16, count=n),
             "phase": np.fromiter((op.pass_ == "bwd" for op in ops), dtype=np.int8, count=n)}
        for name, dt, default in _SCALARS:
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
        for name in _LISTS:
            rows = [op.deps for op in ops] if _HAS[name] is None else \
                [getattr(op, name) if k in _HAS[name] else op.parts if name == "inputs" and k == "send" else ()
                 for op, k in zip(ops, kinds)]
            a["n_" + name] = np.fromiter(map(len, rows), dtype=np.int64, count=n)
            a[name] = np.fromiter(chain.from_iterable(rows), dtype=np.int64, count=int(a["n_" + name].sum()))
        comp = [i for i, k in enumerate(kinds) if k == "compute"]
        if comp:
            self._compute_fields([ops[i] for i in comp], np.asarray(comp), a)
        return a

    def _compute_fields(self, ops: list, at: np.ndarray, a: dict) -> None:
        """Heads, combine, mask and kernel shape of the compute ops ``ops`` (at positions ``at``).

        Raises:
            UserError: a head range outside the workload's heads, a chunk id not below n_chunks.
        """
        heads = np.array([op.heads for op in ops], dtype=np.int64).reshape(-1, 2)
        bad = np.flatnonzero(~((heads[:, 0] >= 0) & (heads[:, 0] < heads[:, 1]) & (heads[:, 1] <= self.w.n_heads)))
        if len(bad):
            h0, h1 = heads[bad[0]]
            raise _fail(f"op {ops[bad[0]].id}.heads", f"[{h0}, {h1}) is not a head range within 0..{self.w.n_heads}")
        first = None                          # the first op (by position) naming a chunk id out of range
        for name in ("q_chunks", "kv_chunks"):
            pos = np.repeat(np.arange(len(a["n_" + name])), a["n_" + name])[a[name] >= self.n_chunks]
            if len(pos):
                first = int(pos.min()) if first is None else min(first, int(pos.min()))
        if first is not None:
            op = ops[int(np.searchsorted(at, first))]
            raise _fail(f"op {op.id}", f"chunk ids must be below n_chunks = {self.n_chunks}")
        a["h0"][at], a["h1"][at] = heads[:, 0], heads[:, 1]
        a["combine"][at] = [COMBINES.index(op.combine) for op in ops]
        a["mask"][at] = [MASKS.index(op.mask) for op in ops]
        for field, rows in (("s_q", [op.q_rows for op in ops]), ("s_kv", [op.kv_cols for op in ops])):
            count = np.fromiter(map(len, rows), dtype=np.int64, count=len(rows))
            ends = np.fromiter(chain.from_iterable(chain.from_iterable(rows)), dtype=np.int64,
                               count=2 * int(count.sum())).reshape(-1, 2)
            width = np.zeros(len(rows), dtype=np.int64)
            np.add.at(width, np.repeat(np.arange(len(rows)), count), ends[:, 1] - ends[:, 0])
            a[field][at] = width

    def table(self, m: AttnMatrix, wide: set[str] = frozenset()) -> OpTable:
        """The OpTable of every rank added (``m``: the workload's attention matrix, for the FLOPs); ``id_map``
        (JSON id -> index) attached. ``wide``: the columns some parts hold narrowed to int32, joined as int64.

        Raises:
            UserError: op ids not unique, or a dep naming an op that does not exist.
        """
        parts, self.parts = self.parts or [self.columns([], 0)], []
        cat = {}
        for k in list(parts[0]):                  # a column at a time, each part's copy dropped as it goes
            cat[k] = np.concatenate([p.pop(k) for p in parts], dtype=np.int64 if k in wide else None)
        ids = cat.pop("id")
        n = len(ids)
        id_map = _IdMap(ids)
        a = {k: v for k, v in cat.items() if not k.startswith("n_") and k not in _LISTS}
        for name in _LISTS:
            a[_PTRS[name]] = csr_ptr(cat["n_" + name])
            a[name] = cat[name]
        missing = ~id_map.present(a["deps"])
        if missing.any():
            raise _fail("deps", f"op id {int(a['deps'][np.argmax(missing)])} does not exist")
        a["deps"] = id_map.index(a["deps"])
        a["flops"] = np.zeros(n)
        table = OpTable(**a)
        self._flops(table, m)
        table.id_map = id_map
        return table

    def _flops(self, o: OpTable, m: AttnMatrix) -> None:
        """Every compute op's FLOPs (:meth:`AttnMatrix.flops`): its blocks' pairs, summed as exact integers, x
        4·B·h·D (x the backward factor), h its heads — the sum of its blocks' FLOPs, exactly."""
        ops = np.flatnonzero(o.kind == KIND["compute"])
        if not len(ops):
            return
        pairs = np.zeros(len(o), dtype=np.int64)
        for sel, qi, kj in chunk_matrices(o, ops):   # the ops of one shape: their blocks at once
            pairs[ops[sel]] = m.pairs[qi[:, :, None], kj[:, None, :]].sum(axis=(1, 2), dtype=np.int64)
        heads = (o.h1 - o.h0)[ops].astype(np.float64)
        per_pair = 4.0 * self.w.batch * self.w.head_dim * np.where(o.phase[ops] == 1, BWD_FLOP_FACTOR, 1.0)
        o.flops[ops] = pairs[ops] * (heads * per_pair)


def tensor_table(doc: ScheduleJSON, id_map) -> TensorTable:
    """Tensor arrays; tensors must be listed with ids 0, 1, 2, ... in order."""
    cols = TensorColumns()
    cols.add(doc.tensors)
    return cols.table(id_map, doc.n_ranks, doc.n_chunks)


class TensorColumns:
    """A TensorTable built a batch at a time (:meth:`add` in id order, then :meth:`table`)."""

    def __init__(self) -> None:
        self.parts: list[dict[str, np.ndarray]] = []
        self.count = 0

    def add(self, ts: list) -> None:
        """Convert a batch of validated tensors, the next ids in order.

        Raises:
            UserError: ids not the next ones in order.
        """
        n = len(ts)
        ids = np.fromiter((t.id for t in ts), dtype=np.int64, count=n)
        if not np.array_equal(ids, np.arange(self.count, self.count + n)):
            raise _fail("tensors", "tensor ids must be 0, 1, 2, ... in order")
        arr = lambda f, dt=np.int64: np.fromiter((f(t) for t in ts), dtype=dt, count=n)  # noqa: E731
        free_n = arr(lambda t: len(t.free_after))
        chunk_n = arr(lambda t: len(t.chunks))
        self.parts.append({
            "rank": arr(lambda t: t.rank), "kind": arr(lambda t: TENSOR_KIND_NAMES.index(t.kind), np.int8),
            "chunk_n": chunk_n, "chunks": np.fromiter(chain.from_iterable(t.chunks for t in ts), dtype=np.int64,
                                                      count=int(chunk_n.sum())),
            "h0": arr(lambda t: t.heads[0], np.int32), "h1": arr(lambda t: t.heads[1], np.int32),
            "dtype": arr(lambda t: DTYPES.index(t.dtype), np.int8), "role": arr(lambda t: ROLES.index(t.role), np.int8),
            "phase": arr(lambda t: PASS_NAMES.index(t.pass_), np.int8), "size_bytes": arr(lambda t: t.size_bytes),
            "alloc_op": arr(lambda t: -1 if t.alloc_op is None else t.alloc_op),
            "alloc_given": arr(lambda t: t.alloc_op is not None, bool), "free_n": free_n,
            "free_after": np.fromiter(chain.from_iterable(t.free_after for t in ts), dtype=np.int64,
                                      count=int(free_n.sum()))})
        self.count += n

    def add_columns(self, columns: dict[str, np.ndarray]) -> None:
        """Add the next tensors' columns, as :meth:`add` makes them
        (:func:`meshplan.plan.json.record_columns.tensor_columns`)."""
        self.parts.append(columns)
        self.count += len(columns["rank"])

    def table(self, id_map, n_ranks: int, n_chunks: int, wide: set[str] = frozenset()) -> TensorTable:
        """The TensorTable of every batch added, op ids mapped by ``id_map`` (the OpTable's). ``wide``: the columns
        some parts hold narrowed to int32, joined as int64.

        Raises:
            UserError: an alloc_op or free_after naming no op; a rank or chunk out of range.
        """
        parts = self.parts or [{k: np.zeros(0, np.int64) for k in ("rank", "kind", "chunk_n", "chunks", "h0", "h1",
                                                                     "dtype", "role", "phase", "size_bytes",
                                                                     "alloc_op", "alloc_given", "free_n",
                                                                     "free_after")}]
        a = {k: np.concatenate([p.pop(k) for p in parts], dtype=np.int64 if k in wide else None)
             for k in list(parts[0])}
        self.parts = []
        free_owner = np.repeat(np.arange(len(a["rank"])), a["free_n"])
        given = a["alloc_given"].astype(bool)
        alloc_ok = ~given | id_map.present(a["alloc_op"])
        free_ok = id_map.present(a["free_after"])
        bad = np.flatnonzero(~alloc_ok | (np.bincount(free_owner, weights=~free_ok, minlength=len(alloc_ok)) > 0))
        if len(bad):
            raise _fail(f"tensors[{bad[0]}]", "alloc_op/free_after name an op that does not exist")
        chunk_owner = np.repeat(np.arange(len(a["rank"])), a["chunk_n"])
        out_of_range = (a["rank"] >= n_ranks) | (np.bincount(chunk_owner, weights=a["chunks"] >= n_chunks,
                                                             minlength=len(a["rank"])) > 0)
        bad = np.flatnonzero(out_of_range)
        if len(bad):
            raise _fail(f"tensors[{bad[0]}]", f"its rank or chunks are out of range (n_ranks {n_ranks}, n_chunks "
                        f"{n_chunks})")
        alloc = a["alloc_op"]
        return TensorTable(
            rank=a["rank"], kind=a["kind"], chunk_ptr=csr_ptr(a["chunk_n"]), chunks=a["chunks"], h0=a["h0"],
            h1=a["h1"], dtype=a["dtype"], role=a["role"], phase=a["phase"], size_bytes=a["size_bytes"],
            alloc_op=np.where(given, id_map.index(np.where(given, alloc, 0)), -1), free_ptr=csr_ptr(a["free_n"]),
            free_after=id_map.index(a["free_after"]))


class _IdMap:
    """JSON op ids -> indices, vectorised: the identity when the ids are 0, 1, 2, … in order (what meshplan writes),
    else through their sorted order.

    Raises:
        UserError: (on construction) ids that are not unique.
    """

    def __init__(self, ids: np.ndarray) -> None:
        self.n = len(ids)
        self._sorted = self._order = None
        if not np.array_equal(ids, np.arange(self.n)):
            self._order = np.argsort(ids, kind="stable")
            self._sorted = ids[self._order]
            if self.n and (np.diff(self._sorted) == 0).any():
                raise _fail("ranks[*].ops[*].id", "op ids must be unique")

    def present(self, values: np.ndarray) -> np.ndarray:
        """[k] whether each id names an op."""
        values = np.asarray(values, dtype=np.int64)
        if self._sorted is None:
            return (values >= 0) & (values < self.n)
        pos = np.minimum(np.searchsorted(self._sorted, values), self.n - 1)     # n > 0: no ids are 0..n-1 here
        return self._sorted[pos] == values

    def index(self, values: np.ndarray) -> np.ndarray:
        """The indices of ids ``values`` (every one present)."""
        values = np.asarray(values, dtype=np.int64)
        if self._sorted is None or not len(values):
            return values
        return self._order[np.searchsorted(self._sorted, values)]
