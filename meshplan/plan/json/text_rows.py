"""JSON text of many rows at once, column by column: a row is a sequence of pieces — literal text, an integer, a
list of integers, a choice from a table of strings — each present in the rows its mask selects, so one
:class:`Rows` holds rows of several shapes (a schedule's send, compute and merge ops). The bytes of every row are
laid out with numpy (lengths, offsets, then each piece scattered into one buffer), with no Python code per row:
a 256-rank schedule's 126 MB of text in a fraction of the time f-strings take (``docs/speed.md``). The stores of
literals and integers at their rows' offsets are compiled loops where built (:mod:`meshplan.plan.json.compiled`);
numpy's otherwise, the same bytes: literal text and digits stored several bytes at a time (:class:`_Text`'s
unaligned views of widths 2, 4 and 8: a 15-byte literal is two 8-byte stores per row, not 15 one-byte ones).
"""

from __future__ import annotations

import numpy as np

from meshplan.plan.json import compiled as _compiled

_DIGITS = np.frombuffer(b"0123456789", dtype=np.uint8)
#: "00".."99" as 2-byte words in memory order: two digits a store
_DIGIT_PAIRS = np.frombuffer(b"".join(b"%02d" % i for i in range(100)), dtype=np.uint16)
_MAX_DIGITS = 19          # int64
_WORDS = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}
#: a choice from a table of at most this many strings is written as a literal per string (else byte by byte)
_CHOICE_AS_LITERALS = 16


class _Text:
    """A text buffer of ``size`` bytes (``buf``; 8 more held behind it) and views of it as 2-, 4- and 8-byte words
    starting at every byte (``word[w][i]`` is bytes i..i+w−1: numpy stores at unaligned offsets); ``compiled``: its
    stores by the compiled loops."""

    def __init__(self, size: int, compiled: bool) -> None:
        self._raw = np.empty(size + 8, dtype=np.uint8)
        self.buf = self._raw[:size]
        self.word = {w: np.ndarray((size + 8 - w + 1,), dtype=t, buffer=self._raw, strides=(1,))
                     for w, t in _WORDS.items()}
        self.compiled = compiled

    def literal(self, lit: bytes, pos: np.ndarray) -> None:
        """Write ``lit`` at each of ``pos``."""
        if self.compiled:
            _compiled.text.put_literal(self.buf, np.ascontiguousarray(pos, dtype=np.int64), lit)
            return
        for off, width, value in _stores(lit):
            self.word[width][pos + off if off else pos] = value


def _stores(lit: bytes) -> list[tuple[int, int, int]]:
    """(offset, width, word) stores that write ``lit``: words of its largest width that fits, the last one
    overlapping the one before where the length is not a multiple (no byte outside the literal is touched)."""
    n = len(lit)
    if n == 0:
        return []
    width = 8 if n >= 8 else 4 if n >= 4 else 2 if n >= 2 else 1
    offs = list(range(0, n - width + 1, width))
    if offs[-1] != n - width:
        offs.append(n - width)
    return [(o, width, int(np.frombuffer(lit[o:o + width], dtype=_WORDS[width])[0])) for o in offs]


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
        lit = s.encode()
        self._pieces.append(("lit", self._rows(mask), lit))
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
        lengths = np.array([len(e) for e in enc], dtype=np.int64)
        c = np.asarray(codes, dtype=np.int64)[rows]
        if len(table) <= _CHOICE_AS_LITERALS:
            self._pieces.append(("choice", rows, c, enc, lengths[c]))
        else:
            flat = np.frombuffer(b"".join(enc), dtype=np.uint8) if any(enc) else np.zeros(0, dtype=np.uint8)
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

    def render(self, compiled: bool | None = None) -> tuple[np.ndarray, np.ndarray]:
        """(the rows' bytes back to back as uint8, [n + 1] row offsets). ``compiled``: the stores by the compiled
        loops (True), by numpy (False), by the compiled ones where built (None) — the same bytes."""
        lengths = np.zeros(self.n, dtype=np.int64)
        sizes = []
        for p in self._pieces:
            size = _sizes(p)                         # bytes per selected row (a list: digits per element)
            row_len = _list_len(p[3], size) if p[0] == "list" else size
            sizes.append((size, row_len))
            lengths[p[1]] += row_len
        offsets = np.r_[0, np.cumsum(lengths)]
        out = _Text(int(offsets[-1]), _compiled.built() if compiled is None else compiled)
        at = offsets[:-1].copy()                     # each row's write position
        for p, (size, row_len) in zip(self._pieces, sizes):
            _write(out, p, at[p[1]], size, row_len)
            at[p[1]] += row_len
        return out.buf, offsets


