"""Compressed sparse rows (CSR): ragged per-op lists (deps, inputs, chunks) stored as a pointer array and
one flat value array; row k is ``values[ptr[k]:ptr[k + 1]]``. Also :func:`unique_rows`, for rows of equal width."""

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


def unique_rows(rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(index of the first of each distinct row, [k] each row's position among those) of an int array [k, m]:
    each row compared as one byte string (one 1-D sort, not ``np.unique(axis=0)``'s lexicographic one)."""
    rows = np.ascontiguousarray(rows, dtype=np.int64)
    _, first, again = np.unique(rows.view(np.dtype((np.void, 8 * rows.shape[1]))).ravel(), return_index=True,
                                return_inverse=True)
    return first, again.ravel()
