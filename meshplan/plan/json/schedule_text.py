"""The Schedule JSON text as meshplan writes it: compact (no spaces), keys in the contract's order, the header,
then ``"tensors"``, then ``"ranks"`` one object per rank — the layout :mod:`meshplan.plan.json.read_parts` reads a
part at a time. Tensors and ops are laid out column by column (:class:`~meshplan.plan.json.text_rows.Rows`): no
Python code per op.
"""

from __future__ import annotations

import json

import numpy as np

from meshplan.core.csr import unique_rows
from meshplan.model.matrix import AttnMatrix, attn_matrix
from meshplan.plan.json.format import SEMANTICS
from meshplan.plan.json.text_rows import Rows
from meshplan.plan.schedule import (
    COMBINES,
    DTYPES,
    MASKS,
    OP_KINDS,
    PASS_NAMES,
    ROLES,
    SCHEMA_VERSION,
    TENSOR_KIND_NAMES,
    Schedule,
    TensorTable,
)

#: ranks' ops (and tensors) are laid out this many at a time: what the writer holds at once (~0.3 KB an op), and each
#: piece's stores at its rows' offsets stay within a few MB of cache (100_000: 10% slower at 256 ranks)
TEXT_BLOCK_OPS = 30_000


def json_chunks(sched: Schedule):
    """The JSON text (UTF-8) in bytes-like pieces (header, tensors, then ranks a block at a time: bytes and
    memoryviews of the rendered rows), so big files stream to disk without a copy of each piece."""
    w = sched.workload
    matrix = attn_matrix(w, sched.n_chunks)
    head = {
        "schema_version": SCHEMA_VERSION, "semantics": SEMANTICS, "algorithm": sched.algorithm,
        "knobs": sched.knobs, "workload": w.to_dict() | {"permutation": {"name": w.layout, "seed": 0}},
        "topology": sched.topology, "n_ranks": sched.n_ranks, "n_chunks": sched.n_chunks,
        "device_of_rank": sched.device_of_rank.tolist(),
        "streams": [{"name": n, "kind": k, "communicator": c if c >= 0 else None}
                    for n, k, c in zip(sched.streams.names, sched.streams.kinds, sched.streams.communicator)],
        "chunks": [{"id": i, "segments": [list(s) for s in matrix.chunks.segments(i)]} for i in range(sched.n_chunks)],
    }
    yield (json.dumps(head, separators=(",", ":"))[:-1] + ',"tensors":[').encode()
    yield from _tensors_text(sched.tensors)
    yield b'],"ranks":['
    yield from _ranks_text(sched, matrix)
    yield b"]}"



def _tensors_text(t: TensorTable):
    """Every tensor's object, comma-separated, ~:data:`TEXT_BLOCK_OPS` at a time (memoryviews of the rendered
    rows)."""
    n = len(t.rank)
    for a in range(0, n, TEXT_BLOCK_OPS):
        b = min(a + TEXT_BLOCK_OPS, n)
        sl = slice(a, b)
        r = Rows(b - a).text('{"id":').ints(np.arange(a, b)).text(',"rank":').ints(t.rank[sl]).text(',"kind":"')
        r.choice(t.kind[sl], list(TENSOR_KIND_NAMES)).text('","chunks":')
        r.int_lists(_slice(t.chunk_ptr, a, b), t.chunks[t.chunk_ptr[a]:t.chunk_ptr[b]]).text(',"heads":[')
        r.ints(t.h0[sl]).text(",").ints(t.h1[sl]).text('],"dtype":"').choice(t.dtype[sl], list(DTYPES))
        r.text('","size_bytes":').ints(t.size_bytes[sl]).text(',"role":"').choice(t.role[sl], list(ROLES))
        r.text('","pass":"').choice(t.phase[sl], list(PASS_NAMES)).text('","alloc_op":')
        r.ints(t.alloc_op[sl], null_below_zero=True).text(',"free_after":')
        r.int_lists(_slice(t.free_ptr, a, b), t.free_after[t.free_ptr[a]:t.free_ptr[b]]).text("}")
        r.text(",", np.arange(a, b) < n - 1)
        yield memoryview(r.render()[0])


def _ranks_text(sched: Schedule, matrix: AttnMatrix):
    """Each rank's ``{"rank":K,"ops":[...]}``, comma-separated, ranks laid out ~:data:`TEXT_BLOCK_OPS` ops at a
    time; in pieces (bytes, and memoryviews of the rendered rows: the caller joins them once)."""
    o = sched.ops
    compute = _compute_text(sched, matrix)
    names = [json.dumps(n) for n in sched.streams.names]
    ptr = sched.rank_ptr.tolist()
    r0 = 0
    while r0 < sched.n_ranks:                 # whole ranks, about TEXT_BLOCK_OPS ops at a time
        r1 = r0 + 1
        while r1 < sched.n_ranks and ptr[r1 + 1] - ptr[r0] <= TEXT_BLOCK_OPS:
            r1 += 1
        text, offsets = _ops_rows(o, ptr[r0], ptr[r1], compute, names).render()
        raw, at = memoryview(text), offsets.tolist()        # views of the rows' bytes: no copy until joined
        for r in range(r0, r1):
            a, b = at[ptr[r] - ptr[r0]], at[ptr[r + 1] - ptr[r0]]
            yield (b"," if r else b"") + b'{"rank":%d,"ops":[' % r
            if b > a:
                yield raw[a:b - 1]
            yield b"]}"
        r0 = r1


