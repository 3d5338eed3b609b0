"""The numbers of a part's text and its skeleton (the text with each number's digits replaced by ``#``), for the
reader of :mod:`meshplan.plan.json.skeleton`: :func:`scan_numbers`.

A run of digits right after a letter, ``_`` or ``"`` is a string's (``"bf16"``, a stream named ``kv2``) — never a
JSON number in what meshplan writes (its floats' exponents are signed) — and is kept in the skeleton as it is. A
byte outside what meshplan writes, or a number of more than 19 digits, refuses the text (None).

Two ways, the same results: the compiled scan (``_text.c``, :mod:`meshplan.plan.json.compiled`: one pass, ~1 ns a
byte) or, where it was not built, numpy (~10 passes: a byte table, the digits' edges, the string digits put back,
the numbers cut out, each number parsed eight digits at a time from a 64-bit word). ``tests/plan/
test_compiled_text.py`` compares the two on every method's files and on fuzzed text.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from meshplan.plan.json import compiled as _compiled

#: every byte a record of a file meshplan writes holds (compact JSON, no escapes)
ALLOWED = b"abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_-{}[]:,\".+"
#: bytes after which a run of digits is part of a string (a letter, ``_``, ``"``), not a number
_WORDISH = np.zeros(256, dtype=bool)
_WORDISH[list(b"abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ_\"")] = True
#: the compiled scan's tables: 1 where a byte may stand outside a run of digits, 1 where it makes the run a string's
_ALLOWED_TABLE = bytes(c in ALLOWED and not 48 <= c < 58 for c in range(256))
_WORDISH_TABLE = _WORDISH.astype(np.uint8).tobytes()
MAX_DIGITS = 19
#: bytes to lead a text with (no digit, no ``},{``): a number's 8-byte words (:func:`_parse_padded`) start at most 7
#: bytes before its first digit, so within them
PAD = b"[" * 8


@dataclass
class Numbers:
    """A text's numbers in text order: ``value`` [k] uint64, ``length`` [k] their digit counts, ``zero`` [k] bool
    whether each one's first digit is 0."""

    value: np.ndarray
    length: np.ndarray
    zero: np.ndarray


def scan_numbers(text: bytes, compiled: bool | None = None) -> tuple[bytes, Numbers] | None:
    """(the skeleton, the numbers) of ``text`` — led by :data:`PAD`, ending with no digit —, or None where it holds a
    byte outside :data:`ALLOWED` or a number of more than :data:`MAX_DIGITS` digits. ``compiled``: the compiled scan
    (True), numpy's (False), the compiled one where built (None)."""
    if compiled is None:
        compiled = _compiled.built()
    return _scan_compiled(text) if compiled else _scan_numpy(text)


def _scan_compiled(text: bytes) -> tuple[bytes, Numbers] | None:
    room = (len(text) + 1) // 2                       # at most one number in two bytes
    value, length, zero = np.empty(room, np.uint64), np.empty(room, np.uint8), np.empty(room, np.bool_)
    got = _compiled.text.scan(text, _ALLOWED_TABLE, _WORDISH_TABLE, value, length, zero)
    if got is None:
        return None
    skeleton, k = got
    return skeleton, Numbers(value[:k], length[:k], zero[:k])


def _scan_numpy(text: bytes) -> tuple[bytes, Numbers] | None:
    held = text.translate(_HELD)                      # bytes.translate: one C pass a byte
    if b"\xff" in held:                               # a byte outside ALLOWED
        return None
    b = np.frombuffer(text, dtype=np.uint8)
    before, last, held = _number_runs(b, bytearray(held))
    length = last - before
    if len(length) and length.max() > MAX_DIGITS:
        return None
    skeleton = bytes(held.translate(None, b"\x00"))
    return skeleton, Numbers(_parse_padded(_words(b), last, length), length, b[1:][before] == ord("0"))


