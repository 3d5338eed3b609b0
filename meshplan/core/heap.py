"""Keep the heap's freed memory for reuse instead of handing it back to the kernel at every free (glibc only).

Planning is array code: a 512-rank plan makes thousands of numpy temporaries of 0.1–10 MB. glibc's malloc serves
blocks above its mmap threshold (128 KiB, raised dynamically to at most 32 MiB) with fresh ``mmap`` pages and trims
the top of the heap back to the kernel whenever more than twice that threshold is free there, so each temporary's
pages are faulted in (and zeroed by the kernel) again: ~66,000 minor page faults per 512-rank ``plan_batch``, about
15% of its CPU time on this project's 2-core reference machine (benchmarks/plan_batch_speed.py). Fixing the
thresholds (``mallopt``, documented in mallopt(3); what ``MALLOC_MMAP_THRESHOLD_`` and ``MALLOC_TRIM_THRESHOLD_``
set from the environment) keeps freed blocks under 32 MiB in the heap and up to 256 MiB of free heap top: the
process's resident memory stays at its high-water mark (at most 256 MiB above it), which jemalloc and tcmalloc do
by default.

A short command whose peak is its working set (``meshplan validate``) keeps larger arrays too
(:func:`keep_large_arrays`): this project's virtual machines charge 0.4–4.5 s a GB the first time a process
touches memory, and reading and verifying a 1024-rank schedule makes hundreds of MB of arrays above 32 MiB.

``MESHPLAN_KEEP_HEAP=0`` leaves malloc as it is; thresholds a user already set in the environment are kept.
"""

from __future__ import annotations

import os

#: mallopt(3) parameters and the values set
M_TRIM_THRESHOLD, M_TOP_PAD, M_MMAP_THRESHOLD = -1, -2, -3
MMAP_THRESHOLD_BYTES = 32 << 20
TRIM_THRESHOLD_BYTES = 256 << 20
TOP_PAD_BYTES = 16 << 20
#: :func:`keep_large_arrays`: arrays up to this size from the heap, and the heap never trimmed
LARGE_MMAP_THRESHOLD_BYTES = 1 << 30
NEVER_TRIM_BYTES = 2**31 - 1

_done = False


def keep_freed_memory() -> bool:
    """Set glibc's malloc to keep freed memory (module docstring) once per process; True where it was set now or
    before. A no-op (False) off glibc, with ``MESHPLAN_KEEP_HEAP=0``, or where the environment sets malloc's
    thresholds already."""
    global _done
    if _done:
        return True
    if os.environ.get("MESHPLAN_KEEP_HEAP", "1") == "0" or any(
            k in os.environ for k in ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_")):
        return False
    try:
        if not (os.confstr("CS_GNU_LIBC_VERSION") or "").startswith("glibc"):
            return False
    except (ValueError, OSError, AttributeError):               # not a glibc system
        return False
    import ctypes

    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    _done = all(mallopt(p, v) == 1 for p, v in ((M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES),
                                                 (M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES),
                                                 (M_TOP_PAD, TOP_PAD_BYTES)))
    return _done


def keep_large_arrays() -> bool:
    """:func:`keep_freed_memory`, and arrays up to :data:`LARGE_MMAP_THRESHOLD_BYTES` served from the heap and kept
    there once freed, the heap never trimmed: for a short command whose peak is its working set (``meshplan
    validate`` of a 1024-rank schedule: 5.35 s → 4.32 s, median of five pairs; its resident memory stays at its
    high-water mark until it ends). True where it was set."""
    if not keep_freed_memory():
        return False
    import ctypes

    mallopt = ctypes.CDLL(None).mallopt
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return all(mallopt(p, v) == 1 for p, v in ((M_MMAP_THRESHOLD, LARGE_MMAP_THRESHOLD_BYTES),
                                                (M_TRIM_THRESHOLD, NEVER_TRIM_BYTES)))


def release_freed_memory() -> None:
    """Hand the heap's free pages back to the kernel now (glibc's ``malloc_trim``; a no-op elsewhere): before a
    process forks workers that would otherwise count the retained pages in their resident memory too."""
    if not _done:
        return
    import ctypes

    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):
        pass
