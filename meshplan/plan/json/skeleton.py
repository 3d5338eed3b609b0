"""Records (a rank's ops, a batch of tensors) of a file as meshplan writes it, read with numpy and no Python code
per number: the fast path of :mod:`meshplan.plan.json.read_parts`.

A record's *skeleton* is its text with each run of digits replaced by ``#``. The records of a schedule differ
mostly in their numbers: a 1024-rank file's 0.9M ops have a few hundred skeletons (an op's kind, stream, pass,
list lengths). So the text is scanned once with numpy — each run of digits found, parsed eight digits at a time
from a 64-bit word, and replaced by ``#`` — and cut into records at ``},{``; each *distinct* skeleton is then
validated by the pydantic model of a whole record, its numbers zero, and must be the text meshplan writes (the
compact JSON of what it parses to: no space, no repeated key); its numbers' fields come from it, in text order.
The numbers are checked column-wise: JSON integers (no leading zero) within their field's bound, a float as
Python's ``repr`` writes it and finite. So a record is accepted only if its text is a valid record and reads the
same as pydantic reads it (``tests/plan/test_skeleton.py`` checks both on every method's files and on corrupted
ones).

Digits inside strings (``"bf16"``, a stream named ``kv2``) are no number: a run of digits right after a letter, ``_``
or ``"`` — never a JSON number in what meshplan writes (its floats' exponents are signed) — is kept in the skeleton
as it is, and a skeleton with a ``#`` inside a string is refused. Anything else — a byte outside what meshplan
writes, an escape, a skeleton that does not validate, a number out of bounds — gives None: the caller reads the part
with pydantic, whose errors name the field.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

import numpy as np
from pydantic import TypeAdapter, ValidationError

#: every byte a record of a file meshplan writes holds (compact JSON, no escapes)
_ALLOWED = b"abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_-{}[]:,\".+"
#: bytes after which a run of digits is part of a string (a letter, ``_``, ``"``), not a number
_WORDISH = np.zeros(256, dtype=bool)
_WORDISH[list(b"abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ_\"")] = True
_KEY_OR_NUMBER = re.compile(rb'"([A-Za-z_]+)":|#')
_STRING = re.compile(rb'"[^"]*"')
_SIGN = re.compile(rb'(?<!e)-')
_MAX_DIGITS = 19
#: the bound of a number by the model's field type (``Id``: 2**62; ``Int32``)
ID_MAX, INT32_MAX = 2**62, 2**31 - 1


@dataclass
class Template:
    """A distinct skeleton: ``record`` the record as the model reads it (numbers zero; every field under its file
    name, defaults filled in), ``slots`` each number's field in text order (``key``, or ``key.0``/``key.1``
    alternately in a pair field, ``key.int``/``.frac``/``.exp`` in a float)."""

    record: dict
    slots: list[str]


@dataclass
class Records:
    """The records of one part: ``code`` [n] each record's template; per number, in text order, ``value`` (uint64;
    a float's parts too), ``field`` (index into ``fields``) and ``record`` (its record's index)."""

    templates: list[Template]
    code: np.ndarray
    fields: list[str]
    value: np.ndarray
    field: np.ndarray
    record: np.ndarray
    _order: np.ndarray | None = None
    _bounds: np.ndarray | None = None

    def __len__(self) -> int:
        return len(self.code)

    def take(self, *names: str) -> tuple[np.ndarray, np.ndarray]:
        """(record index, value) of every number of the fields ``names``, in text order."""
        if self._order is None:                     # the numbers by field (a stable radix sort), once
            self._order = np.argsort(self.field.astype(np.int16), kind="stable")
            self._bounds = np.searchsorted(self.field[self._order], np.arange(len(self.fields) + 1))
        at = [self._order[self._bounds[i]:self._bounds[i + 1]] for i in
              (self.fields.index(n) for n in names if n in self.fields)]
        pos = np.sort(np.concatenate(at)) if len(at) > 1 else at[0] if at else np.zeros(0, dtype=np.int64)
        return self.record[pos], self.value[pos]


@dataclass
class Reader:
    """Reads parts of one file (:meth:`records`): its model of a record, the fields' bounds (the float fields'
    names), and the templates validated so far (each distinct skeleton once per process)."""

    model: TypeAdapter
    bounds: dict[str, int]
    float_fields: tuple[str, ...] = ()
    _cache: dict = field(default_factory=dict)

    def records(self, texts: list[bytes]) -> tuple[Records, list[int]] | None:
        """(the records of ``texts`` — each ``{...},{...}``, or empty —, how many each holds), or None when they
        are not laid out as meshplan writes them or a record does not validate."""
        full = [t for t in texts if t]
        if not full:
            return Records([], np.zeros(0, np.int64), [], np.zeros(0, np.uint64), np.zeros(0, np.int64),
                           np.zeros(0, np.int64)), [0] * len(texts)
        if any(t[:1] != b"{" or t[-1:] != b"}" for t in full):
            return None
        text = b",{},".join(full)                    # an empty piece between texts: no record is empty
        if text.translate(None, _ALLOWED):
            return None
        b = np.frombuffer(text, dtype=np.uint8)
        digit = np.frombuffer(text.translate(_DIGIT_FLAG), dtype=bool)     # bytes.translate: one C pass a byte
        edges = np.flatnonzero(digit[1:] != digit[:-1])    # text starts with "{" and ends with "}": pairs
        starts, ends = edges[0::2] + 1, edges[1::2] + 1                     # every run
        held = bytearray(text.translate(_DIGIT_NUL))        # digits NUL (the text holds none: _ALLOWED)
        marked = np.frombuffer(held, dtype=np.uint8)
        kept = _WORDISH[b[starts - 1]]
        if kept.any():                                  # a string's digits: back as they were
            at = _runs(starts[kept], ends[kept])
            marked[at] = b[at]
            starts, ends = starts[~kept], ends[~kept]
        marked[starts] = ord("#")
        pieces = bytes(held.translate(None, b"\x00")).split(b"},{")
        pieces[0] = pieces[0][1:]                   # the first's "{"
        pieces[-1] = pieces[-1][:-1]                # the last's "}"
        index = {p: k for k, p in enumerate(dict.fromkeys([b"", *pieces]))}    # each distinct skeleton, "" first
        code = np.fromiter(map(index.__getitem__, pieces), dtype=np.int64, count=len(pieces))
        between = np.flatnonzero(code == 0)
        if len(between) != len(full) - 1:
            return None                             # an empty record, "{}"
        templates = [self._template(p) for p in list(index)[1:]]
        if any(t is None for t in templates):
            return None
        held = iter(np.diff(np.r_[-1, between, len(code)]) - 1)
        found = self._numbers(b, starts, ends, templates, np.delete(code, between) - 1)
        return None if found is None else (found, [int(next(held)) if t else 0 for t in texts])

    def _numbers(self, b: np.ndarray, starts: np.ndarray, ends: np.ndarray, templates: list[Template],
                 code: np.ndarray) -> Records | None:
        """Each number's value, field and record, checked against its field (None when one fails)."""
        fields = sorted({s for t in templates for s in t.slots})
        slot_field = [np.array([fields.index(s) for s in t.slots], dtype=np.int64) for t in templates]
        per = np.array([len(s) for s in slot_field], dtype=np.int64)[code]
        if int(per.sum()) != len(starts):
            return None
        flat = np.concatenate(slot_field) if slot_field else np.zeros(0, np.int64)
        offset = np.cumsum([len(s) for s in slot_field]) - [len(s) for s in slot_field]
        first_slot = np.cumsum(per) - per
        pos = np.arange(len(starts)) - np.repeat(first_slot, per)
        fld = flat[np.repeat(np.asarray(offset, dtype=np.int64)[code], per) + pos]
        length = ends - starts
        if len(length) and length.max() > _MAX_DIGITS:
            return None
        value = parse_digits(b, ends, length)
        lead_zero = (length > 1) & (b[starts] == ord("0"))
        bound = np.array([self._bound(f) for f in fields], dtype=np.uint64)
        free = np.array([f.endswith((".frac", ".exp")) for f in fields], dtype=bool)    # JSON lets these lead 0
        if (lead_zero & ~free[fld]).any() or (value > bound[fld]).any():
            return None
        return Records(templates, code, fields, value, fld, np.repeat(np.arange(len(code)), per))

    def _bound(self, name: str) -> int:
        """The largest value a number of field ``name`` may take (a float's parts: as many as keep it finite)."""
        key, _, part = name.partition(".")
        if key in self.float_fields:
            return 99 if part == "exp" else 10**_MAX_DIGITS - 1       # at most 19 digits x 1e99: finite
        return self.bounds[key]

    def _template(self, skeleton: bytes) -> Template | None:
        """The validated template of a distinct skeleton, or None."""
        if skeleton in self._cache:
            return self._cache[skeleton]
        self._cache[skeleton] = found = self._validate(b"{" + skeleton + b"}")
        return found

    def _validate(self, text: bytes) -> Template | None:
        """A record's text with ``#`` for its numbers: a template when it is a valid record as meshplan writes it."""
        if any(b"#" in s for s in _STRING.findall(text)) or _SIGN.search(_STRING.sub(b'""', text)):
            return None                              # digits in a string, or a negative number
        zero = text.replace(b"#", b"0")
        for key in self.float_fields:                      # a float's written form, as repr writes it, to 0.0
            zero = re.sub(rb'"' + key.encode() + rb'":0(?:\.0)?(?:e[-+]0)?(?=[,}])', b'"' + key.encode() + b'":0.0',
                          zero)
        try:
            record = json.loads(zero)
            if not isinstance(record, dict) or json.dumps(record, separators=(",", ":")).encode() != zero or \
                    any(_has_float(v) for k, v in record.items() if k not in self.float_fields) or \
                    not all(_numbers_only(v) for k, v in record.items() if k in self.bounds or k in
                            self.float_fields):
                return None      # not compact, a key twice, a float for an integer, a string or bool for a number
            valid = self.model.validate_json(zero)
        except (ValueError, ValidationError):
            return None
        slots, key, count = [], None, 0
        for m in _KEY_OR_NUMBER.finditer(text):
            if m.group(1) is not None:
                key, count = m.group(1).decode(), 0
                continue
            if key in self.float_fields:              # its form is #(.#)?(e[+-]#)?: the canonical check above
                before = text[m.start() - 1:m.start()]
                slots.append(f"{key}.{'frac' if before == b'.' else 'exp' if before in (b'+', b'-') else 'int'}")
            elif key in self.bounds:
                slots.append(f"{key}.{count % 2}" if key in PAIRED else key)
            else:
                return None
            count += 1
        # the record as the model reads it: every field under its file name, defaults filled in ("pass_" is "pass")
        return Template(self.model.dump_python(valid, by_alias=True), slots)


