"""The host-speed probe: one fixed attention kernel whose time says how fast this device runs right now.

A shared host's speed drifts: on the 2-core VM these tools were built on, the same single-thread kernel takes
16–27 ms over half an hour (other tenants, clock changes), which is larger than the cost model's error.
``meshplan calibrate`` times the probe throughout its run (``host_probe_ms`` of the calibration file) and
``meshplan run`` times it before every timed iteration (``env.probe_ms`` of the measurement, the median), so a
comparison can say how much slower or faster the host was than when it was calibrated, and give the error
with that drift taken out (:mod:`meshplan.truth.compare`). The probe is :func:`~meshplan.executor.kernels.
block_forward` of a fixed shape: on CPU fp32 Q, K, V [1, 4, 1024, 64] (4.3 GFLOP, about 20 ms on one core);
on CUDA bf16 [1, 16, 8192, 128] (about 0.2 ms on an H100).

:func:`kernel_flops_per_s` times the same kernel in a run's dtype once: the rate this host reaches now in that
dtype (on a CPU rank's threads), a measured ceiling the plausibility check (:mod:`meshplan.truth.plausible`) holds the
run's implied rates to when the calibration's peaks are another host's or another dtype's.
"""

from __future__ import annotations

import time

import numpy as np
import torch

from meshplan.executor.kernels import block_forward

SHAPES = {"cpu": ((1, 4, 1024, 64), torch.float32), "cuda": ((1, 16, 8192, 128), torch.bfloat16)}


def probe_ms(device: torch.device, samples: int = 2) -> float:
    """Median milliseconds of the probe kernel on ``device`` (one warm-up call first; on CPU one torch thread, as
    calibration and CPU ranks run)."""
    shape, dtype = SHAPES["cuda" if device.type == "cuda" else "cpu"]
    threads = torch.get_num_threads()
    if device.type != "cuda":
        torch.set_num_threads(1)
    try:
        return _timed(device, shape, dtype, samples)
    finally:
        torch.set_num_threads(threads)


def _timed(device: torch.device, shape, dtype, samples: int) -> float:
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(*shape, generator=g).to(dtype=dtype, device=device) for _ in range(3))
    scale = shape[-1] ** -0.5
    times = []
    for i in range(samples + 1):
        _sync(device)
        t0 = time.perf_counter()
        block_forward(q, k, v, scale, None)
        _sync(device)
        if i:
            times.append(time.perf_counter() - t0)
    return float(np.median(times) * 1e3)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def kernel_flops_per_s(device: torch.device, dtype: str) -> float:
    """FLOP/s of the probe's shape in ``dtype`` (bf16, fp16 or fp32) on ``device`` with the threads this process
    runs with (4·B·H·D·S² FLOPs per forward, non-causal; the best of two timings after a warm-up)."""
    from meshplan.executor.kernels import TORCH_DTYPE
    shape = SHAPES["cuda" if device.type == "cuda" else "cpu"][0]
    b, h, s, d = shape
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(*shape, generator=g).to(dtype=TORCH_DTYPE[dtype], device=device) for _ in range(3))
    times = []
    for i in range(3):
        _sync(device)
        t0 = time.perf_counter()
        block_forward(q, k, v, d ** -0.5, None)
        _sync(device)
        if i:
            times.append(time.perf_counter() - t0)
    return 4.0 * b * h * d * s * s / min(times)
