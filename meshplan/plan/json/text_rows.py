"""JSON text of many rows at once, column by column: a row is a sequence of pieces — literal text, an integer, a
list of integers, a choice from a table of strings — each present in the rows its mask selects, so one
:class:`Rows` holds rows of several shapes (a schedule's send, compute and merge ops). The bytes of every row are
laid out with numpy (lengths, offsets, then each piece scattered into one buffer), with no Python code per row:
a 256-rank schedule's 126 MB of text in a fraction of the time f-strings take (``docs/speed.md``).
"""

from __future__ import annotations

import numpy as np

_DIGITS = np.frombuffer(b"0123456789", dtype=np.uint8)
_MAX_DIGITS = 19          # int64


def _n_digits(v: np.ndarray) -> np.ndarray:
    """Decimal digits of each non-negative integer (1 for 0)."""
    n = np.ones(len(v), dtype=np.int64)
    bound = 10
    for _ in range(_MAX_DIGITS - 1):
        more = v >= bound
        if not more.any():
            break
        n += more
        bound *= 10
    return n


class Rows:
    """Text rows built piece by piece (module docstring). Every piece takes ``mask`` ([n] bool, or None: every
    row); rows where a piece is masked out simply lack it."""

    def __init__(self, n: int) -> None:
        self.n = n
        self._pieces: list[tuple] = []

    def _rows(self, mask) -> slice | np.ndarray:
        """The rows a piece is in: every row (a slice), or their indices."""
        return slice(None) if mask is None else np.flatnonzero(np.asarray(mask, dtype=bool))

    def text(self, s: str, mask=None) -> Rows:
        """The same text in every selected row."""
        self._pieces.append(("lit", self._rows(mask), np.frombuffer(s.encode(), dtype=np.uint8)))
        return self

    def ints(self, values: np.ndarray, mask=None, null_below_zero: bool = False) -> Rows:
        """Each selected row's integer in decimal (``null`` where negative if ``null_below_zero``).

        Raises:
            ValueError: a negative value to write as a number.
        """
        rows = self._rows(mask)
        v = np.asarray(values, dtype=np.int64)[rows]
        null = v < 0
        if null.any() and not null_below_zero:
            raise ValueError("negative integers are not written by Rows.ints")
        self._pieces.append(("int", rows, v, null))
        return self

    def choice(self, codes: np.ndarray, table: list[str], mask=None) -> Rows:
        """Each selected row's ``table[code]``."""
        rows = self._rows(mask)
        enc = [t.encode() for t in table]
        flat = np.frombuffer(b"".join(enc), dtype=np.uint8) if any(enc) else np.zeros(0, dtype=np.uint8)
        lengths = np.array([len(e) for e in enc], dtype=np.int64)
        c = np.asarray(codes, dtype=np.int64)[rows]
        self._pieces.append(("ragged", rows, flat, (np.cumsum(lengths) - lengths)[c], lengths[c]))
        return self

    def int_lists(self, ptr: np.ndarray, values: np.ndarray, mask=None) -> Rows:
        """Each selected row's CSR row ``values[ptr[i]:ptr[i + 1]]`` as a JSON list (``[]`` when empty)."""
        rows = self._rows(mask)
        first = np.asarray(ptr[:-1])[rows]
        counts = (np.asarray(ptr[1:])[rows] - first).astype(np.int64)
        take = np.repeat(first - _starts(counts), counts) + np.arange(int(counts.sum()))
        v = np.asarray(values, dtype=np.int64)[take]
        if (v < 0).any():
            raise ValueError("negative integers are not written by Rows.int_lists")
        self._pieces.append(("list", rows, v, counts))
        return self

    def render(self) -> tuple[np.ndarray, np.ndarray]:
        """(the rows' bytes back to back as uint8, [n + 1] row offsets)."""
        lengths = np.zeros(self.n, dtype=np.int64)
        sizes = []
        for p in self._pieces:
            size = _sizes(p)                         # bytes per selected row (a list: digits per element)
            row_len = _list_len(p[3], size) if p[0] == "list" else size
            sizes.append((size, row_len))
            lengths[p[1]] += row_len
        offsets = np.r_[0, np.cumsum(lengths)]
        out = np.empty(int(offsets[-1]), dtype=np.uint8)
        at = offsets[:-1].copy()                     # each row's write position
        for p, (size, row_len) in zip(self._pieces, sizes):
            _write(out, p, at[p[1]], size, row_len)
            at[p[1]] += row_len
        return out, offsets


