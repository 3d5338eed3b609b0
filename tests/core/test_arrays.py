"""unique_rows against numpy's own row-wise unique."""

import numpy as np
import pytest

import meshplan.core.arrays as arrays
from meshplan.core.arrays import unique_rows


def _as_set_and_back(rows, uniq, inv):
    assert np.array_equal(uniq[inv], rows)                       # every row maps to itself
    assert len({tuple(r) for r in uniq.tolist()}) == len(uniq)   # each distinct once
    assert len(uniq) == len(np.unique(rows, axis=0))


@pytest.mark.parametrize("shape", [(1, 1), (50, 3), (2000, 27), (500, 1)])
def test_unique_rows_matches_numpy(shape):
    rows = np.random.default_rng(1).integers(-3, 4, size=shape)
    _as_set_and_back(rows, *unique_rows(rows))


def test_a_hash_collision_falls_back_to_sorting_the_rows(monkeypatch):
    """With every row hashed to one value the first-row check fails and numpy's sort answers (exactly)."""
    monkeypatch.setattr(arrays, "_MULTIPLIERS", np.zeros(256, dtype=np.uint64))
    rows = np.random.default_rng(2).integers(0, 3, size=(300, 4))
    _as_set_and_back(rows, *unique_rows(rows))


def test_unique_rows_refuses_what_it_cannot_hash():
    with pytest.raises(ValueError, match="2-D integer"):
        unique_rows(np.zeros((3, 2)))
    empty, inv = unique_rows(np.zeros((0, 3), dtype=np.int64))
    assert empty.shape == (0, 3) and len(inv) == 0