def _number_runs(b: np.ndarray, held: bytearray) -> tuple[np.ndarray, np.ndarray, bytearray]:
    """([k] the byte before, [k] the last digit of each run of digits of a text that is a number, not a string's,
    and ``held`` — the text translated by :data:`_HELD`, its digits NUL — with those runs' last digit made ``#`` and
    the other runs' digits back. ``b``: the text's bytes, starting and ending with no digit."""
    marked = np.frombuffer(held, dtype=np.uint8)
    digit = marked == 0                                # a NUL is a digit: the text holds none (ALLOWED)
    edges = np.flatnonzero(digit[1:] != digit[:-1])
    before, last = edges[0::2], edges[1::2]
    kept = _WORDISH[b[before]]
    if kept.any():                                  # a string's digits: back as they were
        at = _runs(before[kept] + 1, last[kept] + 1)
        marked[at] = b[at]
        number = ~kept
        before, last = before[number], last[number]
    marked[last] = ord("#")
    return before, last, held


def _runs(starts: np.ndarray, ends: np.ndarray) -> np.ndarray:
    """Every position of the runs ``[starts[i], ends[i])``."""
    length = ends - starts
    return np.repeat(starts - (np.cumsum(length) - length), length) + np.arange(int(length.sum()))


#: a bytes.translate table: a digit to NUL, another byte of ALLOWED to itself, any other to 0xFF (none of ALLOWED)
_HELD = bytes(0 if 48 <= c < 58 else c if c in ALLOWED else 0xFF for c in range(256))
#: [20] by a run's digit count (0..19): the mask of its last min(count, 8) bytes of a little-endian word, each byte's
#: low four bits (an ASCII digit's value)
_KEEP = np.array([(2**64 - 1) << (8 * (8 - min(c, 8))) & (2**64 - 1) & 0x0F0F0F0F0F0F0F0F for c in range(20)],
                 dtype=np.uint64)
_PAIR_MASK = np.uint64(0x000000FF000000FF)
_MUL1 = np.uint64(100 + (1_000_000 << 32))
_MUL2 = np.uint64(1 + (10_000 << 32))


def parse_digits(b: np.ndarray, ends: np.ndarray, length: np.ndarray) -> np.ndarray:
    """[k] uint64 values of the runs of ASCII digits ``b[ends - length:ends]`` (each 1..19 digits)."""
    padded = np.concatenate([np.frombuffer(PAD, dtype=np.uint8), b])
    return _parse_padded(_words(padded), ends - 1 + len(PAD), length)


def _words(padded: np.ndarray) -> np.ndarray:
    """[len - 7] the little-endian 8-byte word at each byte of ``padded`` (any byte order): ``[i]`` ends at
    ``padded[i + 7]``."""
    return np.ndarray(shape=(len(padded) - 7,), dtype="<u8", buffer=padded, strides=(1,))


def _parse_padded(word: np.ndarray, last: np.ndarray, length: np.ndarray) -> np.ndarray:
    """[k] uint64 values of the runs of ASCII digits ending at byte ``last`` (each 1..19 digits) of bytes led by
    :data:`PAD` (``word`` their :func:`_words`): the 8 bytes ending at a run's last digit, then (more than 8
    digits) the 8 before, then (more than 16) the 8 before those."""
    value = _eight(word, last - 7, length)
    more = np.flatnonzero(length > 8)
    for k, scale in ((1, 10**8), (2, 10**16)):
        if k == 2:
            more = more[length[more] > 16]
        if len(more):
            value[more] += _eight(word, last[more] - 7 - 8 * k, length[more] - 8 * k) * np.uint64(scale)
    return value


def _eight(word: np.ndarray, at: np.ndarray, count: np.ndarray) -> np.ndarray:
    """The value of the last ``min(count, 8)`` (count 1..19) ASCII digits of each little-endian 8-byte word
    ``word[at]`` (the bytes before them ignored): the eight-digit parse of simdjson (Lemire), each step on every word
    at once, in place. The product's top half (``>> 32``) holds the value, below 10**8 < 2**32."""
    v = _KEEP[count]
    scratch = word[at]
    v &= scratch
    np.right_shift(v, np.uint64(8), out=scratch)
    v *= np.uint64(10)
    v += scratch                                        # each odd byte: two digits' value
    np.bitwise_and(v, _PAIR_MASK, out=scratch)
    scratch *= _MUL1
    v >>= np.uint64(16)
    v &= _PAIR_MASK
    v *= _MUL2
    v += scratch
    v >>= np.uint64(32)
    return v
