"""meshplan.core.heap: freed numpy temporaries reuse the heap's pages instead of being faulted in again."""

import os
import subprocess
import sys

import pytest

PROBE = """
import resource, sys
import numpy as np
from meshplan.core.heap import keep_freed_memory
kept = keep_freed_memory()
def step():                                              # four 4 MB temporaries alive at once, then freed
    return sum(float(a.sum()) for a in [np.ones(1 << 19) for _ in range(4)])
step()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(50):
    step()                                               # 4096 pages each
print(kept, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def _probe(**env) -> tuple[bool, int]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, check=True, timeout=60,
                         env=clean | env).stdout.split()
    return out[0] == "True", int(out[1])


@pytest.mark.skipif(not (os.confstr("CS_GNU_LIBC_VERSION") if hasattr(os, "confstr") else "").startswith("glibc"),
                    reason="glibc's mallopt only")
def test_freed_arrays_reuse_their_pages_and_the_switch_turns_it_off():
    kept, faults = _probe()
    assert kept and faults < 1024                        # not even one array's pages faulted in again
    kept, faults = _probe(MESHPLAN_KEEP_HEAP="0")
    assert not kept and faults > 10 * 4096               # glibc default: the freed heap top trimmed, faulted again


LARGE_PROBE = """
import resource, sys
from meshplan.core import heap
kept = heap.keep_large_arrays() if sys.argv[1] == "large" else heap.keep_freed_memory()
def step():                             # two 64 MB buffers (the text of a schedule): above the 32 MiB threshold
    return sum(len(b) for b in [bytearray(b"x") * (1 << 26) for _ in range(2)])
step()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(5):
    step()
print(kept, resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


@pytest.mark.skipif(not (os.confstr("CS_GNU_LIBC_VERSION") if hasattr(os, "confstr") else "").startswith("glibc"),
                    reason="glibc's mallopt only")
def test_a_short_command_keeps_arrays_above_32_mib_too():
    """keep_large_arrays (``meshplan validate``): 64 MB buffers freed and made again reuse their pages; with the
    default heap settings each one is mapped and faulted in anew (16,384 pages)."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    runs = {}
    for mode in ("large", "default"):
        out = subprocess.run([sys.executable, "-c", LARGE_PROBE, mode], capture_output=True, text=True, check=True,
                             timeout=60, env=clean).stdout.split()
        runs[mode] = (out[0] == "True", int(out[1]))
    assert runs["large"][0] and runs["large"][1] < 2048
    assert runs["default"][1] > 5 * 16384
