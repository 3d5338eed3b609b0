"""Document lengths: FlashAttention's ``cu_seqlens`` read and checked, a histogram file of lengths, and packs of
documents drawn from it.

What ``search --doc-lengths FILE --batches K --seq-len S`` plans for (issue 25): a training stream packs
documents whose lengths follow a distribution, a new pack every step. A histogram is a CSV file with a header and
either

* ``range`` and ``number``: a bin of lengths ``"[lo, hi]"`` (tokens, both ends included) and how many documents
  fall in it (the form datasets publish their length statistics in), or
* ``length`` and ``count``: one length per row and its count.

Other columns are ignored; every row is validated (pydantic) and a bad one refused with one line naming the file,
the row and the fix. A pack draws documents independently — a bin by its share of documents, then a length
uniformly in the bin — until it holds ``seq_len`` tokens; the last document is cut to fit (as a packing data
loader does). The draws are deterministic for a seed.
"""

from __future__ import annotations

import csv
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from meshplan.core.errors import UserError

FIELD = "--doc-lengths"
_RANGE = re.compile(r"^\s*\[\s*(\d+)\s*,\s*(\d+)\s*\]\s*$")


class LengthBin(BaseModel):
    """One histogram row: documents of ``lo`` … ``hi`` tokens (inclusive), ``count`` of them."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    lo: int = Field(ge=1, description="shortest length in the bin, tokens")
    hi: int = Field(ge=1, description="longest length in the bin, tokens (≥ lo)")
    count: float = Field(ge=0, description="documents in the bin")

    @model_validator(mode="after")
    def _ordered(self) -> LengthBin:
        if self.hi < self.lo:
            raise ValueError(f"range [{self.lo}, {self.hi}] ends before it starts")
        return self


@dataclass(frozen=True)
class DocLengths:
    """A document-length histogram: arrays ``lo``, ``hi`` (tokens, inclusive) and ``count`` per bin."""

    lo: np.ndarray
    hi: np.ndarray
    count: np.ndarray
    source: str = ""

    @property
    def mean_tokens(self) -> float:
        """Mean document length, tokens (lengths uniform inside a bin)."""
        return float((self.count * (self.lo + self.hi) / 2).sum() / self.count.sum())

    def draw(self, n: int, rng: np.random.Generator) -> np.ndarray:
        """[n] int64 document lengths drawn from the histogram."""
        b = rng.choice(self.lo.size, size=n, p=self.count / self.count.sum())
        return self.lo[b] + rng.integers(0, self.hi[b] - self.lo[b] + 1)


def read_doc_lengths(path: str | Path) -> DocLengths:
    """Read a histogram file (module docstring).

    Raises:
        UserError: unreadable file, neither column pair, a bad row (which row, what is wrong), no documents.
    """
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as err:
        raise UserError(FIELD, f"cannot read {path}: {err.strerror or err}", "give a CSV file") from None
    rows = list(csv.DictReader(text.splitlines()))
    cols = {c.strip() for c in (rows[0].keys() if rows else [])}
    if {"range", "number"} <= cols:
        kind = "range"
    elif {"length", "count"} <= cols:
        kind = "length"
    else:
        raise UserError(FIELD, f"{path}: no 'range' and 'number' columns, nor 'length' and 'count'",
                        'write a header "range,number" (rows like "[1, 512]",1200) or "length,count"')
    bins = [_bin(row, kind, path, i) for i, row in enumerate(rows, start=2)]
    count = np.array([b.count for b in bins], dtype=np.float64)
    if not bins or count.sum() <= 0:
        raise UserError(FIELD, f"{path}: the histogram holds no documents", "give at least one row with a count > 0")
    return DocLengths(np.array([b.lo for b in bins], dtype=np.int64), np.array([b.hi for b in bins], dtype=np.int64),
                      count, str(path))


def _bin(row: dict, kind: str, path: Path, line: int) -> LengthBin:
    row = {(k or "").strip(): (v or "").strip() for k, v in row.items()}
    try:
        if kind == "range":
            got = _RANGE.match(row["range"])
            if not got:
                raise UserError(FIELD, f"{path}: line {line}: range {row['range']!r} is not \"[lo, hi]\"",
                                'write it like "[1, 512]" (quoted: it holds a comma)')
            return LengthBin(lo=int(got[1]), hi=int(got[2]), count=row["number"])
        return LengthBin(lo=row["length"], hi=row["length"], count=row["count"])
    except ValidationError as err:
        first = err.errors()[0]
        column = {"range": {"lo": "range", "hi": "range", "count": "number"},
                  "length": {"lo": "length", "hi": "length", "count": "count"}}[kind]
        where = column.get(str(first["loc"][0]) if first["loc"] else "lo", "row")
        msg = first["msg"].removeprefix("Value error, ")
        raise UserError(FIELD, f"{path}: line {line}: {where}: {msg}",
                        "lengths are whole tokens ≥ 1, counts ≥ 0") from None


def parse_cu_seqlens(text: str, field: str = "--cu-seqlens") -> list[int]:
    """``0,E1,E2,...,S`` (FlashAttention's varlen offsets, as text) -> integers; offsets are not sizes, so no K/M
    suffixes.

    Raises:
        UserError: an empty item or a non-integer (checked further by :func:`document_lengths`).
    """
    try:
        return [int(x) for x in text.replace(" ", "").split(",")]
    except ValueError:
        raise UserError(field, f"cannot read {text[:60]!r}",
                        "write 0,E1,E2,...,S: integers separated by commas, nothing empty") from None


def document_lengths(cu_seqlens, field: str = "cu_seqlens") -> np.ndarray:
    """Document lengths from cumulative offsets ``cu_seqlens`` (0, E1, E2, …, S: whole numbers), int64.

    Raises:
        UserError (naming ``field``): not a sequence of whole numbers, fewer than two offsets, not starting at 0,
            or an empty document (offsets not strictly rising).
    """
    if isinstance(cu_seqlens, (str, bytes)):
        raise UserError(field, "is a string", "give a list of integers 0, E1, ..., S (parse_cu_seqlens reads text)")
    cu = np.asarray(cu_seqlens)
    if cu.ndim != 1 or cu.size < 2 or cu.dtype.kind not in "iuf" or (cu != np.round(cu)).any():
        raise UserError(field, "needs at least two whole-number offsets 0, E1, ..., S",
                        "give cumulative document ends, 0 first and the pack's length last")
    cu = cu.astype(np.int64)
    if cu[0] != 0:
        raise UserError(field, f"starts at {cu[0]}, not 0", "give cumulative document ends, 0 first")
    if (np.diff(cu) <= 0).any():
        k = int(np.flatnonzero(np.diff(cu) <= 0)[0])
        raise UserError(field, f"offset {k + 1} ({cu[k + 1]}) does not rise above {cu[k]}: every document needs "
                        "at least one token", "drop empty documents (repeated offsets)")
    return np.diff(cu)


def draw_packs(lengths: DocLengths, seq_len: int, batches: int, seed: int = 0) -> list[np.ndarray]:
    """``batches`` packs of exactly ``seq_len`` tokens each: per pack, int64 document lengths in order (module
    docstring); deterministic for ``seed``.

    Raises:
        UserError: ``seq_len`` or ``batches`` below 1.
    """
    if seq_len < 1:
        raise UserError("--seq-len", f"{seq_len} tokens", "a pack needs at least one token")
    if batches < 1:
        raise UserError("--batches", f"{batches}", "draw at least one pack")
    rng = np.random.default_rng(seed)
    guess = int(np.ceil(seq_len / lengths.mean_tokens)) + 8
    packs = []
    for _ in range(batches):
        got = lengths.draw(guess, rng)
        while got.sum() < seq_len:
            got = np.concatenate([got, lengths.draw(guess, rng)])
        ends = np.cumsum(got)
        last = int(np.searchsorted(ends, seq_len))           # the document that crosses the pack's end
        pack = got[:last + 1].copy()
        pack[last] -= int(ends[last]) - seq_len
        packs.append(pack)
    return packs
