"""Arrays handed from a forked child to its parent through shared memory, not a pipe.

:func:`meshplan.core.parallel.alongside` returns the side's result pickled through a pipe: a 1024-rank schedule's
reader hands back ~64 MB of columns that way — pickled, copied twice through the kernel, unpickled into new arrays,
each copy's pages faulted in anew (0.15–0.2 s on the critical path). An :class:`Arena` made before the fork is a
shared anonymous mapping (``mmap(-1, n)``: ``MAP_SHARED``, pages allocated only as written): the child copies its
arrays into it (:meth:`Arena.put`) and sends only their places; the parent reads them in place (:meth:`Arena.get`).
Where the arena is full, :meth:`Arena.put` returns the array itself, to be pickled as before.
"""

from __future__ import annotations

import mmap

import numpy as np

#: each array's start aligned to this many bytes (a cache line)
ALIGN_BYTES = 64


class Arena:
    """A shared mapping of ``size_bytes`` that one process (the child) fills from the start (:meth:`put`) and another
    (the parent) reads (:meth:`get`). Not safe for two writers."""

    def __init__(self, size_bytes: int) -> None:
        self._map = mmap.mmap(-1, max(int(size_bytes), ALIGN_BYTES))
        self._used = 0

    def put(self, array: np.ndarray, dtype=None):
        """``array`` (cast to ``dtype``, if given) copied into the arena: its place ``(offset, dtype, shape)``; or the
        array itself (so cast) where it does not fit, or is empty."""
        dtype = np.dtype(array.dtype if dtype is None else dtype)
        size = array.size * dtype.itemsize
        start = -(-self._used // ALIGN_BYTES) * ALIGN_BYTES
        if not size or start + size > len(self._map):
            return array.astype(dtype, copy=False)
        view = np.frombuffer(self._map, dtype=dtype, count=array.size, offset=start).reshape(array.shape)
        np.copyto(view, array, casting="unsafe")
        self._used = start + size
        return start, dtype.str, array.shape

    def get(self, place) -> np.ndarray:
        """The array at ``place`` (from :meth:`put`), a read-only view of the arena; an array (one that did not fit)
        as it is."""
        if isinstance(place, np.ndarray):
            return place
        start, dtype, shape = place
        count = int(np.prod(shape, dtype=np.int64))
        view = np.frombuffer(self._map, dtype=dtype, count=count, offset=start).reshape(shape)
        view.flags.writeable = False
        return view
