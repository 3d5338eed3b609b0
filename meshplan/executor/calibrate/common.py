"""What every micro-benchmark of ``meshplan calibrate`` shares: the sweep (what to measure and how often), the
progress log, device sync, the typical of samples and random Q, K, V."""

from __future__ import annotations

import sys
from dataclasses import dataclass, replace

import numpy as np
import torch

from meshplan.executor.kernels import TORCH_DTYPE


@dataclass(frozen=True)
class Sweep:
    """What to measure and how often."""

    tokens: tuple[int, ...] = (32, 64, 128, 256, 512, 1024, 2048, 4096)      # above: the edge value holds
    batch: int = 1
    heads: int = 4
    head_dim: int = 64
    dtype: str = "fp32"                         # CPU: the dtype the executor computes in (kernels.compute_dtype)
    head_dims: tuple[int, ...] = (32, 64, 128)  # the head-dim multiplier's dims (head_dim among them)
    head_dim_tokens: tuple[int, ...] = (512, 2048)
    dtype_tokens: tuple[int, ...] = (128, 256, 512, 1024, 2048)   # the dtype multipliers' sizes (s × s)
    dtype_rounds: int = 7                       # interleaved rounds of the dtype sweep (one row each)
    samples: int = 5
    min_sample_s: float = 0.005
    gemm_n: int = 2048
    merge_tokens: tuple[int, ...] = (512, 2048, 8192)
    p2p_sizes: tuple[int, ...] = tuple(1 << k for k in range(10, 27, 2))      # 1 KiB .. 64 MiB
    overlap_tokens: int = 2048
    overlap_msg_bytes: int = 4 << 20
    sharing_tokens: int = 2048                  # blocks as large as real ones: cores share caches and memory
    sharing_ranks: tuple[int, ...] = (1, 2, 3, 4)
    # document mixes (tokens per document) whose blocks run one kernel per document: the per-segment cost
    segment_mixes: tuple[tuple[int, ...], ...] = ((64,) * 32, (128,) * 16, (256,) * 8, (512,) * 4,
                                                  (48, 96, 160, 300, 500, 944))
    backend: str = "gloo"
    init_method: str = ""


FULL = Sweep()


#: the transfer sizes reach 16 MiB: with only 1 and 4 MiB above the fit's 1 MiB floor, a busy host's noise once made
#: the larger one faster and the fit refused the run ("transfer times do not grow with the size")
QUICK = Sweep(tokens=(64, 256), samples=2, gemm_n=512, merge_tokens=(256, 1024),
              p2p_sizes=(4096, 65536, 1 << 20, 4 << 20, 16 << 20), overlap_tokens=256, overlap_msg_bytes=1 << 20,
              sharing_tokens=256, sharing_ranks=(1, 2), head_dims=(64, 128), head_dim_tokens=(256,),
              dtype_tokens=(64, 256), dtype_rounds=2, segment_mixes=((64,) * 8, (256,) * 2))


GPU = replace(FULL, tokens=tuple(256 << k for k in range(7)), heads=32, head_dim=128, gemm_n=8192,   # untested here
              dtype="bf16", head_dims=(64, 128, 256), head_dim_tokens=(1024, 8192),
              merge_tokens=(1024, 4096, 16384), p2p_sizes=tuple(1 << k for k in range(10, 29, 2)), overlap_tokens=16384,
              overlap_msg_bytes=64 << 20, segment_mixes=((128,) * 64, (512,) * 16, (2048,) * 4))


def log(msg: str) -> None:
    """One progress line on stderr, folded at 100 columns."""
    import textwrap

    sys.stderr.write(textwrap.fill(f"calibrate: {msg}", 100, subsequent_indent="  ") + "\n")
    sys.stderr.flush()


# ---------------------------------------------------------------------------------------------- timing
def sync(device: torch.device) -> None:
    """Wait for the device's queued work (a no-op on CPU)."""
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()


def typical(xs: list[float]) -> float:
    """The median, 6 significant digits. (A lower quartile would pick the fast phases of a shared host, whose
    speed drifts by ±15% over tens of seconds here, while the runs it predicts see its typical speed.)"""
    return float(f"{float(np.median(xs)):.6g}")


def qkv(sweep: Sweep, s_q: int, s_kv: int, device):
    """Random Q [B, H, s_q, D] and K, V [B, H, s_kv, D] in the sweep's dtype."""
    dt, shape = TORCH_DTYPE[sweep.dtype], (sweep.batch, sweep.heads)
    q = torch.randn(*shape, s_q, sweep.head_dim, dtype=dt, device=device)
    k = torch.randn(*shape, s_kv, sweep.head_dim, dtype=dt, device=device)
    return q, k, torch.randn_like(k)