def _has_float(value) -> bool:
    """Whether a parsed JSON value holds a float."""
    if isinstance(value, list):
        return any(map(_has_float, value))
    return isinstance(value, float)


def _numbers_only(value) -> bool:
    """Whether a parsed JSON value of a number field holds only numbers (or null): pydantic would read ``"5"`` and
    ``true`` as integers, which hold no digits this reader parses."""
    if isinstance(value, list):
        return all(map(_numbers_only, value))
    return value is None or (isinstance(value, (int, float)) and not isinstance(value, bool))


def _runs(starts: np.ndarray, ends: np.ndarray) -> np.ndarray:
    """Every position of the runs ``[starts[i], ends[i])``."""
    length = ends - starts
    return np.repeat(starts - (np.cumsum(length) - length), length) + np.arange(int(length.sum()))


#: fields whose numbers come in pairs (a head range, token ranges): ``key.0`` and ``key.1``
PAIRED = ("heads", "q_rows", "kv_cols")

#: bytes.translate tables: a digit to 1 (else 0), and a digit to NUL (else itself)
_DIGIT_FLAG = bytes(int(48 <= c < 58) for c in range(256))
_DIGIT_NUL = bytes(0 if 48 <= c < 58 else c for c in range(256))
_LOW_FOUR = np.uint64(0x0F0F0F0F0F0F0F0F)
_PAIR_MASK = np.uint64(0x000000FF000000FF)
_MUL1 = np.uint64(100 + (1_000_000 << 32))
_MUL2 = np.uint64(1 + (10_000 << 32))


