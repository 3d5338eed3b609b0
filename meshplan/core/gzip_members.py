"""Gzip files of members that state their sizes (as BGZF does), written in parallel and inflated in two threads.

A member of :func:`gzip_member` carries its size in its header's extra field, so a reader finds every member without
inflating any (:func:`member_spans`) and inflates them on two threads (:func:`gunzip`); any gzip reader reads a file
of such members as one. Deflate is ISA-L's (``isal``) where installed — the same streams as zlib's, ~3x as fast to
write at its level 2, ~2x to read — else zlib's.
"""

from __future__ import annotations

import bisect
import gzip
import itertools
import mmap
import struct
import zlib
from concurrent.futures import ThreadPoolExecutor

try:                 # ISA-L: the same deflate streams as zlib's, ~3x as fast to write, ~2x to read (x86 and Arm)
    from isal import isal_zlib as _deflate
except ImportError:                                   # a platform without its wheel: zlib, the same files
    _deflate = zlib

#: a member's header: gzip magic, deflate, FEXTRA; then (after mtime, xfl, os) an 8-byte extra field holding one
#: subfield ``MP`` of 4 bytes, the member's size
_MEMBER_MAGIC, _MEMBER_EXTRA = b"\x1f\x8b\x08\x04", b"\x08\x00MP\x04\x00"
_MEMBER_HEAD_BYTES = 20
#: deflate inflates at most ~1032 bytes per byte: a member stating more is not read by its stated size
_MAX_RATIO = 1032
#: the deflate level: ISA-L's 2 (0..3) makes members as small as zlib's 1 (a 4 MB part: 6.6 ms vs 22.7 ms)
_LEVEL = 2 if _deflate is not zlib else 1


def gzip_member(text: bytes) -> bytes:
    """``text`` as one gzip member (RFC 1952, deflate at ISA-L's level 2 — as small as zlib's level 1, ~3x as fast —
    or zlib's level 1 where ISA-L is not installed) whose header's extra field ``MP`` states the member's size in
    bytes (little-endian uint32), as BGZF does: a reader finds every member without inflating any and inflates them
    on two threads (:func:`gunzip`). Any gzip reader reads a file of such members as one."""
    body = _deflate.compress(text, _LEVEL, wbits=-15)
    size = _MEMBER_HEAD_BYTES + len(body) + 8
    head = _MEMBER_MAGIC + b"\0\0\0\0\0\xff" + _MEMBER_EXTRA + struct.pack("<I", size)
    return head + body + struct.pack("<II", _deflate.crc32(text), len(text) & 0xFFFFFFFF)


def gunzip(data: bytes) -> bytes | bytearray | mmap.mmap:
    """The text of gzip ``data``: members written by :func:`gzip_member` inflated on two threads (half the members
    each: :meth:`MemberText.whole`; ISA-L's inflate where installed, else zlib's) straight into one buffer (a
    1024-rank file's 290 MB: 0.55 s on one thread with zlib, 0.3 s on two, 0.17 s with ISA-L), any other gzip file
    by :func:`gzip.decompress`.

    Raises:
        OSError, EOFError, zlib.error: not gzip, or cut short or corrupted (as :func:`gzip.decompress` raises).
    """
    layout = member_layout(data)
    if layout is None:
        return gzip.decompress(data)                 # not such members, or sizes deflate cannot reach
    try:
        return MemberText(data, layout).whole()
    except INFLATE_ERRORS:
        return gzip.decompress(data)                 # the error gzip names


def member_layout(data: bytes) -> tuple[list[tuple[int, int]], list[int], list[int]] | None:
    """(each member's [start, stop) in ``data``, where each member's text starts in the whole text — the whole's
    length last —, each member's ISIZE) of a file of two or more members of :func:`gzip_member`, or None (another
    gzip file, or sizes deflate cannot reach)."""
    spans = member_spans(data)
    sizes = [struct.unpack_from("<I", data, b - 4)[0] for _, b in spans or []]     # each member's ISIZE
    if spans is None or len(spans) < 2 or any(n > _MAX_RATIO * (b - a) for n, (a, b) in zip(sizes, spans)):
        return None
    return spans, [0, *itertools.accumulate(sizes)], sizes