def _sizes(p) -> np.ndarray | int:
    """A piece's bytes in each of its rows (a literal: one number; a list: each element's digits)."""
    kind = p[0]
    if kind == "lit":
        return len(p[2])
    if kind == "int":
        return np.where(p[3], 4, _n_digits(np.maximum(p[2], 0)))
    if kind in ("ragged", "choice"):
        return p[4]
    return _n_digits(p[2])


def _write(out: _Text, p, pos: np.ndarray, size, row_len) -> None:
    """Write one piece at each of its rows' positions ``pos``."""
    kind = p[0]
    if kind == "lit":
        out.literal(p[2], pos)
    elif kind == "int":
        _write_ints(out, p[2], pos, size, p[3])
    elif kind == "choice":
        codes = p[2]
        for code, lit in enumerate(p[3]):
            if lit:
                at = codes == code
                if at.any():
                    out.literal(lit, pos[at])
    elif kind == "ragged":
        _copy_ragged(out.buf, p[2], pos, p[3], p[4])
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


def _write_ints(out: _Text, v: np.ndarray, pos: np.ndarray, size: np.ndarray, null: np.ndarray) -> None:
    """Decimal digits of ``v`` at ``pos`` (``size`` digits each), ``null`` where flagged: two digits a store, from
    the last (a number's odd first digit alone)."""
    if null.any():
        out.literal(b"null", pos[null])
        keep = ~null
        v, pos, size = v[keep], pos[keep], size[keep]
    if out.compiled:
        _compiled.text.put_ints(out.buf, *(np.ascontiguousarray(x, dtype=np.int64) for x in (pos, size, v)))
        return
    if len(v) and v.max() < 2**31:
        v = v.astype(np.int32)                   # int32 division: twice as fast
    end = pos + size                             # one past each number's last digit
    pairs, k = out.word[2], 0                    # k: digits written so far
    while len(v):
        single = size - k == 1                   # one digit left (v < 10 there)
        if single.any():
            out.buf[end[single] - (k + 1)] = _DIGITS[v[single]]
            more = ~single
            v, end, size = v[more], end[more], size[more]
            if not len(v):
                break
        v, two = np.divmod(v, 100)
        pairs[end - (k + 2)] = _DIGIT_PAIRS[two]
        k += 2
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


def _write_lists(out: _Text, v: np.ndarray, counts: np.ndarray, pos: np.ndarray, digits: np.ndarray,
                 row_len: np.ndarray) -> None:
    """Each row's ``[a,b,...]`` at ``pos``: ``v`` the elements row after row, ``digits`` their lengths."""
    out.buf[pos] = ord("[")
    out.buf[pos + row_len - 1] = ord("]")
    if not len(v):
        return
    first = _starts(counts)
    row = np.repeat(np.arange(len(counts)), counts)
    index_in_row = np.arange(len(v)) - first[row]
    before = np.cumsum(digits) - digits                  # digits of the elements before, from the first row's
    start = pos[row] + 1 + before - before[first[row]] + index_in_row       # after "[", digits and commas
    _write_ints(out, v, start, digits, np.zeros(len(v), dtype=bool))
    comma = index_in_row > 0
    out.buf[start[comma] - 1] = ord(",")