def _slice(ptr: np.ndarray, a: int, b: int) -> np.ndarray:
    """The CSR pointers of rows a..b−1, from 0."""
    return ptr[a:b + 1] - ptr[a]


def _ops_rows(o, a: int, b: int, compute: tuple, names: list[str]) -> Rows:
    """The ops a..b−1 (ids are their indices), each followed by a comma (the caller drops each rank's last)."""
    kind = o.kind[a:b]
    n = b - a
    sl = slice(a, b)
    r = Rows(n).text('{"id":').ints(np.arange(a, b)).text(',"kind":"').choice(kind, list(OP_KINDS))
    r.text('","stream":').choice(o.stream[sl], names).text(',"deps":')
    r.int_lists(_slice(o.dep_ptr, a, b), o.deps[o.dep_ptr[a]:o.dep_ptr[b]])
    r.text(',"pass":"').choice(o.phase[sl], list(PASS_NAMES)).text('"')
    ins = (_slice(o.in_ptr, a, b), o.inputs[o.in_ptr[a]:o.in_ptr[b]])
    outs = (_slice(o.out_ptr, a, b), o.outputs[o.out_ptr[a]:o.out_ptr[b]])
    comm = (kind == 1) | (kind == 2)
    r.text(',"peer":', comm).ints(o.peer[sl], comm).text(',"tensor":', comm).ints(o.tensor[sl], comm)
    parts = (kind == 1) & (np.diff(ins[0]) > 0)
    r.text(',"parts":', parts).int_lists(*ins, parts)
    r.text(',"size_bytes":', comm).ints(o.size_bytes[sl], comm).text(',"dtype":"', comm)
    r.choice(o.dtype[sl], list(DTYPES), comm).text('","step":', comm).ints(o.step[sl], comm, null_below_zero=True)
    work = kind == 0
    if work.any():
        rows_code, cols_code, mask_code, flops_code, (rows_cols, flops_text) = compute
        r.text(',"q_chunks":', work).int_lists(_slice(o.qc_ptr, a, b), o.q_chunks[o.qc_ptr[a]:o.qc_ptr[b]], work)
        r.text(',"kv_chunks":', work).int_lists(_slice(o.kvc_ptr, a, b), o.kv_chunks[o.kvc_ptr[a]:o.kvc_ptr[b]], work)
        r.text(',"heads":[', work).ints(o.h0[sl], work).text(",", work).ints(o.h1[sl], work)
        r.text('],"q_rows":', work).choice(rows_code[sl], rows_cols, work)
        r.text(',"kv_cols":', work).choice(cols_code[sl], rows_cols, work)
        r.text(',"mask":"', work).choice(mask_code[sl], list(MASKS), work)
        r.text('","inputs":', work).int_lists(*ins, work).text(',"outputs":', work).int_lists(*outs, work)
        r.text(',"combine":"', work).choice(o.combine[sl], list(COMBINES), work).text('","flops":', work)
        r.choice(flops_code[sl], flops_text, work)
    fold = (kind == 3) | (kind == 4)
    r.text(',"inputs":', fold).int_lists(*ins, fold).text(',"outputs":', fold).int_lists(*outs, fold)
    r.text(',"size_bytes":', fold).ints(o.size_bytes[sl], fold)
    r.text("},")
    return r


def _compute_text(sched: Schedule, m: AttnMatrix) -> tuple:
    """Per op ([n_ops], only compute ops' entries used): codes of its ``q_rows`` text, ``kv_cols`` text, mask and
    ``flops`` text, and the tables (the rows' and columns' texts, the flops texts) the codes index."""
    o = sched.ops
    n = len(o)
    rows_code, cols_code, mask_code, flops_code = (np.zeros(n, dtype=np.int64) for _ in range(4))
    texts: dict[str, int] = {}
    for ops, found, inverse in _descriptors(sched, m):
        codes = np.array([(texts.setdefault(rows, len(texts)), texts.setdefault(cols, len(texts)), MASKS.index(mask))
                          for rows, cols, mask in found], dtype=np.int64).reshape(-1, 3)[inverse]
        rows_code[ops], cols_code[ops], mask_code[ops] = codes.T
    table = list(texts)
    work = np.flatnonzero(o.kind == 0)
    values, inverse = np.unique(o.flops[work], return_inverse=True)
    flops_code[work] = inverse.ravel()
    return rows_code, cols_code, mask_code, flops_code, (table, [repr(v) for v in values.tolist()])


