"""Read and write Schedule JSON (``.json``, or ``.json.gz`` when the name says so).

Writes are atomic (a temporary file renamed into place), so a failed or interrupted write leaves no
half-written schedule. Reading checks ``schema_version`` before anything else, then validates the file with the
pydantic models of :mod:`meshplan.plan.json.format` (a file as meshplan writes it a part at a time:
:mod:`meshplan.plan.json.read_parts`), then builds the compact in-memory form.
"""

from __future__ import annotations

import contextlib
import gc
import gzip
import json
import re
import zlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

from meshplan.core.errors import UserError
from meshplan.core.fileio import write_atomic
from meshplan.model.matrix import AttnMatrix, attn_matrix
from meshplan.plan.json.format import SEMANTICS, ScheduleJSON
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


def to_json_text(sched: Schedule) -> str:
    """The Schedule as JSON text (the contract's skeleton), serialised column-wise for speed."""
    return "".join(json_chunks(sched))


def json_chunks(sched: Schedule):
    """The JSON text in pieces (header, tensors, then rank by rank), so big files stream to disk."""
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
    yield json.dumps(head, separators=(",", ":"))[:-1] + ',"tensors":['
    yield _tensors_text(sched.tensors)
    yield '],"ranks":['
    yield from _ranks_text(sched, matrix)
    yield "]}"


def to_json_dict(sched: Schedule) -> dict[str, Any]:
    """The Schedule as JSON-ready Python objects."""
    return json.loads(to_json_text(sched))


def _rows(ptr: np.ndarray, values: np.ndarray) -> list[str]:
    """Each CSR row as the text of a JSON list (rows of 0 or 1 values, the common case, are cheap)."""
    strs = list(map(str, values.tolist()))
    p = ptr.tolist()
    counts = np.diff(ptr)
    out = ["[]"] * (len(p) - 1)
    for i in np.flatnonzero(counts == 1).tolist():
        out[i] = f"[{strs[p[i]]}]"
    for i in np.flatnonzero(counts > 1).tolist():
        out[i] = "[" + ",".join(strs[p[i]:p[i + 1]]) + "]"
    return out


def _tensors_text(t: TensorTable) -> str:
    chunks, frees = _rows(t.chunk_ptr, t.chunks), _rows(t.free_ptr, t.free_after)
    cols = zip(t.rank.tolist(), t.kind.tolist(), t.h0.tolist(), t.h1.tolist(), t.dtype.tolist(), t.size_bytes.tolist(),
               t.role.tolist(), t.phase.tolist(), t.alloc_op.tolist())
    return ",".join(
        f'{{"id":{i},"rank":{r},"kind":"{TENSOR_KIND_NAMES[k]}","chunks":{chunks[i]},"heads":[{h0},{h1}],'
        f'"dtype":"{DTYPES[dt]}","size_bytes":{sz},"role":"{ROLES[ro]}","pass":"{PASS_NAMES[ph]}",'
        f'"alloc_op":{a if a >= 0 else "null"},"free_after":{frees[i]}}}'
        for i, (r, k, h0, h1, dt, sz, ro, ph, a) in enumerate(cols))


#: ranks' ops are turned into text this many ops at a time (what the writer holds at once: ~0.5 KB an op)
TEXT_BLOCK_OPS = 50_000


def _ranks_text(sched: Schedule, matrix: AttnMatrix):
    o = sched.ops
    desc = _descriptors(sched, matrix)
    names = [json.dumps(n) for n in sched.streams.names]
    ptr = sched.rank_ptr.tolist()
    r0 = 0
    while r0 < sched.n_ranks:                 # whole ranks, about TEXT_BLOCK_OPS ops at a time
        r1 = r0 + 1
        while r1 < sched.n_ranks and ptr[r1 + 1] - ptr[r0] <= TEXT_BLOCK_OPS:
            r1 += 1
        ops = _ops_text(o, ptr[r0], ptr[r1], desc, names)
        for r in range(r0, r1):
            yield ("," if r else "") + f'{{"rank":{r},"ops":[{",".join(ops[ptr[r] - ptr[r0]:ptr[r + 1] - ptr[r0]])}]}}'
        r0 = r1


