"""This host's memory settings."""

from __future__ import annotations

import platform
import subprocess
import sys


def test_freed_memory_is_kept_on_glibc():
    """``mallopt`` takes on glibc (Linux here); elsewhere the call is a no-op that says so (in a process of its own:
    the setting lasts the process)."""
    done = subprocess.run([sys.executable, "-c", "from meshplan.core.host import keep_freed_memory as k; "
                           "print(k())"], capture_output=True, text=True, check=True, timeout=60)
    assert done.stdout.strip() == str(sys.platform.startswith("linux") and platform.libc_ver()[0] == "glibc")