def parse_digits(b: np.ndarray, ends: np.ndarray, length: np.ndarray) -> np.ndarray:
    """[k] uint64 values of the runs of ASCII digits ``b[ends - length:ends]`` (each 1..19 digits)."""
    padded = np.concatenate([np.full(16, ord("0"), dtype=np.uint8), b])        # windows before the first byte
    word = np.ndarray(shape=(len(padded) - 7,), dtype="<u8", buffer=padded, strides=(1,))  # any byte order
    value = _eight(word[ends + 8], np.minimum(length, 8))
    for k, scale in ((1, 10**8), (2, 10**16)):         # digits 9..16, then 17..19, where a number has them
        more = np.flatnonzero(length > 8 * k)
        if len(more):
            value[more] += _eight(word[ends[more] + 8 - 8 * k], np.minimum(length[more] - 8 * k, 8)) * \
                np.uint64(scale)
    return value


def _eight(word: np.ndarray, count: np.ndarray) -> np.ndarray:
    """The value of the last ``count`` (1..8) ASCII digits of each little-endian 8-byte word (the bytes before
    them ignored): the eight-digit parse of simdjson (Lemire), each step on every word at once."""
    keep = np.left_shift(np.uint64(0xFFFFFFFFFFFFFFFF), (8 * (8 - count)).astype(np.uint64))
    v = word & keep & _LOW_FOUR
    v = v * np.uint64(10) + (v >> np.uint64(8))
    return (((v & _PAIR_MASK) * _MUL1) + (((v >> np.uint64(16)) & _PAIR_MASK) * _MUL2)) >> np.uint64(32) & \
        np.uint64(0xFFFFFFFF)