def _slice_rows(ptr: np.ndarray, values: np.ndarray, a: int, b: int) -> list[str]:
    """:func:`_rows` of the CSR rows a..b−1."""
    return _rows(ptr[a:b + 1] - ptr[a], values[ptr[a]:ptr[b]])


def _ops_text(o, a: int, b: int, desc: dict, names: list[str]) -> list[str]:
    """The JSON text of ops a..b−1 (ids are their indices)."""
    deps, ins, outs = (_slice_rows(o.dep_ptr, o.deps, a, b), _slice_rows(o.in_ptr, o.inputs, a, b),
                       _slice_rows(o.out_ptr, o.outputs, a, b))
    qc, kc = _slice_rows(o.qc_ptr, o.q_chunks, a, b), _slice_rows(o.kvc_ptr, o.kv_chunks, a, b)
    cols = zip(o.kind[a:b].tolist(), o.stream[a:b].tolist(), o.phase[a:b].tolist(), o.peer[a:b].tolist(),
               o.tensor[a:b].tolist(), o.size_bytes[a:b].tolist(), o.dtype[a:b].tolist(), o.step[a:b].tolist(),
               o.h0[a:b].tolist(), o.h1[a:b].tolist(), o.combine[a:b].tolist(), o.flops[a:b].tolist())
    has_parts = (np.diff(o.in_ptr[a:b + 1]) > 0).tolist()
    ops = []
    for k, (kind, st, ph, peer, ten, size, dt, step, h0, h1, comb, flops) in enumerate(cols):
        i = a + k
        base = f'{{"id":{i},"kind":"{OP_KINDS[kind]}","stream":{names[st]},"deps":{deps[k]},"pass":"{PASS_NAMES[ph]}"'
        if kind in (1, 2):
            parts = f',"parts":{ins[k]}' if kind == 1 and has_parts[k] else ""
            ops.append(f'{base},"peer":{peer},"tensor":{ten}{parts},"size_bytes":{size},"dtype":"{DTYPES[dt]}",'
                       f'"step":{step if step >= 0 else "null"}}}')
        elif kind == 0:
            rows, cols_, mask = desc[i]
            ops.append(f'{base},"q_chunks":{qc[k]},"kv_chunks":{kc[k]},"heads":[{h0},{h1}],"q_rows":{rows},'
                       f'"kv_cols":{cols_},"mask":"{mask}","inputs":{ins[k]},"outputs":{outs[k]},'
                       f'"combine":"{COMBINES[comb]}","flops":{flops!r}}}')
        elif kind in (3, 4):
            ops.append(f'{base},"inputs":{ins[k]},"outputs":{outs[k]},"size_bytes":{size}}}')
        else:
            ops.append(base + "}")
    return ops


def _descriptors(sched: Schedule, m: AttnMatrix) -> dict[int, tuple]:
    """q_rows, kv_cols and mask of every compute op (cached by block pattern and chunk shape)."""
    o = sched.ops
    allc = np.flatnonzero(o.kind == 0)
    single = (np.diff(o.qc_ptr)[allc] == 1) & (np.diff(o.kvc_ptr)[allc] == 1)
    out = _multi_descriptors(sched, m, allc[~single])
    comp = allc[single]
    qi, kj = o.q_chunks[o.qc_ptr[comp]], o.kv_chunks[o.kvc_ptr[comp]]
    shape = np.stack([m.valid_first, m.valid_count, m.chunks.count], axis=1).reshape(m.n, -1)
    _, cls = np.unique(shape, axis=0, return_inverse=True)
    bits = 1 << np.arange(m.q_involved.shape[2], dtype=np.int64)
    qpat, kpat = (m.q_involved[qi, kj] * bits).sum(axis=1), (m.kv_involved[qi, kj] * bits).sum(axis=1)
    masks = np.where(m.elementwise[qi, kj] | (o.mask[comp] > 0), o.mask[comp], 0)
    cache: dict[tuple, list] = {}
    for op, i, j, qp, kp, ci, cj, mk in zip(comp.tolist(), qi.tolist(), kj.tolist(), qpat.tolist(), kpat.tolist(),
                                            cls.ravel()[qi].tolist(), cls.ravel()[kj].tolist(), masks.tolist()):
        rk, ck = (0, qp, ci), (1, kp, cj)
        if rk not in cache:
            cache[rk] = json.dumps(m.local_ranges(i, m.q_involved[i, j], query=True), separators=(",", ":"))
        if ck not in cache:
            cache[ck] = json.dumps(m.local_ranges(j, m.kv_involved[i, j]), separators=(",", ":"))
        out[op] = (cache[rk], cache[ck], MASKS[mk])
    return out


