"""A block's mask as per-row key runs, and its cover by dense kernels (full rectangles, causal and reversed squares).

With its tokens in position order, every mask meshplan knows (causal, window, documents, padding) lets query
row i attend one contiguous run of keys ``lo[i] <= j < hi[i]`` (:meth:`meshplan.model.workload.Mask.key_ranges`).
The executor never builds the [Sq, Skv] matrix for the common shapes: :func:`pieces` covers the permitted
pairs exactly, each pair once, with at most ``MAX_PIECES`` kernels, each either

* a full rectangle — rows [r0, r1) × keys [c0, c1), run without a mask;
* a causal square — row r0 + t sees keys c0 … c0 + t (the kernels' top-left ``is_causal``); or
* a reversed square (``anti``) — row r0 + t sees keys c0 + t … c1 − 1: a sliding window's far edge, run as a causal
  square over its rows and keys in reverse order,

so a zigzag or contiguous diagonal is one causal kernel, a striped block from a later rank (row i sees keys
< i) is one causal kernel on rows 1… and keys …S−2, and rows or keys that nothing permits are trimmed.
Document boundaries cutting a block give one or two kernels per document segment (each document's rows see a
run of its own keys: a rectangle of the earlier pieces, a causal square on its own), and a sliding window
inside a block a band of W-row strips, three kernels each (reversed square, rectangle, causal square):
:func:`pieces` with a ``budget`` takes any number of kernels as long as their work plus a fixed cost per kernel
(:data:`PIECE_OVERHEAD_PAIRS`) stays below the dense block's. Masks no such cover fits (a window of a few tokens:
a kernel per row or two) return ``None`` and run with an additive bias over the dense matrix
(:meth:`KeyRanges.dense`).

An op over several chunks whose tokens interleave (a striped layout's chunks: chunk i holds positions
≡ i mod N) has, in position order, key runs that grow by m every m rows — no short cover. The executor then
orders the op's tokens chunk by chunk and passes :class:`Blocks`: one :class:`KeyRanges` per (query chunk,
KV chunk) rectangle, each covered on its own (a striped block is one causal kernel), so such an op runs as
its blocks' kernels merged by LSE instead of one dense masked kernel (which on CPU ran 3–4x slower), or
instead of a long cover in position order when the blocks' covers cost less (:func:`worth_blocks`,
:func:`prefer_by_block`: striped
packed documents, 2,041 one-row kernels in position order against 20 by block).
The cost model asks :func:`runs_by_block` (:func:`striped_runs_by_block`, its closed form for causal
striped ops) which ops those are, and prices them block by block (torch-free: this module imports torch only
to build dense masks).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from functools import cached_property
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    import torch

MAX_PIECES = 4
#: a kernel call's fixed cost in score elements (about one 64 x 64 tile): what a long cover pays per kernel
PIECE_OVERHEAD_PAIRS = 4096


@dataclass(frozen=True)
class KeyRanges:
    """Query row i attends keys ``lo[i] <= j < hi[i]`` of ``n_keys`` ascending keys (int64 arrays [Sq])."""

    lo: np.ndarray
    hi: np.ndarray
    n_keys: int

    @classmethod
    def full(cls, n_q: int, n_k: int) -> KeyRanges:
        return cls(np.zeros(n_q, dtype=np.int64), np.full(n_q, n_k, dtype=np.int64), n_k)

    @classmethod
    def from_allowed(cls, allowed: torch.Tensor) -> KeyRanges | None:
        """The runs of a dense [Sq, Skv] bool mask, or None when a row's permitted keys are not contiguous."""
        a = allowed.cpu().numpy().astype(bool)
        n_q, n_k = a.shape
        any_ = a.any(axis=1)
        lo = np.where(any_, a.argmax(axis=1), 0)
        hi = np.where(any_, n_k - a[:, ::-1].argmax(axis=1), 0)
        ranges = cls(lo.astype(np.int64), hi.astype(np.int64), n_k)
        return ranges if int(a.sum()) == ranges.pairs else None

    @property
    def pairs(self) -> int:
        """Permitted (query, key) pairs."""
        return int((self.hi - self.lo).sum())

    @cached_property
    def kernels(self) -> list[Piece] | None:
        """:func:`kernel_cover` of these runs, computed once (an executor op runs the same mask every step)."""
        return kernel_cover(self)

    def dense(self, device) -> torch.Tensor:
        """[Sq, Skv] bool: the mask as a matrix (the fallback for masks :func:`pieces` does not cover)."""
        import torch

        j = torch.arange(self.n_keys, device=device)[None, :]
        lo, hi = torch.from_numpy(self.lo).to(device)[:, None], torch.from_numpy(self.hi).to(device)[:, None]
        return (j >= lo) & (j < hi)


