"""Read a schedule file as meshplan writes it, a part at a time: the frame (every key but ``tensors`` and
``ranks``), the tensors in batches, the ranks' ops in groups — each part read by its records' skeletons
(:mod:`meshplan.plan.json.skeleton`: each distinct record validated once by the pydantic models of
:mod:`meshplan.plan.json.format`, the numbers checked with numpy) or, where that refuses, validated by pydantic
record by record, and converted to arrays (:mod:`meshplan.plan.json.to_arrays`) before the next, so no more than
one part's objects exist at once (a 1024-rank schedule: 0.9M ops and 0.36M tensors, 4.7 GB of objects read whole),
and two processes share the parts of a large file.

The parts are found by the writer's compact layout (:func:`meshplan.plan.json.schedule_text.json_chunks`):
``,"tensors":[`` then ``],"ranks":[`` then one ``{"rank":K,...}`` object per rank, the file ending ``]}``. A JSON
string cannot hold an unescaped quote, so ``{"rank":`` and ``},{"id":`` only occur there as the starts of those
objects; each part is still validated whole as its model, and the frame, the ``[`` … ``]`` around the batches and
the ``,`` between the ranks are checked, so the parts make up exactly the file. Anything else (a file formatted
otherwise, a part that does not validate, a check a part fails) returns None: the caller reads the file whole, whose
errors name the field.
"""

from __future__ import annotations

import numpy as np
from pydantic import TypeAdapter, ValidationError

from meshplan.core.errors import UserError
from meshplan.core.parallel import alongside, shared_counter
from meshplan.core.shared_arena import Arena
from meshplan.model.matrix import attn_matrix
from meshplan.plan.json.format import RankJSON, ScheduleJSON, TensorJSON
from meshplan.plan.schedule import Schedule

#: bytes of tensors validated at once
TENSOR_BATCH_BYTES = 8 << 20
#: bytes of ranks' ops read at once (:func:`meshplan.plan.json.record_columns.rank_columns`)
RANK_GROUP_BYTES = 8 << 20
#: files of this many bytes (decompressed) are read by two processes: forking costs ~10 ms, about a 1 MB part's read
FORK_MIN_BYTES = 16 << 20
_RANK = b'{"rank":'
_NEXT_TENSOR = b'},{"id":'


def read_in_parts(holder: list[bytes]) -> Schedule | None:
    """The Schedule of a file's bytes (``holder[0]``) read a part at a time, or None when they are not laid out as
    meshplan writes them or a part does not validate (read the file whole then). The ranks are read in groups of
    ~:data:`RANK_GROUP_BYTES`, each by its records' skeletons (:mod:`meshplan.plan.json.record_columns`) or, where
    that refuses, rank by rank by pydantic. From :data:`FORK_MIN_BYTES` a forked process
    (:func:`meshplan.core.parallel.alongside`) reads the tensors while this one counts the attention matrix, and
    then both take the next group of ranks until none is left (a 1024-rank Mesh file, 0.9M ops, read by pydantic
    rank by rank: 4.1–4.5 s; now 1.8 s, gunzip included).
    Once every part is read, the bytes are dropped (``holder`` emptied: the file is not held beside its arrays)."""
    from meshplan.plan.json.frame import assemble, check_ranks, workload_streams
    from meshplan.plan.json.record_columns import op_reader, tensor_reader
    from meshplan.plan.json.to_arrays import OpColumns, TensorColumns

    raw = holder[0]
    keys = _keys(raw)
    if keys is None:
        return None
    t_key, r_key, end = keys
    try:
        doc = ScheduleJSON.model_validate_json(raw[:t_key] + b',"tensors":[],"ranks":[]}')
        w, streams = workload_streams(doc)
        groups = _group_bounds(raw, r_key + len(b'],"ranks":['), end - 2)
        fork = len(raw) >= FORK_MIN_BYTES
        next_group = shared_counter(fork)
        ops = OpColumns(streams, w, doc.n_chunks)
        op_read, tensor_read = op_reader(), tensor_reader()

        def read_groups() -> list[tuple[int, list, list]]:
            done = []
            while (g := next_group()) < len(groups):
                done.append((g, *_read_group(raw, *groups[g], ops, op_read, w.n_heads)))
            return done

        arena = Arena(len(raw) if fork else 0)           # the side's columns, handed back in place

        def side():
            try:
                tensors = _read_tensors(raw, t_key + len(b',"tensors":'), r_key + 1, tensor_read)
                return (_narrow(tensors.parts, arena), tensors.count,
                        [(g, _narrow(p, arena), k) for g, p, k in read_groups()])
            except (ValidationError, UserError, _NotLaidOut):
                return None                              # read whole: its error names the field

        got, (m, mine) = alongside(side, lambda: (attn_matrix(w, doc.n_chunks), read_groups()), fork=fork)
        if got is None:
            return None
        raw = None                               # the closures hold the cell: drop the bytes themselves
        holder.clear()
        tensors, t_wide, op_wide = TensorColumns(), set(), set()
        tensors.parts, tensors.count = _widen(got[0], arena, t_wide), got[1]
        theirs = [(g, _widen(p, arena, op_wide), k) for g, p, k in got[2]]
        done = sorted(mine + theirs, key=lambda g: g[0])
        check_ranks(doc, [k for _, _, listed in done for k in listed])
        ops.parts = [p for _, parts, _ in done for p in parts]
        table = ops.table(m, op_wide)
        return assemble(doc, w, streams, table, tensors.table(table.id_map, doc.n_ranks, doc.n_chunks, t_wide))
    except (ValidationError, UserError, _NotLaidOut):
        return None


