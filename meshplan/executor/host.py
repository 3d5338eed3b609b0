"""What this host is, in the terms a calibration file records (``device.cpu``, ``device.isa``): a calibration
holds for the host it was measured on, and a run records the same facts (``env.cpu``, ``env.isa`` of the
measurement) so a comparison can say when the prediction came from another host's calibration
(:func:`meshplan.compare.host_match`)."""

from __future__ import annotations

import platform
from pathlib import Path

import torch


def cpu_isa() -> str | None:
    """The CPU's widest vector unit as torch sees it (``amx``, ``avx512_bf16``, ``avx512``, ``avx2``, or
    torch's own name), which decides how fast half-precision kernels run; None on CUDA-only probes."""
    try:
        if torch.cpu._is_amx_tile_supported():
            return "amx"
        if torch.cpu._is_avx512_bf16_supported():
            return "avx512_bf16"
    except AttributeError:
        pass
    return torch.backends.cpu.get_cpu_capability().lower()


def cpu_name() -> str:
    """The CPU's model name (``/proc/cpuinfo``), else what the platform says."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()
