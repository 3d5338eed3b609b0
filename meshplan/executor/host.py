"""What this host is, in the terms a calibration file records (``device.cpu``, ``device.isa``): a calibration
holds for the host it was measured on, and a run records the same facts (``env.cpu``, ``env.isa`` of the
measurement) so a comparison can say when the prediction came from another host's calibration
(:func:`meshplan.truth.compare.host_match`). And what memory it has for a run's ranks (:class:`HostMemory`), which
``meshplan run`` holds the memory model's prediction to before starting them."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class HostMemory:
    """What a host offers a run: ``available_bytes`` (CPU ranks: the host's available memory; GPU ranks: the least
    free local device's), the ranks it runs (``local_ranks``), the bytes each CPU rank takes before its schedule's
    tensors (``base_bytes``: this process's resident set, with torch and the schedule loaded), and ``gpu``."""

    available_bytes: float
    local_ranks: int
    base_bytes: float
    gpu: bool


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


def free_gpu_bytes(devices: list[int]) -> float | None:
    """The least free memory among these CUDA devices (bytes), None without them."""
    if not devices or not torch.cuda.is_available():
        return None
    return float(min(torch.cuda.mem_get_info(d)[0] for d in devices))
