"""Array helpers numpy lacks in a fast form."""

from __future__ import annotations

import numpy as np

_MULTIPLIERS = np.random.default_rng(0x6D657368).integers(1, 2**63, size=256, dtype=np.uint64) | np.uint64(1)


def unique_rows(rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(the distinct rows of an integer [m, k] array, [m] index of each row's distinct row) — ``np.unique(rows,
    axis=0, return_inverse=True)``'s answer up to the order of the distinct rows, without its sort of whole rows
    (0.6 s for 0.3M rows of up to 27 columns; this: ~30 ms). Rows are hashed to one uint64 each (a random linear
    map, wrapping), the hashes made unique, and every row compared with its hash's first row: a collision (two
    distinct rows, one hash) falls back to ``np.unique``, so the answer is exact."""
    rows = np.asarray(rows)
    if rows.ndim != 2 or rows.shape[1] > len(_MULTIPLIERS) or not np.issubdtype(rows.dtype, np.integer):
        raise ValueError("unique_rows takes a 2-D integer array of at most 256 columns")
    if len(rows) == 0:
        return rows[:0], np.zeros(0, dtype=np.int64)
    hashed = rows.astype(np.uint64) @ _MULTIPLIERS[: rows.shape[1]]
    _, first, inv = np.unique(hashed, return_index=True, return_inverse=True)
    inv = inv.ravel()
    if not np.array_equal(rows[first][inv], rows):                  # a collision: sort the rows themselves
        uniq, inv = np.unique(rows, axis=0, return_inverse=True)
        return uniq, inv.ravel()
    return rows[first], inv
