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
