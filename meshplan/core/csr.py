"""Compressed sparse rows (CSR): ragged per-op lists (deps, inputs, chunks) stored as a pointer array and
one flat value array; row k is ``values[ptr[k]:ptr[k + 1]]``."""

from __future__ import annotations

import numpy as np


def csr_ptr(counts: np.ndarray) -> np.ndarray:
    """Row pointers (int64, length rows + 1) of a CSR array whose rows have ``counts`` entries."""
    ptr = np.zeros(len(counts) + 1, dtype=np.int64)
    np.cumsum(counts, out=ptr[1:])
    return ptr


def csr_take(ptr: np.ndarray, values: np.ndarray, order: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Reorder the rows of a CSR array: row k of the result is row ``order[k]`` of the input."""
    counts = np.diff(ptr)[order]
    new_ptr = csr_ptr(counts)
    starts = np.repeat(ptr[:-1][order] - new_ptr[:-1], counts)
    return new_ptr, values[np.arange(new_ptr[-1]) + starts]


def csr_sum(ptr: np.ndarray, values: np.ndarray) -> np.ndarray:
    """Sum of each CSR row (float64)."""
    rows = len(ptr) - 1
    seg = np.repeat(np.arange(rows), np.diff(ptr))
    return np.bincount(seg, weights=values, minlength=rows).astype(np.float64)
