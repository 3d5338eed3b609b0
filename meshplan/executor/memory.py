"""Keep freed host memory for reuse, so large CPU buffers do not fault their pages in afresh on every op.

torch's CPU allocator takes each buffer from the C library. glibc serves blocks above its mmap threshold (at
most 32 MiB, adaptive) with a fresh ``mmap`` and returns them on free, so every large staging copy, wire image
or output pays a page fault per 4 KiB page: measured here, a 64 MiB copy into a new buffer takes 43 ms, into
reused memory 10 ms (a 1 MiB one 0.6 vs 0.07 ms). :func:`reuse_freed_memory` raises glibc's mmap and trim
thresholds (``mallopt``, M_MMAP_THRESHOLD and M_TRIM_THRESHOLD) so freed blocks stay in the heap for the next
op — what PyTorch's CPU performance guide gets by preloading jemalloc or tcmalloc. It also keeps one malloc
arena (M_ARENA_MAX = 1): with one per thread, a buffer freed by the compute thread is not reused by the
communication thread's next allocation, and a rank's memory kept growing over iterations (measured: a 2-rank
Ring at 2K tokens rose 203 MB with per-thread arenas, 92 MB with one). Executor ranks and calibration call it
at start; elsewhere (macOS, musl) it does nothing.

:func:`reset_peak_rss` and :func:`peak_rss` measure how far a rank's resident memory rises while it runs its
passes (Linux ``/proc``; the kernel's ``clear_refs`` documentation, value 5), after :func:`trim_heap` has
returned the freed heap to the system (``malloc_trim``), so the rise counts the pages the pass touches anew;
``compare`` sets it against the memory model's prediction (:mod:`meshplan.cost.memory`).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys

_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD, _M_ARENA_MAX = -1, -3, -8
_THRESHOLD_BYTES = 1 << 30


def reset_peak_rss() -> int | None:
    """Reset this process's resident-set high-water mark (Linux: ``5`` into ``/proc/self/clear_refs``, which
    sets VmHWM to the current RSS) and return the current RSS in bytes; None where that cannot be done."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return _status_bytes("VmRSS")
    except OSError:
        return None


def peak_rss() -> int | None:
    """This process's resident-set high-water mark in bytes since the last :func:`reset_peak_rss` (VmHWM)."""
    try:
        return _status_bytes("VmHWM")
    except OSError:
        return None


def _status_bytes(key: str) -> int | None:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024          # the kernel reports kB
    return None


def _libc():
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return None


def reuse_freed_memory() -> bool:
    """Set the thresholds to 1 GiB and one malloc arena in this process; returns whether glibc accepted them."""
    libc = _libc()
    try:
        return libc is not None and bool(libc.mallopt(_M_MMAP_THRESHOLD, _THRESHOLD_BYTES)) and bool(
            libc.mallopt(_M_TRIM_THRESHOLD, _THRESHOLD_BYTES)) and bool(libc.mallopt(_M_ARENA_MAX, 1))
    except AttributeError:
        return False


def trim_heap() -> None:
    """Return the heap's free memory to the system (glibc ``malloc_trim(0)``, every arena); elsewhere nothing."""
    libc = _libc()
    try:
        if libc is not None:
            libc.malloc_trim(0)
    except AttributeError:
        pass


def memory_mark(device) -> int | None:
    """Start measuring a memory rise on ``device`` (a torch device): garbage collected, then the CUDA allocator's
    peak reset (returns what is allocated), or on CPU the freed heap returned and the high-water mark reset
    (returns the resident set); None where it cannot be read."""
    import gc

    import torch

    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        return torch.cuda.memory_allocated(device)
    trim_heap()
    return reset_peak_rss()


def memory_top(device) -> int | None:
    """The high-water mark since :func:`memory_mark`: the CUDA allocator's peak, or on CPU the resident set's."""
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)
        return int(torch.cuda.max_memory_allocated(device))
    return peak_rss()