def _multi_descriptors(sched: Schedule, m: AttnMatrix, ops: np.ndarray) -> dict[int, tuple]:
    """Descriptors of ops over several chunks, computed once per distinct (segments, chunk shapes) pattern."""
    o, out = sched.ops, {}
    if not len(ops):
        return out
    shape = np.stack([m.valid_first, m.valid_count, m.chunks.count], axis=1).reshape(m.n, -1)
    _, cls = np.unique(shape, axis=0, return_inverse=True)
    cls = cls.ravel()
    nq, nk = np.diff(o.qc_ptr)[ops], np.diff(o.kvc_ptr)[ops]
    cache: dict[tuple, tuple] = {}
    for mq, mk in set(zip(nq.tolist(), nk.tolist())):
        sel = ops[(nq == mq) & (nk == mk)]
        qi = o.q_chunks[o.qc_ptr[sel][:, None] + np.arange(mq)]
        kj = o.kv_chunks[o.kvc_ptr[sel][:, None] + np.arange(mk)]
        blocks = (qi[:, :, None], kj[:, None, :])
        qinv, kinv = m.q_involved[blocks].any(axis=2), m.kv_involved[blocks].any(axis=1)
        elem = m.elementwise[blocks].any(axis=(1, 2)) | (m.pairs[blocks] == 0).any(axis=(1, 2))
        sig = np.concatenate([qinv.reshape(len(sel), -1), kinv.reshape(len(sel), -1), cls[qi], cls[kj],
                              m.elementwise[blocks].reshape(len(sel), -1), elem[:, None]], axis=1).astype(np.int64)
        for row, op in zip(sig, sel.tolist()):
            key = (mq, mk, row.tobytes())
            if key not in cache:
                d = m.op_descriptor(o.q_chunks[o.qc_ptr[op]:o.qc_ptr[op + 1]].tolist(),
                                    o.kv_chunks[o.kvc_ptr[op]:o.kvc_ptr[op + 1]].tolist())
                cache[key] = (json.dumps(d["q_rows"], separators=(",", ":")),
                              json.dumps(d["kv_cols"], separators=(",", ":")), d["mask"])
            out[op] = cache[key]
    return out


#: text handed to the compressing thread at a time
COMPRESS_BATCH_BYTES = 4 << 20


def write_schedule(sched: Schedule, path: str | Path) -> Path:
    """Write atomically, streaming; gzip when the name ends in ``.gz``, compressed in a second thread while the
    text is made (zlib releases the GIL: 0.35 s of a 256-rank schedule's 1.35 s off the critical path). Returns the
    path."""
    if not str(path).endswith(".gz"):
        with no_gc():
            return write_atomic(path, (piece.encode() for piece in json_chunks(sched)))

    def encoded():
        pack = zlib.compressobj(1, zlib.DEFLATED, 31)          # wbits 31: the gzip container
        with ThreadPoolExecutor(max_workers=1) as pool:         # one worker: the stream's pieces in order
            pending, batch, size = None, [], 0
            for piece in json_chunks(sched):
                batch.append(piece.encode())
                size += len(batch[-1])
                if size >= COMPRESS_BATCH_BYTES:
                    if pending is not None:
                        yield pending.result()
                    pending, batch, size = pool.submit(pack.compress, b"".join(batch)), [], 0
            if pending is not None:
                yield pending.result()
            yield pack.compress(b"".join(batch)) + pack.flush()

    with no_gc():
        return write_atomic(path, encoded())