def _sizes(p) -> np.ndarray | int:
    """A piece's bytes in each of its rows (a literal: one number; a list: each element's digits)."""
    kind = p[0]
    if kind == "lit":
        return len(p[2])
    if kind == "int":
        return np.where(p[3], 4, _n_digits(np.maximum(p[2], 0)))
    if kind == "ragged":
        return p[4]
    return _n_digits(p[2])


def _write(out: np.ndarray, p, pos: np.ndarray, size, row_len) -> None:
    """Write one piece at each of its rows' positions ``pos``."""
    kind = p[0]
    if kind == "lit":
        pos = pos.copy()
        for byte in p[2].tolist():               # a column at a time: no [rows, bytes] index array
            out[pos] = byte
            pos += 1
    elif kind == "int":
        _write_ints(out, p[2], pos, size, p[3])
    elif kind == "ragged":
        _copy_ragged(out, p[2], pos, p[3], p[4])
    else:
        _write_lists(out, p[2], p[3], pos, size, row_len)


def _starts(counts: np.ndarray) -> np.ndarray:
    """Exclusive prefix sums of ``counts`` (each row's first element)."""
    return np.cumsum(counts) - counts


def _list_len(counts: np.ndarray, digits: np.ndarray) -> np.ndarray:
    """Bytes of each row of a list piece: ``[`` and ``]``, the digits, a comma between elements."""
    total = np.zeros(len(counts), dtype=np.int64)
    nonempty = counts > 0
    if nonempty.any():
        total[nonempty] = np.add.reduceat(digits, _starts(counts)[nonempty])
    return total + 2 + np.maximum(counts - 1, 0)


def _write_ints(out: np.ndarray, v: np.ndarray, pos: np.ndarray, size: np.ndarray, null: np.ndarray) -> None:
    """Decimal digits of ``v`` at ``pos`` (``size`` digits each), ``null`` where flagged."""
    if null.any():
        out[pos[null][:, None] + np.arange(4)] = np.frombuffer(b"null", dtype=np.uint8)
        keep = ~null
        v, pos, size = v[keep], pos[keep], size[keep]
    if len(v) and v.max() < 2**31:
        v = v.astype(np.int32)                   # int32 division: twice as fast
    end = pos + size - 1                         # each number's last digit, written first
    k = 0
    while len(v):
        v, digit = np.divmod(v, 10)
        out[end - k] = _DIGITS[digit]
        k += 1
        more = size > k
        if not more.all():
            v, end, size = v[more], end[more], size[more]


def _copy_ragged(out: np.ndarray, flat: np.ndarray, pos: np.ndarray, src: np.ndarray, length: np.ndarray) -> None:
    """``out[pos[i]:pos[i] + length[i]] = flat[src[i]:src[i] + length[i]]`` for every i."""
    total = int(length.sum())
    if total == 0:
        return
    first = np.cumsum(length) - length
    step = np.arange(total) - np.repeat(first, length)
    out[np.repeat(pos, length) + step] = flat[np.repeat(src, length) + step]


def _write_lists(out: np.ndarray, v: np.ndarray, counts: np.ndarray, pos: np.ndarray, digits: np.ndarray,
                 row_len: np.ndarray) -> None:
    """Each row's ``[a,b,...]`` at ``pos``: ``v`` the elements row after row, ``digits`` their lengths."""
    out[pos] = ord("[")
    out[pos + row_len - 1] = ord("]")
    if not len(v):
        return
    first = _starts(counts)
    row = np.repeat(np.arange(len(counts)), counts)
    index_in_row = np.arange(len(v)) - first[row]
    before = np.cumsum(digits) - digits                  # digits of the elements before, from the first row's
    start = pos[row] + 1 + before - before[first[row]] + index_in_row       # after "[", digits and commas
    _write_ints(out, v, start, digits, np.zeros(len(v), dtype=bool))
    comma = index_in_row > 0
    out[start[comma] - 1] = ord(",")