@dataclass(frozen=True)
class Blocks:
    """A mask given per rectangle: ``parts`` [(r0, r1, c0, c1, KeyRanges of that rectangle)], disjoint; pairs
    outside every rectangle are not permitted. ``n_q`` × ``n_k``: the whole op's rows and keys."""

    parts: tuple[tuple[int, int, int, int, KeyRanges], ...]
    n_q: int
    n_k: int

    @property
    def pairs(self) -> int:
        """Permitted (query, key) pairs."""
        return sum(r.pairs for *_, r in self.parts)

    @cached_property
    def kernels(self) -> list[Piece] | None:
        """:func:`block_pieces` of these rectangles, computed once."""
        return block_pieces(self)

    def dense(self, device) -> torch.Tensor:
        """[n_q, n_k] bool: the mask as a matrix (CUDA's masked kernels take it whole)."""
        import torch

        out = torch.zeros(self.n_q, self.n_k, dtype=torch.bool, device=device)
        for r0, r1, c0, c1, ranges in self.parts:
            out[r0:r1, c0:c1] = ranges.dense(device)
        return out


@dataclass(frozen=True)
class Piece:
    """One kernel of a cover: rows [r0, r1) × keys [c0, c1); ``causal``: the top-left triangle of a square (row
    r0 + t sees keys c0 … c0 + t); ``anti`` (with ``causal``): the reversed triangle (row r0 + t sees keys
    c0 + t … c1 − 1), a causal kernel over the rows and keys in reverse order. Its work is a causal square's."""

    r0: int
    r1: int
    c0: int
    c1: int
    causal: bool
    anti: bool = False

    def shifted(self, rows: int, keys: int) -> Piece:
        """The same kernel ``rows`` rows and ``keys`` keys further on (a rectangle's cover moved into its op)."""
        return Piece(self.r0 + rows, self.r1 + rows, self.c0 + keys, self.c1 + keys, self.causal, self.anti)


#: runs of rows by how (lo, hi) step from one row to the next, in the order ties are broken
_RUNS = {"flat": (0, 0), "stair": (0, 1), "anti": (1, 0), "band": (1, 1)}


def pieces(ranges: KeyRanges, budget: int | None = None) -> list[Piece] | None:
    """An exact cover of the permitted pairs by dense kernels, or None: at most ``MAX_PIECES`` of them, or with
    ``budget`` (score elements) any number whose :func:`cover_cost` stays within it.

    Rows are taken in runs, the longest of four kinds at each step (ties in this order):

    * ``flat`` (equal lo, hi): one full rectangle;
    * ``stair`` (lo constant, hi + 1 per row): keys [lo, hi₀ − 1) seen by every row (a rectangle, when not
      empty) plus a causal square on keys [hi₀ − 1, hi_last);
    * ``anti`` (lo + 1 per row, hi constant; a window's far edge): a reversed square on keys [lo₀, lo₀ + L) plus
      a rectangle on keys [lo₀ + L, hi) for a run of L rows;
    * ``band`` (lo and hi + 1 per row; a window of w = hi − lo keys): strips of h = min(w, rows left) rows, each
      a reversed square on keys [lo, lo + h), a rectangle on [lo + h, hi) when w > h, and a causal square on
      rows 1… and keys [hi, hi + h − 1).

    Empty rows are skipped. An empty list: nothing is permitted. Cost: O(Sq) numpy work and O(pieces) Python.
    """
    lo, hi = ranges.lo, ranges.hi
    n = len(lo)
    dlo, dhi = np.diff(lo), np.diff(hi)
    edge = bool(((dlo[1:] == 1) & (dlo[:-1] == 1)).any())      # a far edge moving a key a row: a window's
    kinds = _RUNS if edge else {k: _RUNS[k] for k in ("flat", "stair")}
    breaks = {kind: np.flatnonzero((dlo != a) | (dhi != b)) + 1 for kind, (a, b) in kinds.items()}
    live = np.flatnonzero(hi > lo)
    out: list[Piece] = []
    cost = 0
    i = int(live[0]) if len(live) else n
    while i < n:
        ends = {kind: _next(br, i, n) for kind, br in breaks.items()}
        kind = max(kinds, key=lambda k: ends[k])            # the longest run; the first of equals
        end, a, b = ends[kind], int(lo[i]), int(hi[i])
        added = len(out)
        if kind == "flat":
            out.append(Piece(i, end, a, b, False))
        elif kind == "stair":
            if b - 1 > a:
                out.append(Piece(i, end, a, b - 1, False))
            out.append(Piece(i, end, b - 1, int(hi[end - 1]), True))
        elif kind == "anti":
            end = min(end, i + b - a)                       # rows past lo = hi see nothing
            rows = end - i
            out.append(Piece(i, end, a, a + rows, True, anti=True))
            if a + rows < b:
                out.append(Piece(i, end, a + rows, b, False))
        else:
            out += _band(i, end, a, b)
        if budget is None and len(out) > MAX_PIECES:
            return None
        if budget is not None:
            cost += cover_cost(out[added:])
            if cost > budget:
                return None
        k = int(np.searchsorted(live, end))
        i = int(live[k]) if k < len(live) else n
    return out


