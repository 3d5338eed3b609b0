"""Records (a rank's ops, a batch of tensors) of a file as meshplan writes it, read with no Python code per number:
the fast path of :mod:`meshplan.plan.json.read_parts`.

A record's *skeleton* is its text with each run of digits replaced by ``#``. The records of a schedule differ
mostly in their numbers: a 1024-rank file's 0.9M ops have a few hundred skeletons (an op's kind, stream, pass,
list lengths). So the text is scanned once — each run of digits found, parsed and replaced by ``#``
(:func:`meshplan.plan.json.number_scan.scan_numbers`: compiled where built, else numpy) — and cut into records at
``},{``; each *distinct* skeleton is then validated by the pydantic model of a whole record, its numbers zero, and
must be the text meshplan writes (the compact JSON of what it parses to: no space, no repeated key); its numbers'
fields come from it, in text order.
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

from meshplan.plan.json.number_scan import MAX_DIGITS, PAD, Numbers, scan_numbers

_KEY_OR_NUMBER = re.compile(rb'"([A-Za-z_]+)":|#')
_STRING = re.compile(rb'"[^"]*"')
_SIGN = re.compile(rb'(?<!e)-')
#: fields of a bound from this up are checked number by number only above the least such bound (few numbers: a
#: FLOP count's integer part); those of a smaller bound (a float's exponent, 99) whole, by field
_WIDE = 10**9
_NO_BOUND = 2**64 - 1                                  # no field of such a bound: no number above it
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
    """The records of one part: ``code`` [n] each record's template and ``first`` [n] the index of its first number;
    per number, in text order, ``value`` (uint64; a float's parts too). A record's numbers are its template's slots
    in order, so a field's numbers are found per (template, slot) — no sort of every number by its field:
    ``slot_field`` [S] each template's slots' fields (index into ``fields``), the templates' one after another from
    ``slot_start`` [T + 1]."""

    templates: list[Template]
    code: np.ndarray
    first: np.ndarray
    value: np.ndarray
    fields: list[str]
    slot_field: np.ndarray
    slot_start: np.ndarray

    def __len__(self) -> int:
        return len(self.code)

    def take(self, *names: str) -> tuple[np.ndarray, np.ndarray]:
        """(record index, value) of every number of the fields ``names``, in text order."""
        count, start, slot = self._slots(names)
        per = count[self.code]
        if len(count) and count.max() <= 1:          # at most one a record (an id, a peer): no repeat
            rec = np.flatnonzero(per)
            return rec, self.value[self.first[rec] + slot[start[self.code[rec]]]]
        rec = np.repeat(np.arange(len(per)), per)
        return rec, self.value[self._positions(per, start, slot)]

    def listed(self, *names: str) -> tuple[np.ndarray, np.ndarray]:
        """([n] how many numbers of the fields ``names`` each record holds, those numbers in text order)."""
        count, start, slot = self._slots(names)
        per = count[self.code]
        return per, self.value[self._positions(per, start, slot)]

    def _slots(self, names: tuple[str, ...]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The slots of the fields ``names``: ([T] how many each template has, [T] where each template's start in
        ``slot``, ``slot`` [S' + 1] each one's place among its record's numbers, template after template and in
        order within one; its last entry a 0 pad, so that ``start`` of a template with none still indexes it)."""
        chosen = np.zeros(len(self.fields), dtype=bool)
        chosen[[self.fields.index(n) for n in names if n in self.fields]] = True
        at = np.flatnonzero(chosen[self.slot_field])
        template = np.searchsorted(self.slot_start, at, side="right") - 1
        count = np.bincount(template, minlength=len(self.templates))
        return count, np.cumsum(count) - count, np.append(at - self.slot_start[template], 0)

    def _positions(self, per: np.ndarray, start: np.ndarray, slot: np.ndarray) -> np.ndarray:
        """[sum(per)] the positions in ``value`` of each record's ``per`` numbers (their places ``slot`` from
        ``start`` of its template), record by record."""
        total = int(per.sum())
        ahead = np.cumsum(per) - per                     # the numbers of the records before
        place = slot[np.repeat(start[self.code] - ahead, per) + np.arange(total)]
        return np.repeat(self.first, per) + place

    def field_of(self, at: np.ndarray) -> np.ndarray:
        """[k] the field (index into ``fields``) of the numbers at positions ``at``: their records found by
        ``first``."""
        rec = np.searchsorted(self.first, at, side="right") - 1     # the last record starting at or before
        return self.slot_field[self.slot_start[self.code[rec]] + at - self.first[rec]]


@dataclass
class Reader:
    """Reads parts of one file (:meth:`records`): its model of a record, the fields' bounds (the float fields'
    names), and the templates validated so far (each distinct skeleton once per process)."""

    model: TypeAdapter
    bounds: dict[str, int]
    float_fields: tuple[str, ...] = ()
    _cache: dict = field(default_factory=dict)

    def records(self, texts: list[bytes | memoryview]) -> tuple[Records, list[int]] | None:
        """(the records of ``texts`` — each ``{...},{...}``, or empty —, how many each holds), or None when they
        are not laid out as meshplan writes them or a record does not validate."""
        full = [t for t in texts if t]
        if not full:
            none = np.zeros(0, np.int64)
            return Records([], none, none, np.zeros(0, np.uint64), [], none, np.zeros(1, np.int64)), [0] * len(texts)
        if any(t[:1] != b"{" or t[-1:] != b"}" for t in full):
            return None
        text = b",{},".join([PAD + full[0], *full[1:]])     # an empty piece between texts: no record is empty
        scanned = scan_numbers(text)
        if scanned is None:
            return None
        skeleton, numbers = scanned
        pieces = skeleton.split(b"},{")
        pieces[0] = pieces[0][len(PAD) + 1:]      # the first's "{"
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
        found = self._numbers(numbers, templates, np.delete(code, between) - 1)
        return None if found is None else (found, [int(next(held)) if t else 0 for t in texts])

    def _numbers(self, numbers: Numbers, templates: list[Template], code: np.ndarray) -> Records | None:
        """The records of ``code`` [n] (each record's template), their numbers each checked against its field (None
        when one fails)."""
        fields = sorted({s for t in templates for s in t.slots})
        slot_field = [np.array([fields.index(s) for s in t.slots], dtype=np.int64) for t in templates]
        count = np.array([len(s) for s in slot_field], dtype=np.int64)
        per = count[code]
        if int(per.sum()) != len(numbers.value):
            return None
        flat = np.concatenate(slot_field) if slot_field else np.zeros(0, np.int64)
        recs = Records(templates, code, np.cumsum(per) - per, numbers.value, fields, flat, np.r_[0, np.cumsum(count)])
        return recs if self._in_bounds(recs, fields, numbers.zero, numbers.length) else None

    def _in_bounds(self, recs: Records, fields: list[str], zero: np.ndarray, length: np.ndarray) -> bool:
        """Whether every number of ``recs`` is within its field's bound and, but in a float's fraction or exponent
        (where JSON lets them lead with 0), has no leading zero (``zero`` [N]: it starts with 0). Only the few
        numbers that may fail are looked up by field: those above the least bound of 10 digits or more (the fields
        of a smaller bound — a float's exponent — are taken whole), those leading with 0 and longer than one digit.
        """
        bound = np.array([self._bound(f) for f in fields], dtype=np.uint64)
        if any((recs.take(f)[1] > top).any() for f, top in zip(fields, bound) if top < _WIDE):
            return False
        high = np.flatnonzero(recs.value > bound[bound >= _WIDE].min(initial=_NO_BOUND))
        if len(high) and (recs.value[high] > bound[recs.field_of(high)]).any():
            return False
        lead = np.flatnonzero(zero)
        lead = lead[length[lead] > 1]
        free = np.array([f.endswith((".frac", ".exp")) for f in fields], dtype=bool)    # JSON lets these lead 0
        return not len(lead) or bool(free[recs.field_of(lead)].all())

    def _bound(self, name: str) -> int:
        """The largest value a number of field ``name`` may take (a float's parts: as many as keep it finite)."""
        key, _, part = name.partition(".")
        if key in self.float_fields:
            return 99 if part == "exp" else 10**MAX_DIGITS - 1       # at most 19 digits x 1e99: finite
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


#: fields whose numbers come in pairs (a head range, token ranges): ``key.0`` and ``key.1``
PAIRED = ("heads", "q_rows", "kv_cols")