class MemberText:
    """The text of a file of members of :func:`gzip_member`, inflated into one buffer (:attr:`text`) a member at a
    time as it is read: a reader asks for the part it reads (:meth:`ensure`, :meth:`find`) and a member is inflated
    once per process — after a fork, each process inflates the members of its own parts, beside the other (a
    1024-rank schedule's 217 MB of ranks: 0.25 s on one core before the reading, otherwise). The buffer's pages are
    faulted in only where a member is inflated.

    Raises (:meth:`ensure`, :meth:`find`):
        zlib.error (or ISA-L's): a member that does not inflate whole to its stated size.
    """

    def __init__(self, data: bytes, layout) -> None:
        self._data = data
        self._spans, self._at, self._sizes = layout
        self.text = untouched_buffer(self._at[-1])
        self._done = bytearray(len(self._spans))

    def __len__(self) -> int:
        return self._at[-1]

    @property
    def member_starts(self) -> list[int]:
        """Where each member's text starts in the whole, the whole's length last."""
        return self._at

    def head(self) -> memoryview:
        """The first member's text (inflated)."""
        self.ensure(0, self._at[1])
        return memoryview(self.text)[:self._at[1]]

    def ensure(self, start: int, stop: int) -> None:
        """Inflate every member that holds text of [``start``, ``stop``) and is not yet (in this process); two or more
        on two threads."""
        first = max(bisect.bisect_right(self._at, start) - 1, 0)
        last = min(bisect.bisect_left(self._at, stop), len(self._spans))
        todo = [k for k in range(first, last) if not self._done[k]]
        if len(todo) > 1:
            half = len(todo) // 2
            with ThreadPoolExecutor(max_workers=1) as pool:
                second = pool.submit(self._inflate_members, todo[half:])
                self._inflate_members(todo[:half])
                second.result()
        else:
            self._inflate_members(todo)

    def _inflate_members(self, members: list[int]) -> None:
        """Inflate each member of ``members`` into the buffer at its text's place, its CRC and length checked.

        Raises:
            zlib.error (or ISA-L's): a member that is not one whole gzip stream of its stated size.
        """
        for k in members:
            (a, b), start, size = self._spans[k], self._at[k], self._sizes[k]
            member = _deflate.decompressobj(31)
            text = member.decompress(self._data[a:b])
            if not member.eof or member.unused_data or len(text) != size:
                raise zlib.error("a member is not one whole gzip stream")
            self.text[start:start + size] = text
            self._done[k] = 1

    def find(self, pattern: bytes, start: int, stop: int | None = None, ahead: int = 1) -> int:
        """The first ``pattern`` in the text from ``start`` (before ``stop``; −1: none), inflating members from the
        one holding ``start`` as the search goes, ``ahead`` at a time (two or more: on two threads), and the next
        only for a match across their boundary."""
        stop = len(self) if stop is None else stop
        k = max(bisect.bisect_right(self._at, start) - 1, 0)
        while start < stop and k < len(self._spans):
            end = min(self._at[min(k + ahead, len(self._spans))], stop)
            self.ensure(start, end)
            got = self.text.find(pattern, start, end)
            if got >= 0:
                return got
            across = max(start, end - len(pattern) + 1)
            if end < stop:                           # a match that begins here and ends in the next member
                self.ensure(end, min(end + len(pattern) - 1, stop))
                got = self.text.find(pattern, across, min(end + len(pattern) - 1, stop))
                if got >= 0:
                    return got
            start, k = end, k + ahead
        return -1

    def whole(self) -> bytearray | mmap.mmap:
        """The whole text (the buffer itself, not a copy), every member inflated."""
        self.ensure(0, len(self))
        return self.text


def untouched_buffer(size: int) -> bytearray | mmap.mmap:
    """A writable buffer of ``size`` bytes whose pages are not touched until written: a bytearray made by CPython's
    ``PyByteArray_FromStringAndSize(NULL, size)`` (``bytearray(size)`` zeroes every page at once: 0.12 s for 290
    MB here) — from the heap, so its pages serve later arrays once it is freed — or, off CPython, a private
    anonymous mapping. After a fork, each process's writes to pages not written before land on pages of its own,
    never copied. Its bytes not yet written are undefined: a reader writes before it reads."""
    try:
        import ctypes
        make = ctypes.pythonapi.PyByteArray_FromStringAndSize
        make.restype, make.argtypes = ctypes.py_object, [ctypes.c_void_p, ctypes.c_ssize_t]
        return make(None, size)
    except (ImportError, AttributeError):           # not CPython
        return mmap.mmap(-1, max(size, 1), flags=mmap.MAP_PRIVATE)


#: what inflating a member raises where it is not whole (zlib's error, or ISA-L's)
INFLATE_ERRORS = (zlib.error, _deflate.error)


def text_of(data: bytes) -> MemberText | bytes | bytearray:
    """A gzip file's text: a :class:`MemberText` to be inflated as it is read where it is a file of members of
    :func:`gzip_member`, else :func:`gunzip`'s.

    Raises:
        OSError, EOFError, zlib.error: as :func:`gunzip`.
    """
    layout = member_layout(data)
    return gunzip(data) if layout is None else MemberText(data, layout)


def member_spans(data: bytes) -> list[tuple[int, int]] | None:
    """[start, stop) of each member of ``data`` by the sizes their headers state, or None where one has none."""
    spans, pos = [], 0
    while pos < len(data):
        if data[pos:pos + 4] != _MEMBER_MAGIC or data[pos + 10:pos + 16] != _MEMBER_EXTRA:
            return None
        size = struct.unpack_from("<I", data, pos + 16)[0]
        if size < _MEMBER_HEAD_BYTES + 8 or pos + size > len(data):
            return None
        spans.append((pos, pos + size))
        pos += size
    return spans