def _band(i: int, end: int, lo: int, hi: int) -> list[Piece]:
    """Rows [i, end) where row i + t sees keys [lo + t, hi + t): strips of h = min(w, rows left) rows."""
    width, out = hi - lo, []
    for r in range(i, end, width):
        h, a, b = min(width, end - r), lo + (r - i), hi + (r - i)
        out.append(Piece(r, r + h, a, a + h, True, anti=True))
        if width > h:
            out.append(Piece(r, r + h, a + h, b, False))
        if h > 1:
            out.append(Piece(r + 1, r + h, b, b + h - 1, True))
    return out


def kernel_cover(ranges: KeyRanges) -> list[Piece] | None:
    """The cover the executor runs: a short one (at most ``MAX_PIECES`` kernels), else any cover cheaper than the
    dense block (document boundaries: kernels per document segment), else None (an additive bias)."""
    short = pieces(ranges)
    return short if short is not None else pieces(ranges, budget=len(ranges.lo) * ranges.n_keys)


def _piece_cost(p: Piece) -> int:
    rows, cols = p.r1 - p.r0, p.c1 - p.c0
    return (rows * (rows + 1) // 2 if p.causal else rows * cols) + PIECE_OVERHEAD_PAIRS


def cover_cost(plan: list[Piece]) -> int:
    """The work of running ``plan``'s kernels, in score elements: each kernel's permitted area (a causal square
    its triangle) plus :data:`PIECE_OVERHEAD_PAIRS` — against ``Sq·Skv`` for one dense masked kernel."""
    return sum(_piece_cost(p) for p in plan)


def block_pieces(blocks: Blocks | Iterable, budget: int | None = None) -> list[Piece] | None:
    """The cover of every rectangle of ``blocks`` (:func:`kernel_cover` each; a :class:`Blocks` or its parts, which
    may come lazily), moved to the op's rows and keys; None when a rectangle has no cover cheaper than its dense
    matrix, or (with ``budget``, score elements) as soon as the covers so far cost more than it
    (:func:`cover_cost`: the rectangles after it are never taken)."""
    out: list[Piece] = []
    cost = 0
    for r0, r1, c0, c1, ranges in (blocks.parts if isinstance(blocks, Blocks) else blocks):
        if len(ranges.lo) != r1 - r0 or ranges.n_keys != c1 - c0:
            raise ValueError(f"a rectangle [{r0}, {r1}) x [{c0}, {c1}) has key ranges of another shape")
        if budget is None:
            got = kernel_cover(ranges)
        else:                       # the rectangle's cover within what is left of the budget, or None
            got = pieces(ranges)
            got = got if got is not None else pieces(ranges, budget=min(len(ranges.lo) * ranges.n_keys,
                                                                         budget - cost))
        if got is None:
            return None
        out += [p.shifted(r0, c0) for p in got]
        cost += cover_cost(got)
        if budget is not None and cost > budget:
            return None
    return out


def rectangles(mask, q_groups: list[np.ndarray], k_groups: list[np.ndarray]) -> Iterator[tuple]:
    """An op's tokens taken chunk by chunk: its (query chunk, KV chunk) rectangles with permitted pairs, as
    (r0, r1, c0, c1, :class:`KeyRanges`), lazily (a budgeted :func:`block_pieces` may stop early). ``*_groups``:
    each chunk's token positions, ascending, in the op's chunk order; ``mask``: a
    :class:`meshplan.model.workload.Mask`."""
    r0 = 0
    for qp in q_groups:
        c0 = 0
        for kp in k_groups:
            ranges = KeyRanges(*mask.key_ranges(qp, kp), len(kp))
            if ranges.pairs:
                yield r0, r0 + len(qp), c0, c0 + len(kp), ranges
            c0 += len(kp)
        r0 += len(qp)


def worth_blocks(in_order: list[Piece] | None, n_blocks: int, switches: int) -> bool:
    """Whether an op over ``n_blocks`` blocks (query chunks × KV chunks) should try its blocks' covers at all: its
    cover in position order is none, or long (more than :data:`MAX_PIECES` kernels) with no fewer kernels than
    blocks, and its tokens interleave: ``switches`` (how often the chunk changes along its query and its key
    tokens in position order, :func:`chunk_switches`) outnumber those kernels — taken chunk by chunk, every run
    of the in-order cover is cut where the chunk changes, so only interleaved chunks can come out with fewer
    (a striped op: thousands of switches; a Ulysses op over 128 contiguous chunks: 254)."""
    if n_blocks <= 1:
        return False
    return in_order is None or MAX_PIECES < len(in_order) and n_blocks <= len(in_order) < switches


def chunk_switches(owners_q: np.ndarray, owners_k: np.ndarray) -> int:
    """How often the chunk changes along an op's query and key tokens in position order (``owners_*``: each
    token's chunk, in position order)."""
    return int(np.count_nonzero(np.diff(owners_q)) + np.count_nonzero(np.diff(owners_k)))


def prefer_by_block(in_order: list[Piece] | None, by_block: list[Piece] | None) -> bool:
    """Whether an op over several chunks runs its blocks' covers (``by_block``, its tokens chunk by chunk) rather
    than the cover of its tokens in position order (``in_order``), once :func:`worth_blocks` says to try: when
    the blocks' covers cost less (:func:`cover_cost`; no cover at all costs the most). The executor and the cost
    model both decide by these two."""
    if by_block is None:
        return False
    return in_order is None or cover_cost(by_block) < cover_cost(in_order)


def by_block_budget(in_order: list[Piece] | None) -> int | None:
    """The budget to build the blocks' covers with (:func:`block_pieces`): what the in-order cover costs, past which
    they cannot win (building stops there: a per-document Ring over 64 chunks would cover 16,000 segments)."""
    return None if in_order is None else cover_cost(in_order)


def rows_overlap(plan: list[Piece]) -> bool:
    """Whether two kernels of ``plan`` write some row in common (their partial results must then merge)."""
    spans = sorted((p.r0, p.r1) for p in plan)
    return any(b0 < a1 for (_, a1), (b0, _) in zip(spans, spans[1:]))


PERIODS = 8   # tokens per strided segment that decide the cover of a periodic (striped) op: past MAX_PIECES


def runs_by_block(mask, q_segments: list[tuple[int, int, int]], k_segments: list[tuple[int, int, int]]) -> bool:
    """Whether the executor runs an op over several chunks block by block: its tokens in position order have no
    short cover under ``mask`` (a :class:`meshplan.model.workload.Mask`). ``*_segments``: the op's chunks' segments
    (start, stride, count) of global positions. Strided segments are cut to their first ``PERIODS`` tokens
    (a striped op repeats every period, and a pattern that is not a staircase needs a kernel per period:
    more than ``MAX_PIECES`` within ``PERIODS``), so the cost is O(PERIODS · segments). Exact for causal
    masks; a window or document boundary wider than the cut is not seen."""
    def positions(segments):
        parts = [a + b * np.arange(min(c, PERIODS) if b > 1 else c) for a, b, c in segments if c]
        return np.sort(np.concatenate(parts)) if parts else np.zeros(0, dtype=np.int64)

    q, k = positions(q_segments), positions(k_segments)
    return pieces(KeyRanges(*mask.key_ranges(q, k), len(k))) is None


def striped_runs_by_block(q_residues, k_residues) -> bool:
    """:func:`runs_by_block` for a causal striped op in closed form: query chunks = residues A, KV chunks =
    residues B of the period N, each chunk at least ``PERIODS`` tokens. In position order row (a, t) sees
    |B|·t + #{b ∈ B : b ≤ a} keys, so the rows form one staircase (a cover of two kernels) exactly when every
    step between consecutive rows, the period's wrap included, adds one key: |A| = |B| and A, B alternate.
    Otherwise the pattern needs new kernels every period. Depends on A and B only up to a common cyclic shift."""
    a, b = np.sort(np.asarray(q_residues)), np.sort(np.asarray(k_residues))
    if len(a) != len(b):
        return True
    seen = np.searchsorted(b, a, side="right")
    return not bool((np.diff(np.r_[seen, seen[0] + len(b)]) == 1).all())


def _next(breaks: np.ndarray, i: int, n: int) -> int:
    """The first break after row i (the end of the run that starts at i), or n."""
    k = np.searchsorted(breaks, i, side="right")
    return int(breaks[k]) if k < len(breaks) else n
