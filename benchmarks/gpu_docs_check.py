"""Packed documents on one GPU: the executor's varlen kernels timed against the cost model's price (issue 24).

For a few document mixes of ``--tokens`` tokens (one long document, a handful, many short ones, a log-normal mix)
it times what the executor runs on CUDA for one block of a packed-document mask — ``block_forward`` and
``block_backward_from_out`` (torch's FlashAttention-2 varlen ops, one call per kind of piece, GQA heads expanded)
— and sets the medians beside the price :class:`meshplan.cost.doc_kernels.DocKernels` gives that block on
``h100x8`` (the ``fa2-hopper`` table: every document segment tile-quantised, plus its per-segment and per-launch
costs); and the varlen kernels alone, called with the pack's ``cu_seqlens`` as a training loop calls them (the
executor's packing left out). Single kernels only: a micro-level check of the document pricing, nothing
fitted. Llama-3-8B's heads (32 query, 8 KV, D = 128), bf16. Writes ``gpu_docs_check.json`` to ``--out``.

    python3 benchmarks/gpu_docs_check.py --out OUT_DIR        # on a machine with a CUDA GPU
    python3 benchmarks/gpu_docs_check.py --dry                # the prediction side only (no GPU): a smoke test
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

HEADS, KV_HEADS, HEAD_DIM = 32, 8, 128


def mixes(tokens: int) -> dict[str, list[int]]:
    """Document lengths summing to ``tokens``: one document, 4, 64, and a log-normal mix (median 256, σ = 1.2)."""
    rng = np.random.default_rng(0)
    lognormal: list[int] = []
    while sum(lognormal) < tokens:
        lognormal.append(int(max(8, rng.lognormal(np.log(256), 1.2))))
    lognormal[-1] -= sum(lognormal) - tokens
    if lognormal[-1] <= 0:
        lognormal.pop()
        lognormal[-1] += tokens - sum(lognormal)
    return {"1 document": [tokens], "4 documents": [tokens // 4] * 4, "64 documents": [tokens // 64] * 64,
            "log-normal mix": lognormal}


def predicted_s(lens: list[int]) -> dict[str, float]:
    """The model's seconds for the one block holding these documents (fwd, bwd) on h100x8's kernel table."""
    from meshplan.cost.cost import CostModel
    from meshplan.cost.doc_kernels import DocKernels
    from meshplan.model.matrix import attn_matrix
    from meshplan.model.topology import Topology
    from meshplan.model.workload import resolve

    w = resolve(seq_len=sum(lens), heads=HEADS, kv_heads=KV_HEADS, head_dim=HEAD_DIM, dtype="bf16",
                mask="docs:" + ",".join(map(str, lens)), layout="contiguous", passes="fwd+bwd")
    topo = Topology.load("h100x8", gpus=1)
    doc = DocKernels(CostModel(topo), attn_matrix(w, 1))
    out = {}
    for pass_ in ("fwd", "bwd"):
        fixed, scaled = doc.block_parts(pass_)
        out[pass_] = float(fixed[0] + scaled[0])
    return out


def measured_s(lens: list[int], repeat: int) -> dict[str, float]:
    """Median seconds of the executor's forward and backward of the block on the GPU (CUDA events)."""
    import torch

    from meshplan.executor.kernels import block_backward_from_out, block_forward
    from meshplan.model.blockmask import KeyRanges
    from meshplan.model.workload import Mask

    dev = torch.device("cuda")
    pos = np.arange(sum(lens))
    mask = Mask("docs", doc_lens=tuple(lens))
    ranges = KeyRanges(*mask.key_ranges(pos, pos), len(pos))
    g = torch.Generator(device=dev).manual_seed(0)
    q, do = (torch.randn(1, HEADS, len(pos), HEAD_DIM, device=dev, generator=g, dtype=torch.bfloat16)
             for _ in range(2))
    k, v = (torch.randn(1, KV_HEADS, len(pos), HEAD_DIM, device=dev, generator=g, dtype=torch.bfloat16)
            for _ in range(2))
    scale = HEAD_DIM ** -0.5

    def timed(fn) -> float:
        times = []
        for i in range(repeat + 3):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            torch.cuda.synchronize()
            if i >= 3:
                times.append(a.elapsed_time(b) * 1e-3)
        return statistics.median(times)

    o, lse = block_forward(q, k, v, scale, ranges)
    fwd = timed(lambda: block_forward(q, k, v, scale, ranges))
    bwd = timed(lambda: block_backward_from_out(q, k, v, o, do, lse, scale, ranges))
    # the kernels alone, as a training loop calls them with its cu_seqlens: packed [T, H, D], KV heads expanded
    from meshplan.executor import cuda_kernels
    cu = torch.tensor(np.concatenate([[0], np.cumsum(lens)]), dtype=torch.int32, device=dev)
    qp, dop = (x[0].transpose(0, 1).contiguous() for x in (q, do))
    kp, vp = (x[0].repeat_interleave(HEADS // KV_HEADS, dim=0).transpose(0, 1).contiguous() for x in (k, v))
    longest = max(lens)
    op, lp = cuda_kernels.VARLEN["forward"](qp, kp, vp, cu, cu, longest, longest, True, scale)
    fwd_kernel = timed(lambda: cuda_kernels.VARLEN["forward"](qp, kp, vp, cu, cu, longest, longest, True, scale))
    bwd_kernel = timed(lambda: cuda_kernels.VARLEN["backward"](dop, qp, kp, vp, op, lp, cu, cu, longest, longest,
                                                               True, scale))
    return {"fwd": fwd, "bwd": bwd, "fwd_kernel": fwd_kernel, "bwd_kernel": bwd_kernel}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--repeat", type=int, default=10)
    ap.add_argument("--out", default=".")
    ap.add_argument("--dry", action="store_true", help="predictions only (no GPU)")
    args = ap.parse_args()
    rows = []
    for name, lens in mixes(args.tokens).items():
        pred = predicted_s(lens)
        row = {"mix": name, "documents": len(lens), "longest": max(lens), "predicted_s": pred}
        if not args.dry:
            meas = measured_s(lens, args.repeat)
            row |= {"measured_s": meas, "error_pct": {p: 100 * (pred[p] / meas[p] - 1) for p in pred},
                    "kernel_error_pct": {p: 100 * (pred[p] / meas[f"{p}_kernel"] - 1) for p in pred}}
        rows.append(row)
        err = "" if args.dry else "  " + "  ".join(
            f"{p}: executor {row['measured_s'][p] * 1e3:.3f} ms ({row['error_pct'][p]:+.1f}%), kernel alone "
            f"{row['measured_s'][p + '_kernel'] * 1e3:.3f} ms ({row['kernel_error_pct'][p]:+.1f}%)" for p in pred)
        print(f"{name:16s} ({len(lens)} docs): predicted fwd {pred['fwd'] * 1e3:.3f} ms, bwd {pred['bwd'] * 1e3:.3f} ms"
              + err, flush=True)
    env = {"date": time.strftime("%Y-%m-%d %H:%M"), "tokens": args.tokens, "heads": HEADS, "kv_heads": KV_HEADS,
           "head_dim": HEAD_DIM, "dtype": "bf16", "kernel_table": "fa2-hopper (h100x8)"}
    if not args.dry:
        import torch
        env |= {"gpu": torch.cuda.get_device_name(0), "torch": torch.__version__}
    out = Path(args.out) / "gpu_docs_check.json"
    out.write_text(json.dumps({"env": env, "rows": rows}, indent=1) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
