"""This host, read without torch: its CPU's model name, the memory it can give new processes and what this process
holds (the search's and the run's memory checks, :mod:`meshplan.search.run_memory`; the executor's launch)."""

from __future__ import annotations

import os
import platform
from pathlib import Path


def cpu_name() -> str:
    """The CPU's model name (``/proc/cpuinfo``), else what the platform says."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


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