def read_schedule(path: str | Path) -> Schedule:
    """Read, validate and convert a schedule file: a file as meshplan writes it a part at a time (the frame, the
    tensors in batches, each rank's ops: :mod:`meshplan.plan.json.read_parts`), each part validated by the same
    pydantic models and converted before the next, so no more than one part's objects exist at once; any other
    file, or one a part of which does not validate, whole (:func:`read_document`, whose errors name the field).

    Raises:
        UserError: unreadable file, another schema version, or a file that does not validate.
    """
    from meshplan.plan.json.read_parts import read_in_parts

    path = Path(path)
    holder = [_read_raw(path)]
    with no_gc():
        sched = read_in_parts(holder)
    if sched is not None:
        return sched
    doc = _validate(holder[0] if holder else _read_raw(path), path)
    with no_gc():
        return from_json(doc)


def read_document(path: str | Path) -> tuple[ScheduleJSON, bytes]:
    """The validated pydantic document of a schedule file and its (decompressed) bytes.

    Raises:
        UserError: unreadable file, another schema version, or a file that does not validate.
    """
    path = Path(path)
    raw = _read_raw(path)
    return _validate(raw, path), raw


def _read_raw(path: Path) -> bytes:
    """The file's (decompressed) bytes, once its ``schema_version`` is this meshplan's.

    Raises:
        UserError: unreadable, a measurement, or another schema version.
    """
    try:
        raw = path.read_bytes()
        if raw[:2] == b"\x1f\x8b":
            raw = gzip.decompress(raw)
        version = _schema_version(raw)
    except (OSError, ValueError, EOFError) as err:
        raise UserError(str(path), f"cannot read the schedule ({type(err).__name__})",
                        "give a .json or .json.gz file written by meshplan") from None
    if version is None and re.match(rb'\s*\{\s*"measurement_version"', raw):
        raise UserError(path.name, "is a measurement (meshplan run --out), not a schedule",
                        "give the schedule that was run; compare takes it first: meshplan compare SCHEDULE "
                        "MEASUREMENT")
    if version != SCHEMA_VERSION:
        raise UserError(f"{path.name}: schema_version", f"is {version!r}, this meshplan reads {SCHEMA_VERSION!r}",
                        "regenerate the schedule with this version (meshplan simulate --out / search --write)")
    return raw


def _validate(raw: bytes, path: Path) -> ScheduleJSON:
    """The whole document validated by the pydantic models.

    Raises:
        UserError: the first validation error, naming its field.
    """
    from pydantic import ValidationError
    try:
        with no_gc():
            return ScheduleJSON.model_validate_json(raw)
    except ValidationError as err:
        first = err.errors(include_url=False)[0]
        if first["type"] == "json_invalid":         # cut short (an interrupted copy) or not JSON at all
            raise UserError(path.name, f"is not valid JSON ({first['msg'].removeprefix('Invalid JSON: ')})",
                            "the file is cut short or corrupted: regenerate it (meshplan simulate --out / "
                            "search --write)") from None
        loc = ".".join(str(p) for p in first["loc"])
        raise UserError(f"{path.name}: {loc}" if loc else path.name, first["msg"],
                        "fix the file or regenerate it") from None


def _schema_version(raw: bytes):
    """The file's ``schema_version``, read before validating the rest (ValueError if not JSON)."""
    m = re.match(rb'\s*\{\s*"schema_version"\s*:\s*("(?:[^"\\]|\\.)*"|[-0-9.]+|null|true|false)', raw)
    if m:
        return json.loads(m.group(1))
    data = json.loads(raw)
    return data.get("schema_version") if isinstance(data, dict) else None


@contextlib.contextmanager
def no_gc():
    """Millions of small objects trigger the cyclic GC again and again; none of them form cycles."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.freeze()  # what survives is long-lived: keep later collections from rescanning it
            gc.enable()


def from_json(doc: ScheduleJSON) -> Schedule:
    """Build the compact Schedule from a validated document."""
    from meshplan.plan.json.frame import assemble, check_ranks, frame
    w, m, streams = frame(doc)
    check_ranks(doc, [r.rank for r in doc.ranks])
    from meshplan.plan.json.to_arrays import op_table, tensor_table
    ops = op_table(doc, streams, m, w)
    tensors = tensor_table(doc, ops.id_map)
    return assemble(doc, w, streams, ops, tensors)


def schema() -> dict[str, Any]:
    """JSON Schema of the Schedule file."""
    return ScheduleJSON.model_json_schema(by_alias=True)