def _descriptors(sched: Schedule, m: AttnMatrix):
    """The q_rows, kv_cols and mask texts of every compute op, by groups of ops: (ops [k], the distinct descriptors
    [(rows, cols, mask)], [k] each op's index among them). An op's descriptor follows from a signature — which rows
    and columns of its chunks take part, the chunks' shapes, the elementwise blocks — so it is computed once per
    distinct signature (a few hundred in a 0.5M-op schedule), on one op that has it."""
    o = sched.ops
    allc = np.flatnonzero(o.kind == 0)
    single = (np.diff(o.qc_ptr)[allc] == 1) & (np.diff(o.kvc_ptr)[allc] == 1)
    shape = np.stack([m.valid_first, m.valid_count, m.chunks.count], axis=1).reshape(m.n, -1)
    cls = np.unique(shape, axis=0, return_inverse=True)[1].ravel()
    comp = allc[single]
    if len(comp):
        qi, kj = o.q_chunks[o.qc_ptr[comp]], o.kv_chunks[o.kvc_ptr[comp]]
        bits = 1 << np.arange(m.q_involved.shape[2], dtype=np.int64)
        qpat, kpat = (m.q_involved[qi, kj] * bits).sum(axis=1), (m.kv_involved[qi, kj] * bits).sum(axis=1)
        masks = np.where(m.elementwise[qi, kj] | (o.mask[comp] > 0), o.mask[comp], 0)
        first, inverse = _distinct(np.stack([qpat, kpat, cls[qi], cls[kj], masks], axis=1))
        found = [(json.dumps(m.local_ranges(i, m.q_involved[i, j], query=True), separators=(",", ":")),
                  json.dumps(m.local_ranges(j, m.kv_involved[i, j]), separators=(",", ":")), MASKS[int(mk)])
                 for i, j, mk in zip(qi[first].tolist(), kj[first].tolist(), masks[first].tolist())]
        yield comp, found, inverse
    yield from _multi_descriptors(sched, m, allc[~single], cls)


def _multi_descriptors(sched: Schedule, m: AttnMatrix, ops: np.ndarray, cls: np.ndarray):
    """:func:`_descriptors`' groups of the ops over several chunks, one group per (q chunks, KV chunks) count;
    ``cls`` each chunk's shape class. A signature is a function of the op's chunks alone, so it is made once per
    distinct chunk set (a 256-rank USP schedule: 64 sets among 4096 ops)."""
    o = sched.ops
    if not len(ops):
        return
    nq, nk = np.diff(o.qc_ptr)[ops], np.diff(o.kvc_ptr)[ops]
    for mq, mk in sorted(set(zip(nq.tolist(), nk.tolist()))):
        group = ops[(nq == mq) & (nk == mk)]
        qi = o.q_chunks[o.qc_ptr[group][:, None] + np.arange(mq)]
        kj = o.kv_chunks[o.kvc_ptr[group][:, None] + np.arange(mk)]
        same, again = unique_rows(np.concatenate([qi, kj], axis=1))     # the distinct chunk sets
        sel, qi, kj = group[same], qi[same], kj[same]
        blocks = (qi[:, :, None], kj[:, None, :])
        qinv, kinv = m.q_involved[blocks].any(axis=2), m.kv_involved[blocks].any(axis=1)
        elem = m.elementwise[blocks].any(axis=(1, 2)) | (m.pairs[blocks] == 0).any(axis=(1, 2))
        sig = np.concatenate([qinv.reshape(len(sel), -1), kinv.reshape(len(sel), -1), cls[qi], cls[kj],
                              m.elementwise[blocks].reshape(len(sel), -1), elem[:, None]], axis=1).astype(np.int64)
        first, inverse = _distinct(sig)
        found = []
        for op in sel[first].tolist():
            d = m.op_descriptor(o.q_chunks[o.qc_ptr[op]:o.qc_ptr[op + 1]].tolist(),
                                o.kv_chunks[o.kvc_ptr[op]:o.kvc_ptr[op + 1]].tolist())
            found.append((json.dumps(d["q_rows"], separators=(",", ":")),
                          json.dumps(d["kv_cols"], separators=(",", ":")), d["mask"]))
        yield group, found, inverse[again]


def _distinct(rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(the index of one row of each distinct value of ``rows`` [k, w] (integers), [k] each row's distinct value's
    index): rows grouped by a 64-bit hash (a sort of k numbers, not of k rows), the grouping checked row by row —
    any collision and they are grouped by value instead."""
    multipliers = np.random.default_rng(0x5EED).integers(1, 2**63, size=rows.shape[1], dtype=np.uint64) | np.uint64(1)
    with np.errstate(over="ignore"):                 # odd 64-bit multipliers, the dot product mod 2**64
        keys = rows.astype(np.uint64) @ multipliers
    _, first, inverse = np.unique(keys, return_index=True, return_inverse=True)
    if np.array_equal(rows[first[inverse]], rows):
        return first, inverse.ravel()
    _, first, inverse = np.unique(rows, axis=0, return_index=True, return_inverse=True)
    return first, inverse.ravel()


