"""The Schedule IR: per-rank ops on named streams, with dependencies — shared by simulator and executor.

In memory a Schedule is struct-of-arrays (numpy), op id = index, ops sorted by rank then program order;
pydantic exists only at the file edge (:mod:`meshplan.plan.json.io`). Algorithms build schedules with
:class:`~meshplan.plan.build.ScheduleBuilder`, which pairs every send with its recv and keeps buffers' lifetimes.

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
8. A query row with no permitted key — padding (``valid_len``, a document's padding), or a row none of a
   block's keys is permitted to — has O = 0 and LSE = −inf, in every partial and in the final output
   (FlashAttention writes LSE = +inf there and torch's math path NaN: convert before merging with them); its
   dQ is 0 and it adds nothing to dK, dV. Padding is never a query row or a key of a compute op.
9. NCCL's grouped P2P: within a communicator, two peers issue the batches in which they exchange in the same
   order (a transfer in rank a's k-th batch with rank b is in rank b's k-th batch with rank a).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from meshplan.core.csr import csr_ptr, unique_rows
from meshplan.core.units import DTYPE_BYTES
from meshplan.model.workload import Workload

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
#: op kinds that hold a rank's compute (kernels, LSE merges, gradient additions)
BUSY_KINDS = (KIND["compute"], KIND["merge"], KIND["accumulate"])


def tensor_bytes(workload: Workload, kind: str, tokens: int, heads: int, dtype: str) -> int:
    """Bytes of a tensor of ``kind`` over ``tokens`` tokens and ``heads`` query heads (KV kinds scale by 1/g).

    Sizes per docs/algorithms.md: Qc = B·c·h·D·β, KVc = 2·B·c·h_kv·D·β, Oc + Lc = B·c·h·D·β_o + 4·B·c·h.
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


def chunk_matrices(o: OpTable, ops: np.ndarray):
    """For each shape (mq query chunks x mk KV chunks) among compute ops ``ops``, in (mq, mk) order: (the positions in
    ``ops`` of its ops, in order; [k, mq] their query chunks; [k, mk] their KV chunks) — ops of one shape at once."""
    nq, nk = np.diff(o.qc_ptr)[ops], np.diff(o.kvc_ptr)[ops]
    shape = nq * (int(nk.max(initial=0)) + 1) + nk
    order = np.argsort(shape, kind="stable")
    for run in np.split(order, np.flatnonzero(np.diff(shape[order])) + 1) if len(order) else []:
        sel = ops[run]
        yield run, o.q_chunks[o.qc_ptr[sel][:, None] + np.arange(nq[run[0]])], \
            o.kv_chunks[o.kvc_ptr[sel][:, None] + np.arange(nk[run[0]])]


def distinct_chunk_sets(o: OpTable, ops: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(one op of each distinct (query chunks, KV chunks) among compute ops ``ops``, [len(ops)] the index of each op's
    representative in that list): ops alike but for their heads or rank are priced once."""
    reps, inverse = [], np.empty(len(ops), dtype=np.int64)
    for sel, qi, kj in chunk_matrices(o, ops):
        first, again = unique_rows(np.concatenate([qi, kj], axis=1))
        inverse[sel] = sum(len(r) for r in reps) + again
        reps.append(ops[sel[first]])
    return (np.concatenate(reps) if reps else np.zeros(0, dtype=np.int64)), inverse


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
    #: a quotient build's (:class:`meshplan.plan.quotient.Quotient`): only the representative ranks have ops — it is
    #: simulated, never written or verified; None: every rank's program
    quotient: Any = field(default=None, compare=False)
    rank_ptr: np.ndarray = field(init=False)
    #: results derived from the (unchanging) ops by a cost model, keyed by what they depend on
    #: (:meth:`meshplan.cost.cost.CostModel.op_durations`: a search prices one schedule for its bound, its
    #: symmetry check and its simulation)
    memo: dict = field(default_factory=dict, init=False, repr=False, compare=False)

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
