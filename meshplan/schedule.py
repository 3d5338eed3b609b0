"""The Schedule IR: per-rank ops on named streams, with dependencies — shared by simulator and executor.

In memory a Schedule is struct-of-arrays (numpy), op id = index, ops sorted by rank then program order;
pydantic exists only at the file edge (:mod:`meshplan.schedule_io`). Algorithms build schedules with
:class:`ScheduleBuilder`, which pairs every send with its recv and keeps buffers' lifetimes.

Blocking semantics (what the verifier proves deadlock-free, the simulator models and the executor obeys):

1. Each rank runs its ops on named streams. Ops of one stream run in program order: an op *starts* when
   the previous op of its stream has *ended* and all its ``deps`` have ended.
2. Consecutive send/recv ops of one stream with the same ``step`` form a *batch* (``ncclGroupStart/End``,
   ``batch_isend_irecv``): the batch starts when the op before it on the stream has ended and the deps
   of all its members have ended; all members are posted together.
3. A transfer runs once its send and its recv are both posted; sends and recvs of one (communicator, src,
   dst) are matched first-in first-out. A batch ends when all its transfers have completed, and every
   member op's end is the batch's end (NCCL completes a group as one).
4. compute, merge and accumulate ops take time; alloc and free ops take none. Every comm stream has its
   own communicator (``streams[*].communicator``), so FIFO matching never spans streams.
5. Passes: ops carry ``pass`` (fwd or bwd). All bwd ops of every rank start after all fwd ops of every rank
   have ended (a barrier; in training the rest of the model runs in between). Each pass is timed on its own.
6. Tensors: a tensor with ``alloc_op`` = −1 exists when its pass starts (inputs, accumulators initialised to
   the identity: O = 0 with LSE = −inf, gradients 0); otherwise it is allocated when ``alloc_op`` starts.
   It is freed when every op in ``free_after`` has ended (never, if the list is empty).
7. ``combine`` of a compute op says how its result joins its outputs: ``merge`` = the overflow-free LSE
   merge of (O, LSE) into a running (O, LSE) in fp32; ``accumulate`` = add into fp32 gradients; ``write``
   = store. Final outputs and gradients are returned in the input dtype.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np

from meshplan.csr import csr_ptr
from meshplan.matrix import AttnMatrix
from meshplan.units import DTYPE_BYTES
from meshplan.workload import Workload

SCHEMA_VERSION = "1.0"
OP_KINDS = ("compute", "send", "recv", "merge", "accumulate", "collective", "alloc", "free")
COMBINES = ("write", "merge", "accumulate")
PASS_NAMES = ("fwd", "bwd")
MASKS = ("full", "causal", "window", "docs")
DTYPES = ("bf16", "fp16", "fp32")
ROLES = ("input", "output", "buffer")
#: Tensor kinds and what they hold ([B, c, H, D] per chunk; LSE and D are fp32 [B, H, c]).
TENSOR_KINDS = {
    "q": "Q",
    "kv": "K and V",
    "out": "O and its LSE (O in the tensor's dtype, LSE fp32)",
    "dout": "dO",
    "qside": "Q, dO (input dtype) with LSE and D = rowsum(dO*O) (fp32): the Q side of a backward block",
    "dside": "dO (input dtype) with LSE and D (fp32): the Q side when Q itself was kept from the forward",
    "dq": "dQ",
    "dkv": "dK and dV",
}
TENSOR_KIND_NAMES = tuple(TENSOR_KINDS)
KIND = {k: i for i, k in enumerate(OP_KINDS)}
SEND, RECV, COMPUTE = KIND["send"], KIND["recv"], KIND["compute"]


def tensor_bytes(workload: Workload, kind: str, tokens: int, heads: int, dtype: str) -> int:
    """Bytes of a tensor of ``kind`` over ``tokens`` tokens and ``heads`` query heads (KV kinds scale by 1/g).

    Sizes per ALGORITHMS.md: Qc = B·c·h·D·β, KVc = 2·B·c·h_kv·D·β, Oc + Lc = B·c·h·D·β_o + 4·B·c·h.
    ``tokens`` may be an int array (one size per tensor; returned as an int64 array then).
    """
    B, D, beta = workload.batch, workload.head_dim, DTYPE_BYTES[dtype]
    kv_heads = -(-heads // workload.gqa_group)  # a head range narrower than a GQA group still needs its KV head
    base = B * tokens * D * beta
    ib = DTYPE_BYTES[workload.dtype]
    sizes = {
        "q": base * heads, "dout": base * heads, "dq": base * heads,
        "kv": 2 * base * kv_heads, "dkv": 2 * base * kv_heads,
        "out": base * heads + 4 * B * tokens * heads,
        "qside": 2 * B * tokens * D * ib * heads + 8 * B * tokens * heads,
        "dside": B * tokens * D * ib * heads + 8 * B * tokens * heads,
    }
    value = sizes[kind]
    return int(value) if np.ndim(value) == 0 else np.asarray(value, dtype=np.int64)


@dataclass
class Streams:
    """Stream names, kinds (``compute`` or ``comm``) and communicator ids (comm streams only)."""

    names: list[str] = field(default_factory=list)
    kinds: list[str] = field(default_factory=list)
    communicator: list[int] = field(default_factory=list)

    def add(self, name: str, kind: str) -> int:
        """Register a stream; comm streams get the next communicator id."""
        comm = -1 if kind == "compute" else sum(k == "comm" for k in self.kinds)
        self.names.append(name)
        self.kinds.append(kind)
        self.communicator.append(comm)
        return len(self.names) - 1


def _one_or_each(tokens: np.ndarray):
    """An int when every entry is equal (the usual case: one size for the whole builder call), else the array."""
    return int(tokens[0]) if (tokens == tokens[0]).all() else tokens


def expand_blocks(o: OpTable, ops: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The (op, query chunk, KV chunk) triples of compute ops ``ops`` (cartesian products expanded)."""
    nq, nk = np.diff(o.qc_ptr)[ops], np.diff(o.kvc_ptr)[ops]
    reps = nq * nk
    op_of = np.repeat(ops, reps)
    local = np.arange(reps.sum()) - np.repeat(np.cumsum(reps) - reps, reps)
    nk_rep = np.repeat(nk, reps)
    qi = o.q_chunks[o.qc_ptr[op_of] + local // nk_rep]
    kj = o.kv_chunks[o.kvc_ptr[op_of] + local % nk_rep]
    return op_of, qi, kj


@dataclass
class OpTable:
    """All ops, struct-of-arrays; op id = index. Multi-valued fields are CSR (``*_ptr`` + values)."""

    rank: np.ndarray
    kind: np.ndarray
    stream: np.ndarray
    phase: np.ndarray
    step: np.ndarray          # batch id of send/recv (−1: a batch of one)
    peer: np.ndarray          # send/recv peer rank (−1 otherwise)
    tensor: np.ndarray        # send/recv tensor (−1 otherwise)
    size_bytes: np.ndarray    # bytes on the wire (send/recv) or touched (merge/accumulate)
    dtype: np.ndarray         # wire dtype of send/recv (index into DTYPES)
    combine: np.ndarray       # compute: index into COMBINES
    h0: np.ndarray            # compute: query-head range [h0, h1)
    h1: np.ndarray
    flops: np.ndarray         # compute: FLOPs of the op (forward or backward convention by phase)
    s_q: np.ndarray           # compute: kernel shape in tokens
    s_kv: np.ndarray
    mask: np.ndarray          # compute: index into MASKS (full = no elementwise mask)
    dep_ptr: np.ndarray
    deps: np.ndarray
    in_ptr: np.ndarray
    inputs: np.ndarray
    out_ptr: np.ndarray
    outputs: np.ndarray
    qc_ptr: np.ndarray
    q_chunks: np.ndarray
    kvc_ptr: np.ndarray
    kv_chunks: np.ndarray

    def __len__(self) -> int:
        return len(self.rank)


@dataclass
class TensorTable:
    """All tensors; tensor id = index."""

    rank: np.ndarray
    kind: np.ndarray          # index into TENSOR_KIND_NAMES
    chunk_ptr: np.ndarray
    chunks: np.ndarray
    h0: np.ndarray
    h1: np.ndarray
    dtype: np.ndarray         # index into DTYPES
    role: np.ndarray          # index into ROLES
    phase: np.ndarray
    size_bytes: np.ndarray
    alloc_op: np.ndarray      # −1: exists when its pass starts
    free_ptr: np.ndarray
    free_after: np.ndarray

    def __len__(self) -> int:
        return len(self.rank)


@dataclass
class Schedule:
    """A complete schedule for ``n_ranks`` ranks (the JSON contract, in memory)."""

    algorithm: str
    knobs: dict[str, Any]
    workload: Workload
    n_ranks: int
    n_chunks: int
    device_of_rank: np.ndarray
    topology: dict[str, Any]
    streams: Streams
    ops: OpTable
    tensors: TensorTable
    symmetries: list = field(default_factory=list)  # rank permutations the algorithm declares (not in files)
    rank_ptr: np.ndarray = field(init=False)

    def __post_init__(self) -> None:
        self.rank_ptr = csr_ptr(np.bincount(self.ops.rank, minlength=self.n_ranks))

    @property
    def passes(self) -> list[int]:
        """Pass indices present (0 fwd, 1 bwd), in order."""
        return sorted(int(p) for p in np.unique(self.ops.phase))

    def match_transfers(self) -> tuple[np.ndarray, np.ndarray, list[str]]:
        """Pair sends with recvs FIFO per (communicator, src, dst).

        Returns:
            (partner, ok, problems): partner[op] = matching op id or −1 for every send/recv; problems lists
            unmatched or mismatched ops (empty when every transfer pairs up with equal bytes and dtype).
        """
        o = self.ops
        comm = np.asarray(self.streams.communicator)[o.stream]
        partner = np.full(len(o), -1, dtype=np.int64)
        sends, recvs = np.flatnonzero(o.kind == SEND), np.flatnonzero(o.kind == RECV)
        key_s = (comm[sends], o.rank[sends], o.peer[sends])
        key_r = (comm[recvs], o.peer[recvs], o.rank[recvs])
        ks, kr = _fifo_keys(sends, key_s, self.n_ranks), _fifo_keys(recvs, key_r, self.n_ranks)
        problems: list[str] = []
        i_s, i_r = _join(ks, kr)
        partner[sends[i_s]] = recvs[i_r]
        partner[recvs[i_r]] = sends[i_s]
        matched = np.zeros(len(o), dtype=bool)
        matched[sends[i_s]] = matched[recvs[i_r]] = True
        unmatched = np.flatnonzero(((o.kind == SEND) | (o.kind == RECV)) & ~matched)
        for op in unmatched[:5]:
            what = "send to" if o.kind[op] == SEND else "recv from"
            problems.append(f"op {op} on rank {o.rank[op]}: {what} rank {o.peer[op]} has no matching partner")
        a, b = sends[i_s], recvs[i_r]
        bad = np.flatnonzero((o.size_bytes[a] != o.size_bytes[b]) | (o.dtype[a] != o.dtype[b]))
        for k in bad[:5]:
            problems.append(f"op {a[k]} sends {o.size_bytes[a[k]]} bytes ({DTYPES[o.dtype[a[k]]]}) but op {b[k]} "
                            f"receives {o.size_bytes[b[k]]} bytes ({DTYPES[o.dtype[b[k]]]})")
        return partner, not problems, problems


def _join(a: np.ndarray, b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Indices (i, j) with a[i] == b[j] for unique-valued int arrays (sort-based, no hashing)."""
    ia, ib = np.argsort(a, kind="stable"), np.argsort(b, kind="stable")
    pos = np.searchsorted(b[ib], a[ia])
    pos_c = np.minimum(pos, max(len(b) - 1, 0))
    hit = (pos < len(b)) & (b[ib][pos_c] == a[ia]) if len(b) else np.zeros(len(a), dtype=bool)
    return ia[hit], ib[pos_c[hit]]


def _fifo_keys(ops: np.ndarray, key: tuple[np.ndarray, ...], n_ranks: int) -> np.ndarray:
    """One int per op: its (communicator, src, dst) triple and its position k among that triple's ops."""
    comm, src, dst = (np.asarray(k, dtype=np.int64) for k in key)
    group = (comm * n_ranks + src) * n_ranks + dst
    order = np.lexsort((ops, group))
    g_sorted = group[order]
    idx = np.arange(len(ops))
    first = np.r_[True, g_sorted[1:] != g_sorted[:-1]] if len(ops) else np.zeros(0, dtype=bool)
    start = np.maximum.accumulate(np.where(first, idx, 0)) if len(ops) else idx
    kth = np.empty(len(ops), dtype=np.int64)
    kth[order] = idx - start
    return group * (1 << 24) + kth


class ScheduleBuilder:
    """Vectorised construction of a Schedule: each call adds one op per element of ``ranks``.

    Ops are appended in program order per rank (calls in the order each rank runs them); ids are
    assigned at :meth:`build` after a stable sort by rank. Deps and ``free_after`` refer to the ids
    returned by earlier calls. Tensor sizes come from :func:`tensor_bytes`.
    """

    def __init__(self, workload: Workload, matrix: AttnMatrix, n_ranks: int, *, algorithm: str,
                 knobs: dict[str, Any], device_of_rank: Sequence[int] | None = None) -> None:
        self.w, self.m, self.n = workload, matrix, n_ranks
        self.algorithm, self.knobs = algorithm, dict(knobs)
        self.device_of_rank = np.arange(n_ranks) if device_of_rank is None else np.asarray(device_of_rank)
        self.streams = Streams()
        self._ops: list[dict[str, Any]] = []
        self._tensors: list[dict[str, Any]] = []
        self._n_ops = self._n_tensors = 0
        self._free: list[tuple[np.ndarray, np.ndarray]] = []
        self._alloc: list[tuple[np.ndarray, np.ndarray]] = []
        self._tensor_starts: list[int] = []
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
        size = tensor_bytes(self.w, kind, _one_or_each(self.m.tokens_of(kind, ch)), width, dt)
        ids = np.arange(self._n_tensors, self._n_tensors + len(ranks))
        self._n_tensors += len(ranks)
        self._tensor_starts.append(int(ids[0]))
        self._tensors.append(dict(rank=ranks, kind=kind, kind_code=TENSOR_KIND_NAMES.index(kind), chunks=ch,
                                  h0=h0, h1=h1, width=width, dtype=DTYPES.index(dt), role=ROLES.index(role),
                                  phase=self.phase, size=size, ids=ids))
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
        self._ops.append(dict(rank=ranks, kind=KIND[kind], stream=self.streams.names.index(stream),
                              phase=self.phase, deps=dep, ids=ids, **fields))
        return ids

    def transfer(self, src, dst, src_tensor, dst_tensor, *, stream: str, step: int = -1, dtype: str | None = None,
                 send_deps=(), recv_deps=()) -> tuple[np.ndarray, np.ndarray]:
        """Matched send (on ``src``) and recv (on ``dst``) pairs; the recv allocates ``dst_tensor``.

        ``dtype`` is the wire dtype (default: the source tensor's); bytes follow the tensor's kind.
        Returns (send ids, recv ids).
        """
        src, dst = np.atleast_1d(src), np.atleast_1d(dst)
        src_tensor, dst_tensor = np.atleast_1d(src_tensor), np.atleast_1d(dst_tensor)
        if len(src) == 0:
            return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)
        kind, width, _, t_dtype = self._tensor_info(src_tensor[0])
        dt = dtype or DTYPES[t_dtype]
        size = tensor_bytes(self.w, kind, self._tokens(src_tensor), width, dt)
        common = dict(step=step, size_bytes=size, dtype=DTYPES.index(dt))
        s = self._add(src, "send", stream, send_deps, peer=dst, tensor=src_tensor, **common)
        r = self._add(dst, "recv", stream, recv_deps, peer=src, tensor=dst_tensor, **common)
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
        """A ``merge`` (LSE merge of partial (O, LSE) ``src`` into ``dst``) or ``accumulate`` (dst += src)."""
        src, dst = np.atleast_1d(src), np.atleast_1d(dst)
        if len(dst) == 0:
            return np.zeros(0, dtype=np.int64)
        kind_t, width, _, src_dtype = self._tensor_info(src[0])   # the src's heads are the ones touched
        tokens = self._tokens(src)
        touched = 2 * tensor_bytes(self.w, kind_t, tokens, width, "fp32") + \
            tensor_bytes(self.w, kind_t, tokens, width, DTYPES[src_dtype])
        return self._add(ranks, kind, stream, deps, size_bytes=touched, inputs=src[:, None], outputs=dst[:, None])

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
        which = np.searchsorted(np.asarray(self._tensor_starts), tids, side="right") - 1
        tokens = np.zeros(len(tids), dtype=np.int64)
        for b in np.unique(which).tolist():                  # one lookup per builder block they come from
            sel, blk = which == b, self._tensors[b]
            tokens[sel] = self.m.tokens_of(blk["kind"], blk["chunks"][tids[sel] - blk["ids"][0]])
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
        """Assemble the Schedule (ops sorted by rank, ids remapped)."""
        from meshplan.schedule_build import assemble
        return assemble(self, topology or {})
