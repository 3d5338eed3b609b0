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

import bisect

import numpy as np
from pydantic import TypeAdapter, ValidationError

from meshplan.core.errors import UserError
from meshplan.core.gzip_members import INFLATE_ERRORS, MemberText
from meshplan.core.parallel import SharedOnce, alongside, shared_counter
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


def read_in_parts(holder: list) -> Schedule | None:
    """The Schedule of a file's text (``holder[0]``: bytes, or a :class:`~meshplan.core.gzip_members.MemberText`
    inflated as it is read) read a part at a time, or None when it is not laid out as meshplan writes it, a part
    does not validate or a member does not inflate (read the file whole then). The ranks are read in groups of
    ~:data:`RANK_GROUP_BYTES`, each by its records' skeletons (:mod:`meshplan.plan.json.record_columns`) or, where
    that refuses, rank by rank by pydantic. From :data:`FORK_MIN_BYTES` a forked process
    (:func:`meshplan.core.parallel.alongside`) reads the tensors while this one counts the attention matrix, and
    then both take the next group of ranks until none is left — of a ``MemberText``, each process inflating the
    members of the groups it takes (:class:`_MemberGroups`), the frame and tensors having been inflated first (a
    1024-rank Mesh file, 0.9M ops, read by pydantic rank by rank: 4.1–4.5 s; now ~1.9 s, inflating included).
    Once every part is read, the text is dropped (``holder`` emptied: the file is not held beside its arrays)."""
    raw = holder[0]
    try:
        keys = _keys(raw)
        read = None if keys is None else _Parts(raw, *keys)
        if read is None:
            return None
        got, (m, mine) = alongside(read.side, lambda: (attn_matrix(read.w, read.doc.n_chunks), read.read_groups()),
                                   fork=read.fork)
        if got is None:
            return None
        raw = None                                       # the text goes: its pages serve the arrays now
        read.drop_text()
        holder.clear()
        return read.assemble(got, m, mine)
    except (ValidationError, UserError, _NotLaidOut, *INFLATE_ERRORS):
        return None                                      # read whole: its error names the field or the damage


class _Parts:
    """One reading of a file's text by parts (:func:`read_in_parts`): its frame, where its parts are, and the work
    both processes share — :meth:`side` (the tensors, then groups of ranks) there, :meth:`read_groups` here — then
    :meth:`assemble` here. After a fork each process holds its own copy (its groups, its inflated members).

    Raises (on construction):
        ValidationError: a frame that does not validate.
    """

    def __init__(self, raw, t_key: int, r_key: int | None, end: int) -> None:
        from meshplan.plan.json.frame import workload_streams
        from meshplan.plan.json.record_columns import op_reader, tensor_reader
        from meshplan.plan.json.to_arrays import OpColumns

        self.member_text = raw if isinstance(raw, MemberText) else None
        self.raw = raw if self.member_text is None else raw.text    # inflated where read: the frame now
        self.t_key, self.r_key, self.end = t_key, r_key, end
        self.doc = ScheduleJSON.model_validate_json(self.raw[:t_key] + b',"tensors":[],"ranks":[]}')
        self.w, self.streams = workload_streams(self.doc)
        self.fork = len(raw) >= FORK_MIN_BYTES
        self.next_group = shared_counter(self.fork)
        self.ranks_at = SharedOnce(self.fork) if r_key is None else None    # where the side finds the ranks' key
        self.arena = Arena(len(raw) if self.fork else 0)         # the side's columns, handed back in place
        self.ops = OpColumns(self.streams, self.w, self.doc.n_chunks)
        self.op_read, self.tensor_read = op_reader(), tensor_reader()
        self._groups = None                                     # this process's (made after a fork)

    def groups(self):
        """The groups of ranks, [start, stop) each (:func:`_group_bounds`, :class:`_MemberGroups`)."""
        if self._groups is None:
            key = self.r_key if self.ranks_at is None else self.ranks_at.wait()
            start, stop = key + len(b'],"ranks":['), self.end - 2
            self._groups = [] if key < self.t_key else _group_bounds(self.raw, start, stop) \
                if self.member_text is None else _MemberGroups(self.member_text, start, stop)
        return self._groups

    def read_groups(self) -> list[tuple[int, list, list]]:
        """[(group, its op columns, the ranks it states)] of the groups this process takes until none is left."""
        done, mine = [], self.groups()
        while (g := self.next_group()) < len(mine):
            done.append((g, *_read_group(self.raw, *mine[g], self.ops, self.op_read, self.w.n_heads)))
        return done

    def side(self):
        """The forked side: the tensors (their members inflated here, beside the matrix there), then groups —
        its columns in the arena (:func:`_narrow`) —, or None where a part does not read (read whole then)."""
        try:
            key = self.r_key
            if self.ranks_at is not None:
                key = -1
                try:
                    key = self.member_text.find(b'],"ranks":[', self.t_key, ahead=2)
                finally:
                    self.ranks_at.set(key)
                if key < self.t_key:
                    return None                          # not laid out so
            tensors = _read_tensors(self.raw, self.t_key + len(b',"tensors":'), key + 1, self.tensor_read)
            return (_narrow(tensors.parts, self.arena), tensors.count,
                    [(g, _narrow(p, self.arena), k) for g, p, k in self.read_groups()])
        except (ValidationError, UserError, _NotLaidOut, *INFLATE_ERRORS):
            return None

    def drop_text(self) -> None:
        """Let the text go: the arrays are not held beside it."""
        self.raw = self.member_text = self._groups = None

    def assemble(self, got, m, mine) -> Schedule:
        """The Schedule of the side's answer ``got``, the matrix ``m`` and this process's groups ``mine``.

        Raises:
            UserError: ranks not 0..n−1, ids or references that do not hold (:mod:`meshplan.plan.json.to_arrays`).
        """
        from meshplan.plan.json.frame import assemble, check_ranks
        from meshplan.plan.json.to_arrays import TensorColumns

        tensors, t_wide, op_wide = TensorColumns(), set(), set()
        tensors.parts, tensors.count = _widen(got[0], self.arena, t_wide), got[1]
        theirs = [(g, _widen(p, self.arena, op_wide), k) for g, p, k in got[2]]
        done = sorted(mine + theirs, key=lambda g: g[0])
        check_ranks(self.doc, [k for _, _, listed in done for k in listed])
        self.ops.parts = [p for _, parts, _ in done for p in parts]
        table = self.ops.table(m, op_wide)
        return assemble(self.doc, self.w, self.streams, table,
                        tensors.table(table.id_map, self.doc.n_ranks, self.doc.n_chunks, t_wide))


