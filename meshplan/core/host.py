"""This host's memory, read without torch: what it can give new processes and what this process holds (the
search's and the run's memory checks, :mod:`meshplan.search.run_memory`; the executor's launch)."""

from __future__ import annotations

import os
from pathlib import Path


def available_memory_bytes() -> float | None:
    """Memory the host can give new processes without swapping (``MemAvailable`` of ``/proc/meminfo``, bytes);
    else free pages (``sysconf``); None when neither can be read."""
    got = _proc_kib("/proc/meminfo", "MemAvailable:")
    if got is not None:
        return got
    try:
        return float(os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE"))
    except (ValueError, OSError, AttributeError):
        return None


def resident_bytes() -> float:
    """This process's resident set now (``VmRSS``, bytes); its peak (``ru_maxrss``) where that cannot be read."""
    got = _proc_kib("/proc/self/status", "VmRSS:")
    if got is not None:
        return got
    import resource
    import sys
    return float(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * (1 if sys.platform == "darwin" else 1024))


def _proc_kib(path: str, key: str) -> float | None:
    """Bytes of a ``key: N kB`` line of a /proc file, None where it cannot be read (not Linux)."""
    try:
        for line in Path(path).read_text().splitlines():
            if line.startswith(key):
                return float(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


#: glibc ``mallopt`` parameters (``malloc.h``)
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
#: arrays up to this size come from the heap, which keeps them once freed (glibc's own limit: 32 MiB, rising)
KEEP_FREED_MAX_BYTES = 1 << 30


def keep_freed_memory() -> bool:
    """Keep freed memory in this process for the next allocation instead of handing it back to the kernel: glibc
    maps each array above its mmap threshold (128 KiB, rising to 32 MiB as arrays are freed) fresh from the kernel
    and unmaps it on free, so every large temporary numpy makes faults its pages in anew (~0.25 µs a 4 KiB page) —
    a 1024-rank schedule's verification spent 0.9 of its 2.4 s so. Returns whether it took (glibc only; elsewhere
    a no-op). For a short command whose peak is its working set (``meshplan validate``): freed memory stays
    resident until the process ends."""
    import ctypes
    import ctypes.util
    import sys
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        return bool(libc.mallopt(_M_MMAP_THRESHOLD, ctypes.c_int(KEEP_FREED_MAX_BYTES))
                    and libc.mallopt(_M_TRIM_THRESHOLD, ctypes.c_int(2**31 - 1)))
    except (OSError, AttributeError):
        return False