def _keys(raw: bytes) -> tuple[int, int, int] | None:
    """Where ``,"tensors":[`` and ``],"ranks":[`` start and where the text ends (before trailing white space), or
    None when the bytes are not laid out so."""
    t_key = raw.find(b',"tensors":[')
    r_key = raw.find(b'],"ranks":[', t_key)          # no tensor holds it: its parts would not validate
    end = len(raw)
    while end and raw[end - 1] in b" \t\r\n":        # trailing white space (not a copy of the whole text)
        end -= 1
    return None if t_key < 0 or r_key < t_key or raw[end - 2:end] != b"]}" else (t_key, r_key, end)


def _read_tensors(raw: bytes, start: int, stop: int, reader):
    """The TensorColumns of the tensor array ``raw[start:stop]``, batch by batch by their skeletons or, where that
    refuses, by pydantic.

    Raises:
        ValidationError, UserError: a batch that does not validate; _NotLaidOut: not a bracketed array.
    """
    from meshplan.plan.json.record_columns import tensor_columns
    from meshplan.plan.json.to_arrays import TensorColumns
    tensors, model = TensorColumns(), TypeAdapter(list[TensorJSON])
    for inner in _tensor_batches(raw, start, stop):
        recs = reader.records([inner])
        got = None if recs is None else tensor_columns(recs[0], tensors.count)
        if got is not None:
            tensors.add_columns(got)
        else:
            tensors.add(model.validate_json(b"[" + bytes(inner) + b"]"))
    return tensors


def _narrow(parts: list[dict], arena: Arena) -> list[dict]:
    """``parts``' columns copied into ``arena`` for the parent (:func:`_widen`), each int64 column whose values fit in
    int32 made int32 there (half the bytes): [{name: (place, narrowed)}]."""
    out = []
    for p in parts:
        got = {}
        for k, v in p.items():
            narrow = v.dtype == np.int64 and len(v) and -2**31 <= v.min() and v.max() < 2**31
            got[k] = (arena.put(v, np.int32 if narrow else None), bool(narrow))
        out.append(got)
    return out


def _widen(parts: list[dict], arena: Arena, wide: set[str]) -> list[dict]:
    """The columns :func:`_narrow` put in ``arena``, read in place; the names of those made int32 added to ``wide``
    (to be int64 again when joined: ``OpColumns.table``, ``TensorColumns.table``)."""
    out = []
    for p in parts:
        out.append({k: arena.get(place) for k, (place, _) in p.items()})
        wide.update(k for k, (_, narrowed) in p.items() if narrowed)
    return out


def _read_group(raw: bytes, start: int, stop: int, ops, reader, n_heads: int) -> tuple[list, list[int]]:
    """(the op columns, the ranks stated) of a group of whole ranks' objects ``raw[start:stop]``: by their
    skeletons, else rank by rank by pydantic.

    Raises:
        ValidationError, UserError: a rank that does not validate; _NotLaidOut: not rank objects.
    """
    from meshplan.plan.json.record_columns import rank_columns
    texts = list(_rank_objects(raw, start, stop))
    got = rank_columns(reader, texts, ops.stream_idx, n_heads, ops.n_chunks)
    if got is not None:
        return [got[0]], got[1]
    parts, listed, model = [], [], TypeAdapter(RankJSON)
    for one in texts:
        rank = model.validate_json(bytes(one))
        listed.append(rank.rank)
        parts.append(ops.columns(rank.ops, rank.rank))
    return parts, listed


def _group_bounds(raw: bytes, start: int, stop: int) -> list[tuple[int, int]]:
    """[start, stop) byte ranges of consecutive rank objects in ``raw[start:stop]``, ~:data:`RANK_GROUP_BYTES`
    each, cut before a ``,{"rank":``."""
    bounds = []
    while start < stop:
        cut = raw.find(b',{"rank":', start + RANK_GROUP_BYTES, stop)
        if cut < 0:
            cut = stop
        bounds.append((start, cut))
        start = cut + 1
    return bounds


class _NotLaidOut(Exception):
    """The bytes are not laid out as meshplan writes them."""


def _tensor_batches(raw: bytes, start: int, stop: int):
    """The contents (between ``[`` and ``]``, views of ``raw``: no copy) of batches of ~:data:`TENSOR_BATCH_BYTES` of
    the tensor array ``raw[start:stop]``."""
    if raw[start:start + 1] != b"[" or raw[stop - 1:stop] != b"]":
        raise _NotLaidOut
    view, pos = memoryview(raw), start + 1
    while pos < stop - 1:
        cut = raw.find(_NEXT_TENSOR, pos + TENSOR_BATCH_BYTES, stop)
        if cut < 0:
            yield view[pos:stop - 1]
            return
        yield view[pos:cut + 1]
        pos = cut + 2                                   # past the "},"


def _rank_objects(raw: bytes, start: int, stop: int):
    """Each ``{"rank":K,...}`` object of the rank array's contents ``raw[start:stop]``, comma-separated, as a view of
    ``raw`` (no copy)."""
    if start == stop:
        return
    if raw[start:start + len(_RANK)] != _RANK:
        raise _NotLaidOut
    view, pos = memoryview(raw), start
    while True:
        nxt = raw.find(_RANK, pos + len(_RANK), stop)
        if nxt < 0:
            yield view[pos:stop]
            return
        if raw[nxt - 1:nxt] != b",":
            raise _NotLaidOut
        yield view[pos:nxt - 1]
        pos = nxt
