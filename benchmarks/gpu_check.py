"""GPU check for a machine with one CUDA GPU, in a few minutes: ``bash benchmarks/gpu_check.sh [OUT_DIR]``.

1. The executor's kernel path on one rank against float64 (bf16 and fp16; full, causal and ragged masks;
   forward and backward) with the docs/bugcases.md criterion's floor as the bound.
2. A sweep of block sizes (s_q = s_kv from 256 to 16K tokens, H = 32, D = 128, bf16) timing the forward
   and backward kernels: achieved TFLOP/s and efficiency against ``--peak-tflops`` — the rows of a kernel
   efficiency table (``meshplan/topologies/kernels/*.yaml``; FLOPs 4·B·H·D·s_q·s_kv forward, 2.5× that
   backward, full blocks).

Needs only torch (2.11–2.13) and, optionally, flash-attn; reads ``meshplan/executor/kernels.py`` from this
checkout. Writes ``gpu_check.json`` to the output folder.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from meshplan.executor.kernels import block_backward, block_forward, row_delta  # noqa: E402

FLOOR = {torch.bfloat16: 2.0 ** -8, torch.float16: 2.0 ** -11}


def reference(q, k, v, do, scale, allowed):
    """Float64 attention and gradients on the GPU ([B, H, S, D]; k, v with H heads)."""
    q, k, v, do = (t.double() for t in (q, k, v, do))
    s = (q @ k.transpose(-1, -2) * scale).masked_fill(~allowed, float("-inf"))
    lse = torch.logsumexp(s, -1)
    p = torch.exp(s - lse[..., None])
    o = p @ v
    ds = p * (do @ v.transpose(-1, -2) - (do * o).sum(-1, keepdim=True))
    return o, lse, ds @ k * scale, ds.transpose(-1, -2) @ q * scale, p.transpose(-1, -2) @ do


def check_kernels(dev) -> list[dict]:
    rows = []
    g = torch.Generator(device=dev).manual_seed(0)
    for dtype in (torch.bfloat16, torch.float16):
        for mask in ("full", "causal", "ragged"):
            B, H, S, D = 1, 4, 1024, 128
            q, k, v, do = (torch.randn(B, H, S, D, device=dev, generator=g).to(dtype) for _ in range(4))
            pos = torch.arange(S, device=dev)
            allowed = {"full": torch.ones(S, S, dtype=torch.bool, device=dev),
                       "causal": pos[None, :] <= pos[:, None],
                       "ragged": (pos[None, :] <= pos[:, None]) & (pos[:, None] - pos[None, :] < 300)}[mask]
            scale = 1 / math.sqrt(D)
            o_ref, lse_ref, *grads_ref = reference(q, k, v, do, scale, allowed)
            o, lse = block_forward(q, k, v, scale, None if mask == "full" else allowed)
            grads = block_backward(q, k, v, do, lse, row_delta(o, do), scale, None if mask == "full" else allowed)
            errs = {"out": (o.double() - o_ref).abs().max().item() / o_ref.abs().max().item(),
                    "lse": (lse.double() - lse_ref).abs().max().item() / lse_ref.abs().max().item()}
            for name, got, ref in zip(("dq", "dk", "dv"), grads, grads_ref):
                errs[name] = (got.double() - ref).abs().max().item() / ref.abs().max().item()
            rows.append({"dtype": str(dtype), "mask": mask, "relative_errors": errs,
                         "passed": all(e <= 4 * FLOOR[dtype] for e in errs.values())})
            print(rows[-1], flush=True)
    return rows


def timed(fn, reps: int) -> float:
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 1e3 / reps


def sweep(dev, peak_tflops: float) -> list[dict]:
    rows = []
    H, D = 32, 128
    for s in (256, 512, 1024, 2048, 4096, 8192, 16384):
        q, k, v, do = (torch.randn(1, H, s, D, device=dev, dtype=torch.bfloat16) for _ in range(4))
        scale = 1 / math.sqrt(D)
        o, lse = block_forward(q, k, v, scale, None)
        delta = row_delta(o, do)
        flops = 4.0 * H * D * s * s
        t_f = timed(functools.partial(block_forward, q, k, v, scale, None), 10)
        t_b = timed(functools.partial(block_backward, q, k, v, do, lse, delta, scale, None), 3)
        rows.append({"tokens": s, "fwd_s": t_f, "bwd_s": t_b, "fwd_tflops": flops / t_f / 1e12,
                     "bwd_tflops": 2.5 * flops / t_b / 1e12, "fwd_efficiency": flops / t_f / 1e12 / peak_tflops,
                     "bwd_efficiency": 2.5 * flops / t_b / 1e12 / peak_tflops})
        print(rows[-1], flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=".", help="folder for gpu_check.json")
    ap.add_argument("--peak-tflops", type=float, default=989.0, help="dense bf16 peak (H100/H200 SXM: 989)")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("gpu_check: no CUDA device")
    dev = torch.device("cuda", 0)
    try:
        import flash_attn  # noqa: F401
        flash = True
    except ImportError:
        flash = False
    t0 = time.perf_counter()
    result = {"device": torch.cuda.get_device_name(dev), "torch": torch.__version__, "flash_attn": flash,
              "peak_tflops": args.peak_tflops, "kernels": check_kernels(dev), "sweep": sweep(dev, args.peak_tflops)}
    result["wall_s"] = time.perf_counter() - t0
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "gpu_check.json").write_text(json.dumps(result, indent=1))
    print("kernels", "passed" if all(r["passed"] for r in result["kernels"]) else "FAILED", f"{result['wall_s']:.0f} s")


if __name__ == "__main__":
    main()