def _keys(raw) -> tuple[int, int | None, int] | None:
    """Where ``,"tensors":[`` and ``],"ranks":[`` start and where the text ends (before trailing white space), or
    None when the text is not laid out so. Of a :class:`~meshplan.core.gzip_members.MemberText`, the ranks' key is
    None — found by the process that reads the tensors, inflating them — and only the frame's member and the last
    are inflated here."""
    lazy = isinstance(raw, MemberText)
    text = raw.text if lazy else raw
    t_key = raw.find(b',"tensors":[', 0)
    r_key = None if lazy else raw.find(b'],"ranks":[', t_key)     # no tensor holds it: its parts would not validate
    end = len(raw)
    while True:                                      # trailing white space (not a copy of the whole text)
        if lazy:
            raw.ensure(max(end - 2, 0), end)
        if not (end and text[end - 1] in b" \t\r\n"):
            break
        end -= 1
    bad = t_key < 0 or (r_key is not None and r_key < t_key) or text[end - 2:end] != b"]}"
    return None if bad else (t_key, r_key, end)


class _MemberGroups:
    """:func:`_group_bounds` of a text inflated as it is read, each group found and inflated by the process that
    reads it: groups start at the members ~:data:`RANK_GROUP_BYTES` apart after the one holding ``start`` (the
    first group at ``start``), each cut before the first ``,{"rank":`` at or after its first member's start — so
    every group is whole ranks, and a group with no rank's start in it is empty."""

    def __init__(self, raw: MemberText, start: int, stop: int) -> None:
        self.raw, self.start, self.stop = raw, start, stop
        at = raw.member_starts
        step = max(1, round(RANK_GROUP_BYTES / max(at[1] - at[0], 1)))
        self.bases = [at[k] for k in range(bisect.bisect_right(at, start), len(at) - 1, step) if at[k] < stop]

    def __len__(self) -> int:
        return len(self.bases) + 1

    def _cut(self, u: int) -> int:
        if u == 0:
            return self.start - 1
        if u > len(self.bases):
            return self.stop
        got = self.raw.find(b',{"rank":', self.bases[u - 1], self.stop)
        return self.stop if got < 0 else got

    def __getitem__(self, g: int) -> tuple[int, int]:
        """[start, stop) of group ``g`` (empty where start >= stop), inflated."""
        start, stop = self._cut(g) + 1, self._cut(g + 1)
        if start < stop:
            self.raw.ensure(start, stop)
        return start, stop


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
    if start >= stop:
        return [], []                                    # a group with no rank's start (a rank larger than it)
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
