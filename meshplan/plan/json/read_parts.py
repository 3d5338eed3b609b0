"""Read a schedule file as meshplan writes it, a part at a time: the frame (every key but ``tensors`` and
``ranks``), the tensors in batches, each rank's ops — each part validated by the pydantic models of
:mod:`meshplan.plan.json.format` and converted to arrays (:mod:`meshplan.plan.json.to_arrays`) before the next, so
no more than one part's objects exist at once (a 1024-rank schedule: 0.9M ops and 0.36M tensors, 4.7 GB of objects
read whole), and two processes share the parts of a large file.

The parts are found by the writer's compact layout (:func:`meshplan.plan.json.schedule_text.json_chunks`):
``,"tensors":[`` then ``],"ranks":[`` then one ``{"rank":K,...}`` object per rank, the file ending ``]}``. A JSON
string cannot hold an unescaped quote, so ``{"rank":`` and ``},{"id":`` only occur there as the starts of those
objects; each part is still validated whole as its model, and the frame, the ``[`` … ``]`` around the batches and
the ``,`` between the ranks are checked, so the parts make up exactly the file. Anything else (a file formatted
otherwise, a part that does not validate, a check a part fails) returns None: the caller reads the file whole, whose
errors name the field.
"""

from __future__ import annotations

from pydantic import TypeAdapter, ValidationError

from meshplan.core.errors import UserError
from meshplan.core.parallel import alongside
from meshplan.model.matrix import attn_matrix
from meshplan.plan.json.format import RankJSON, ScheduleJSON, TensorJSON
from meshplan.plan.schedule import Schedule

#: bytes of tensors validated at once
TENSOR_BATCH_BYTES = 8 << 20
#: files of this many bytes (decompressed) are read by two processes: forking costs ~10 ms, about a 1 MB part's read
FORK_MIN_BYTES = 16 << 20
_RANK = b'{"rank":'
_NEXT_TENSOR = b'},{"id":'


def read_in_parts(holder: list[bytes]) -> Schedule | None:
    """The Schedule of a file's bytes (``holder[0]``) read a part at a time, or None when they are not laid out as
    meshplan writes them or a part does not validate (read the file whole then). From :data:`FORK_MIN_BYTES` a
    forked process (:func:`meshplan.core.parallel.alongside`) reads the tensors and the last third of the ranks
    while this one counts the attention matrix and reads the first two thirds (measured back to back: the main job's
    256-rank file 3.3–6.0 s → 2.9–3.4 s, a 1024-rank Mesh file 8.4–11.5 s → 7.7–8.3 s against 40% here). Once every
    part is read, the bytes are dropped (``holder`` emptied: the file is not held beside its arrays)."""
    from meshplan.plan.json.frame import assemble, check_ranks, workload_streams
    from meshplan.plan.json.to_arrays import OpColumns, TensorColumns

    raw = holder[0]
    t_key, r_key = raw.find(b',"tensors":['), raw.rfind(b'],"ranks":[')
    end = len(raw.rstrip())
    if t_key < 0 or r_key < t_key or raw[end - 2:end] != b"]}":
        return None
    try:
        doc = ScheduleJSON.model_validate_json(raw[:t_key] + b',"tensors":[],"ranks":[]}')
        w, streams = workload_streams(doc)
        ranks = list(_rank_objects(raw, r_key + len(b'],"ranks":['), end - 2))
        half = len(ranks) * 2 // 3                 # the tensors cost the other process ~1.7x a byte of ops

        def read_ranks(part: list, first: int) -> tuple[list, list]:
            ops, listed, model = OpColumns(streams, w, doc.n_chunks, first), [], TypeAdapter(RankJSON)
            for text in part:
                rank = model.validate_json(text)
                listed.append(rank.rank)
                ops.add_rank(rank.ops)
            return ops.parts, listed

        def side():
            try:
                tensors, model = TensorColumns(), TypeAdapter(list[TensorJSON])
                for text in _tensor_batches(raw, t_key + len(b',"tensors":'), r_key + 1):
                    tensors.add(model.validate_json(text))
                return tensors, read_ranks(ranks[half:], half)
            except (ValidationError, UserError, _NotLaidOut):
                return None                              # read whole: its error names the field

        def main():
            return attn_matrix(w, doc.n_chunks), read_ranks(ranks[:half], 0)

        got, (m, (first, listed)) = alongside(side, main, fork=len(raw) >= FORK_MIN_BYTES)
        if got is None:
            return None
        raw = ranks = None                       # the closures hold the cells: drop the bytes themselves
        holder.clear()
        tensors, (second, more) = got
        check_ranks(doc, listed + more)
        ops = OpColumns(streams, w, doc.n_chunks)
        ops.parts = first + second
        table = ops.table(m)
        return assemble(doc, w, streams, table, tensors.table(table.id_map, doc.n_ranks, doc.n_chunks))
    except (ValidationError, UserError, _NotLaidOut):
        return None


class _NotLaidOut(Exception):
    """The bytes are not laid out as meshplan writes them."""


def _tensor_batches(raw: bytes, start: int, stop: int):
    """``[`` … ``]`` batches of ~:data:`TENSOR_BATCH_BYTES` of the tensor array ``raw[start:stop]``."""
    if raw[start:start + 1] != b"[" or raw[stop - 1:stop] != b"]":
        raise _NotLaidOut
    pos = start + 1
    while pos < stop - 1:
        cut = raw.find(_NEXT_TENSOR, pos + TENSOR_BATCH_BYTES, stop)
        if cut < 0:
            yield b"[" + raw[pos:stop - 1] + b"]"
            return
        yield b"[" + raw[pos:cut + 1] + b"]"
        pos = cut + 2                                   # past the "},"


def _rank_objects(raw: bytes, start: int, stop: int):
    """Each ``{"rank":K,...}`` object of the rank array's contents ``raw[start:stop]``, comma-separated."""
    if start == stop:
        return
    if raw[start:start + len(_RANK)] != _RANK:
        raise _NotLaidOut
    pos = start
    while True:
        nxt = raw.find(_RANK, pos + len(_RANK), stop)
        if nxt < 0:
            yield raw[pos:stop]
            return
        if raw[nxt - 1:nxt] != b",":
            raise _NotLaidOut
        yield raw[pos:nxt - 1]
        pos = nxt
