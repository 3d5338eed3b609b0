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
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from meshplan.core.errors import UserError
from meshplan.core.fileio import write_atomic
from meshplan.core.gzip_members import INFLATE_ERRORS, MemberText, gunzip, gzip_member, text_of
from meshplan.plan.json.format import ScheduleJSON
from meshplan.plan.json.schedule_text import json_chunks
from meshplan.plan.schedule import SCHEMA_VERSION, Schedule


def to_json_text(sched: Schedule) -> str:
    """The Schedule as JSON text (the contract's skeleton), laid out column-wise for speed."""
    return to_json_bytes(sched).decode()


def to_json_bytes(sched: Schedule) -> bytes:
    """:func:`to_json_text` as UTF-8 bytes (what a file holds)."""
    return b"".join(json_chunks(sched))


def to_json_dict(sched: Schedule) -> dict[str, Any]:
    """The Schedule as JSON-ready Python objects."""
    return json.loads(to_json_text(sched))


#: text in one gzip member (:func:`gzip_member`)
COMPRESS_BATCH_BYTES = 4 << 20


def write_schedule(sched: Schedule, path: str | Path) -> Path:
    """Write atomically, streaming; gzip when the name ends in ``.gz``: a member per
    :data:`COMPRESS_BATCH_BYTES` of text (:func:`gzip_member`), compressed in two threads while the text is made
    (zlib releases the GIL: a 256-rank schedule's 0.35 s of gzip beside its 0.7 s of text). Returns the path."""
    if not str(path).endswith(".gz"):
        with no_gc():
            return write_atomic(path, json_chunks(sched))

    def encoded():
        with ThreadPoolExecutor(max_workers=2) as pool:         # results taken in order: the members in order
            pending = []
            for text in _batches(json_chunks(sched), COMPRESS_BATCH_BYTES):
                if len(pending) == 2:
                    yield pending.pop(0).result()
                pending.append(pool.submit(gzip_member, text))
            for job in pending:
                yield job.result()

    with no_gc():
        return write_atomic(path, encoded())


def _batches(pieces, size: int):
    """The bytes of ``pieces`` cut into runs of ``size`` (the last shorter; one empty run for no bytes)."""
    batch, held, cut = [], 0, False
    for piece in pieces:
        view = memoryview(piece)
        while len(view):
            take = view[:size - held]
            batch.append(take)
            held += len(take)
            view = view[len(take):]
            if held == size:
                yield b"".join(batch)
                batch, held, cut = [], 0, True
    if batch or not cut:
        yield b"".join(batch)


def read_schedule(path: str | Path) -> Schedule:
    """Read, validate and convert a schedule file: a file as meshplan writes it a part at a time (the frame, the
    tensors in batches, each rank's ops: :mod:`meshplan.plan.json.read_parts`), each part validated by the same
    pydantic models and converted before the next, so no more than one part's objects exist at once; any other
    file, or one a part of which does not validate, whole (:func:`read_document`, whose errors name the field). A
    file of sized gzip members is inflated as it is read (:class:`meshplan.core.gzip_members.MemberText`).

    Raises:
        UserError: unreadable file, another schema version, or a file that does not validate.
    """
    from meshplan.plan.json.read_parts import read_in_parts

    path = Path(path)
    holder = [_read_raw(path, as_read=True)]
    with no_gc():
        sched = read_in_parts(holder)
    if sched is not None:
        return sched
    raw = holder[0] if holder else _read_raw(path)
    if isinstance(raw, MemberText):
        with _read_errors(path):
            raw = raw.whole()
    doc = _validate(raw, path)
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


def _read_raw(path: Path, as_read: bool = False):
    """The file's (decompressed) bytes, once its ``schema_version`` is this meshplan's; with ``as_read``, a file of
    sized gzip members as a :class:`~meshplan.core.gzip_members.MemberText`, inflated as it is read.

    Raises:
        UserError: unreadable, a measurement, or another schema version.
    """
    with _read_errors(path):
        raw = path.read_bytes()
        if raw[:2] == b"\x1f\x8b":
            raw = text_of(raw) if as_read else gunzip(raw)
        head = raw.head() if isinstance(raw, MemberText) else raw
        version = _schema_version(head, raw)
    if version is None and re.match(rb'\s*\{\s*"measurement_version"', head):
        raise UserError(str(path), "is a measurement (meshplan run --out), not a schedule",
                        "give the schedule that was run; compare takes it first: meshplan compare SCHEDULE "
                        "MEASUREMENT")
    if version != SCHEMA_VERSION:
        raise UserError(f"{path}: schema_version", f"is {version!r}, this meshplan reads {SCHEMA_VERSION!r}",
                        "regenerate the schedule with this version (meshplan simulate --out / search --write)")
    return raw


@contextlib.contextmanager
def _read_errors(path: Path):
    """Reading or inflating ``path``'s text: its errors as one-line UserErrors.

    Raises:
        UserError: no such file, a gzip stream cut short or damaged, or unreadable (a directory, no permission).
    """
    try:
        yield
    except FileNotFoundError:
        raise UserError(str(path), "no such file", "give the path of a schedule (meshplan simulate --out, "
                        "search --write)") from None
    except (EOFError, *INFLATE_ERRORS):                 # a gzip stream cut short or damaged
        raise UserError(str(path), "the compressed file is cut short or corrupted", "regenerate it") from None
    except (OSError, ValueError) as err:
        why = getattr(err, "strerror", None) or type(err).__name__        # "Is a directory", "Permission denied"
        raise UserError(str(path), f"cannot read the schedule ({why})",
                        "give a .json or .json.gz file written by meshplan") from None


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
            raise UserError(str(path), f"is not valid JSON ({first['msg'].removeprefix('Invalid JSON: ')})",
                            "the file is cut short or corrupted: regenerate it (meshplan simulate --out / "
                            "search --write)") from None
        loc = ".".join(str(p) for p in first["loc"])
        raise UserError(f"{path}: {loc}" if loc else str(path), first["msg"],
                        "fix the file or regenerate it") from None


#: how much of a schedule file :func:`schedule_ranks` reads (the header: a 1024-rank file's is ~60 KB)
HEADER_BYTES = 4 << 20


def schedule_ranks(path: str | Path) -> int | None:
    """The ``n_ranks`` a schedule file's header states, from its first :data:`HEADER_BYTES` (decompressed) alone —
    not the whole file, not validated: a check before the file is read, not a substitute for it. None when it cannot
    tell (an unreadable file, a header laid out otherwise or longer): the full read then says why."""
    try:
        with open(path, "rb") as fh:
            gz = fh.read(2) == b"\x1f\x8b"
        with (gzip.open(path, "rb") if gz else open(path, "rb")) as fh:
            head = fh.read(HEADER_BYTES)
    except (OSError, EOFError):
        return None
    end = head.find(b'"tensors"')
    m = re.search(rb'"n_ranks"\s*:\s*(\d+)', head[:end]) if end >= 0 else None
    return int(m.group(1)) if m else None


def _schema_version(head, raw):
    """The file's ``schema_version``, read from its ``head`` before validating the rest, else from the whole ``raw``
    (ValueError if not JSON)."""
    m = re.match(rb'\s*\{\s*"schema_version"\s*:\s*("(?:[^"\\]|\\.)*"|[-0-9.]+|null|true|false)', head)
    if m:
        return json.loads(m.group(1))
    data = json.loads(bytes(raw.whole() if isinstance(raw, MemberText) else raw))
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

