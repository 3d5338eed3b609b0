"""A chunk: the token set a layout gives one rank (or one of a rank's chunks), stored as segments.

Every layout — contiguous, zigzag, striped (:mod:`meshplan.model.matrix`) and doc-place
(:mod:`meshplan.model.doc_place`) — produces one :class:`Chunking`; the matrix counts work from it.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import numpy as np


@dataclass(frozen=True)
class Chunking:
    """The token sets of ``n`` chunks, each ``n_seg`` segments (arrays of shape [n, n_seg]).

    ``offset[i, k]`` is where segment k starts in chunk i's local token order (chunk-local index);
    ``q_offset[i, k]`` the same in the order of its query tokens (the segments of query-holding regions;
    without a cached prefix, every segment). ``holds_q[k]``: segment column k belongs to a query region;
    ``real_end[i, k]``: tokens of chunk i's segment k at positions >= it are padding (each segment's real
    tokens come first: a region's padding is its tail, and packed documents with padding are cut into one
    segment per document, see :func:`chunking`).
    """

    layout: str
    n: int
    start: np.ndarray
    stride: np.ndarray
    count: np.ndarray
    offset: np.ndarray
    holds_q: np.ndarray
    real_end: np.ndarray

    @cached_property
    def tokens(self) -> np.ndarray:
        """[n] tokens per chunk (KV side: every token the chunk holds)."""
        return self.count.sum(axis=1)

    @cached_property
    def q_tokens(self) -> np.ndarray:
        """[n] query tokens per chunk (its tokens outside a cached prefix)."""
        return (self.count * self.holds_q[None, :]).sum(axis=1)

    @cached_property
    def q_offset(self) -> np.ndarray:
        """[n, n_seg] where each segment starts among its chunk's query tokens (see the class docstring)."""
        qc = self.count * self.holds_q[None, :]
        return np.cumsum(qc, axis=1) - qc

    @property
    def tokens_per_chunk(self) -> int:
        """c: tokens per chunk (the smallest chunk's, where a decode token makes one chunk bigger)."""
        return int(self.tokens.min())

    def segments(self, i: int) -> list[tuple[int, int, int]]:
        """Chunk i's segments as (start, stride, count) of global token positions, in local order."""
        return [(int(a), int(b), int(c)) for a, b, c in zip(self.start[i], self.stride[i], self.count[i]) if c]

    def positions(self, i: int) -> np.ndarray:
        """Global token positions of chunk i in its local order (for tests and the executor)."""
        return np.concatenate([a + b * np.arange(c) for a, b, c in self.segments(i)] or [np.zeros(0, np.int64)])
