"""Memory micro-benchmarks for ``meshplan calibrate``: how much each of the executor's ops takes while it runs.

Every compute op of rank 0 of two small 2-rank schedules (Ring: its backward starts from O; pass-Q: from D),
at a few sizes and in the dtypes measured, runs alone through the executor's own op code
(:class:`~meshplan.executor.ops.OpRunner`) with its inputs and outputs already allocated; its workspace is how
far the process's memory rises meanwhile — on CPU the resident set (:mod:`meshplan.executor.memory`: freed heap
returned first, then the high-water mark reset), on CUDA the allocator's peak. Merges and wire images are
measured the same way. These are micro-level samples: :func:`meshplan.truth.memory_fit.fit_memory` fits the model's
coefficients to them, and the end-to-end runs the model is judged on are never among them.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from meshplan.executor.kernels import TORCH_DTYPE
from meshplan.executor.memory import memory_mark, memory_top
from meshplan.executor.ops import OpRunner
from meshplan.executor.store import Store, pack
from meshplan.plan.schedule import Schedule


def _rise(fn, device: torch.device, repeats: int = 2) -> int:
    """Bytes the process's memory rose while ``fn()`` ran (its result dropped afterwards): the least of
    ``repeats`` runs (the first pays one-time allocations of the runtime, a thread pool's or a kernel's)."""
    return min(_rise_once(fn, device) for _ in range(repeats))


def _rise_once(fn, device: torch.device) -> int:
    base = memory_mark(device)
    fn()
    top = memory_top(device)
    return max(int(top) - int(base), 0) if base is not None and top is not None else 0


def compute_samples(schedules: Sequence[Schedule], device: torch.device) -> list[dict]:
    """One sample per compute op of rank 0 of each schedule: pass, kernel shape (s_q, s_kv, heads), dtype and its
    rise. ``schedules``: small 2-rank schedules planned by the caller
    (:func:`meshplan.truth.memory_fit.sample_schedules`); the executor only runs them."""
    from meshplan.executor.program import program_of

    out = []
    for sched in schedules:
        w, o = sched.workload, sched.ops
        prog = program_of(sched)
        for pass_ in prog.passes:
            for op in prog.ops_of(0, pass_):
                if op.kind != "compute":
                    continue
                i = op.id
                out.append({"dtype": w.dtype, "pass": pass_, "s_q": int(o.s_q[i]), "s_kv": int(o.s_kv[i]),
                            "batch": 1, "heads": int(o.h1[i] - o.h0[i]), "head_dim": w.head_dim,
                            "rise_bytes": _op_rise(prog, op, w.dtype, w.head_dim, device)})
    return out


def _op_rise(prog, op, dtype: str, head_dim: int, device: torch.device) -> int:
    """The rise of one compute op run alone, its inputs (random) and outputs allocated beforehand."""
    store = Store(device)
    for tid in {*op.inputs, *op.outputs}:
        for part in store.alloc(tid, prog.layout(tid), dtype).values():
            part.normal_()
    runner = OpRunner(prog, store, head_dim ** -0.5)
    return _rise(lambda: runner.compute(op), device)


def merge_samples(tokens: tuple[int, ...], dtype: str, heads: int, head_dim: int, device: torch.device) -> list:
    """(bytes merged, rise) of the executor's merge op (:meth:`OpRunner.fold`: an (O, LSE) into another)."""
    from meshplan.executor.kernels import merge_into

    dt = TORCH_DTYPE[dtype]
    rows = []
    for s in tokens:
        o_acc = torch.randn(1, s, heads, head_dim, device=device).to(dt)
        lse_acc = torch.randn(1, heads, s, device=device)
        o_p, lse_p = torch.randn_like(o_acc), torch.randn_like(lse_acc)
        rise = _rise(lambda: merge_into(o_acc.transpose(1, 2), lse_acc, o_p.transpose(1, 2), lse_p), device)  # noqa: B023
        rows.append((o_acc.numel() * o_acc.element_size() + lse_acc.numel() * 4, rise))
    return rows


def wire_samples(sizes_bytes: tuple[int, ...], device: torch.device) -> list:
    """(wire bytes, rise) of packing a tensor for a send (:func:`meshplan.executor.store.pack`)."""
    rows = []
    for size in sizes_bytes:
        parts = {"k": torch.randn(size // 8, device=device), "v": torch.randn(size // 8, device=device)}
        rows.append((size, _rise(lambda: pack(parts, "kv", "fp32"), device)))          # noqa: B023
    return rows


def declared_run_samples(declared: Schedule, repeats: int = 3) -> list[dict]:
    """The declared run (``declared``: the schedule of :data:`meshplan.truth.memory_fit.DECLARED_RUN`, planned by
    the caller) by the executor on gloo ranks, ``repeats`` times: each run's memory (the largest over ranks and
    passes of ``peak_rise_bytes``), for ``overhead_factor`` (their median; one run's rise varied from 1.01x to 1.32x
    the model's peak here). CPU calibrations only: on GPUs the factor stays 1 until a GPU run is declared."""
    import tempfile
    from pathlib import Path

    from meshplan.executor.launch import run
    from meshplan.executor.worker import RunConfig
    from meshplan.plan.json.io import write_schedule

    rises = []
    with tempfile.TemporaryDirectory() as tmp:
        path = write_schedule(declared, Path(tmp) / "declared.json")
        for _ in range(repeats):
            meas = run(str(path), None, RunConfig(backend="gloo", iters=1, warmup=1, check=False))
            rises.append(meas.get("peak_rise_bytes") if meas else None)
    return [{"kind": "declared-run", "rise_bytes": int(r)} for r in rises if r is not None]


def measure_memory(device: torch.device, schedules: Sequence[Schedule]) -> list[dict]:
    """Every memory sample but the declared run's (the ``raw.memory`` of a calibration file): the compute ops of
    ``schedules`` (2-rank, one head shape), and merges and wire images at the sizes of their workloads."""
    samples = [{"kind": "compute", **s} for s in compute_samples(schedules, device)]
    w = schedules[0].workload
    seq_lens = tuple(sorted({s.workload.seq_len for s in schedules}))
    for dtype in dict.fromkeys(s.workload.dtype for s in schedules):
        samples += [{"kind": "merge", "dtype": dtype, "size_bytes": b, "rise_bytes": r}
                    for b, r in merge_samples(seq_lens, dtype, w.n_heads, w.head_dim, device)]
    samples += [{"kind": "transfer", "size_bytes": b, "rise_bytes": r}
                for b, r in wire_samples(tuple(s // 2 * w.n_heads * w.head_dim * 16 for s in seq_lens), device)]
    return samples
