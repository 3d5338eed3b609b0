"""Micro-benchmarks for ``meshplan calibrate``: what the executor's own pieces cost on this host.

* **matmul peak** per dtype (an n × n × n matmul, 2n³ FLOP): the peak the efficiencies are relative to;
* **attention kernels**: the executor's :func:`~meshplan.executor.kernels.block_forward` and
  :func:`~meshplan.executor.kernels.block_backward_from_out` (the CPU flash backward; on CUDA it is the fp32
  recurrence, as in the executor) on every (s_q, s_kv) of a power-of-two grid, full, plus the causal-diagonal
  pieces (s × s, elementwise mask), and a 1-token kernel for the fixed cost per call;
* **merges**: the executor's merge of a block's result into its output (:func:`~meshplan.executor.ops.combine`:
  gather, fp32 LSE merge, write back) at a few sizes;
* the **host-speed probe** (:mod:`meshplan.executor.probe`) before, during and after, so a later run can say
  how much faster or slower the host is than when it was calibrated;
* in a spawned world (gloo ranks on loopback, or NCCL on GPUs 0 and 1): **point-to-point** transfers between
  ranks 0 and 1 (ping-pong, half the round trip, 1 KB .. 64 MB) and both directions at once; one **overlap**
  run (ranks 0 and 1 run a kernel while exchanging messages, against the same kernel alone); **core
  sharing** on CPU (1, 2, ... ranks running the same kernel at once; idle ranks wait in a barrier); these
  in :mod:`meshplan.executor.calibrate.ranks`.

CPU ranks run one torch thread each (the executor gives each rank cores // ranks threads). Every timing is
the median of a few samples after a warm-up (:func:`typical`); a kernel sample repeats short calls
to last a few milliseconds, a transfer sample is one round. Results are plain data in the
:class:`meshplan.model.calibration_file.Raw` form; progress goes to stderr.
"""

from __future__ import annotations

import functools
import math
import os
import time
from contextlib import contextmanager
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np
import torch

from meshplan.core.host import cpu_name
from meshplan.executor.calibrate.common import FULL, GPU, QUICK, Sweep, log, qkv, sync, typical
from meshplan.executor.host import cpu_isa
from meshplan.executor.kernels import TORCH_DTYPE, block_backward, block_backward_from_out, block_forward
from meshplan.executor.launch import resolve_backend
from meshplan.executor.memory import reuse_freed_memory
from meshplan.executor.probe import probe_ms
from meshplan.model.blockmask import KeyRanges
from meshplan.plan.schedule import Schedule

LONG_CALL_S = 0.1      # calls longer than this get 3 samples: their noise is small, their time is not


@dataclass(frozen=True)
class MemorySchedules:
    """What the memory samples run, planned by the caller (the executor is handed schedules; it never plans):
    ``compute``, small schedules whose compute ops run alone; ``declared``, the declared run (None: not run) and
    how many times."""

    compute: tuple[Schedule, ...]
    declared: Schedule | None = None
    repeats: int = 0


def measure(memory: MemorySchedules, backend: str = "auto", quick: bool = False,
            link_class: str | None = None) -> tuple[dict, dict]:
    """Run every micro-benchmark; returns (raw measurements, host facts) as plain dicts.

    Raises:
        UserError: a backend this host lacks.
        RunFailed: a spawned rank failed (its one-line reason).
    """
    resolved = resolve_backend(backend)
    sweep = replace(QUICK if quick else GPU if resolved == "nccl" else FULL, backend=resolved)
    load = round(os.getloadavg()[0], 2) if hasattr(os, "getloadavg") else None
    before = _cpu_snapshot()
    cuda = sweep.backend == "nccl"
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    probes: list[float] = []
    reuse_freed_memory()                     # the executor's ranks run so (meshplan.executor.memory)
    with torch_threads(None if cuda else 1):
        probes.append(probe_ms(device))
        raw = {"dtype": sweep.dtype, "gemm": _gemm(sweep, device), "launch_s": _launch(sweep, device),
               "kernels": _kernels(sweep, device, probes), "dtype_sweep": dtype_sweep(sweep, device),
               "memory": memory_samples(device, memory)}
        raw["segment_mixes"] = _segments(sweep, device)
        merges = _merges(sweep, device)
        raw["merges"] = [r[1:] for r in merges if r[0] == sweep.dtype]
        raw["dtype_merges"] = [r for r in merges if r[0] != sweep.dtype]
        recurrence = _recurrence(sweep, device)
        raw["recurrence"] = [r[1:] for r in recurrence if r[0] == sweep.dtype]
        raw["dtype_recurrence"] = [r for r in recurrence if r[0] != sweep.dtype]
        probes.append(probe_ms(device))
    raw["dtype_kernels"] = _dtype_kernels(sweep, raw["dtype_sweep"])
    raw["head_dim_kernels"] = _head_dim_kernels(sweep, raw["dtype_sweep"])
    world = (2 if torch.cuda.device_count() >= 2 else 0) if cuda else max(sweep.sharing_ranks)
    if world >= 2:
        from meshplan.executor.calibrate.ranks import spawn

        log(f"spawning {world} {sweep.backend} ranks")
        raw |= spawn(world, sweep)
        raw["link_class"] = link_class
    else:
        log("one GPU: no transfers to measure (links, p2p_overhead_us and kappa keep the topology's values)")
    with torch_threads(None if cuda else 1):
        probes.append(probe_ms(device))
    raw["probe_ms"] = [round(p, 4) for p in probes]
    log(f"host-speed probe: {min(probes):.2f}–{max(probes):.2f} ms (median {float(np.median(probes)):.2f})")
    others = _others_busy_cores(before, _cpu_snapshot())
    if others is not None and others > 0.1:
        log(f"warning: other processes kept {others:.2f} cores busy during the run; the numbers are noisy, "
            "calibrate again on an idle host")
    facts = {"cpu": cpu_name(), "isa": cpu_isa(), "cores": os.cpu_count() or 1,
             "gpu": torch.cuda.get_device_name(0) if cuda else None,
             "torch": torch.__version__, "backend": sweep.backend, "threads_per_rank": 1, "load_1min": load,
             "others_busy_cores": others}
    return raw, facts


def _cpu_snapshot() -> tuple[float, float, float] | None:
    """(host busy CPU-seconds, this process's and its reaped children's CPU-seconds, wall clock); None off Linux."""
    try:
        v = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
    except (OSError, ValueError):
        return None
    t = os.times()
    busy = sum(v) - v[3] - v[4]                       # all but idle and iowait (steal counts: another VM ran)
    return busy / os.sysconf("SC_CLK_TCK"), t.user + t.system + t.children_user + t.children_system, time.time()


def _others_busy_cores(before, after) -> float | None:
    """Cores that other processes (or the hypervisor) kept busy, on average, between two snapshots."""
    if before is None or after is None:
        return None
    (b0, m0, w0), (b1, m1, w1) = before, after
    return round(max(0.0, (b1 - b0) - (m1 - m0)) / max(w1 - w0, 1e-9), 3)


def _time(fn, device, sweep: Sweep, samples: int | None = None) -> float:
    """Typical seconds of one call: a warm-up, then samples of enough calls to last ``min_sample_s``."""
    reps, n = _plan(fn, device, sweep)
    return typical([_sample(fn, device, reps) for _ in range(samples or n)])


@contextmanager
def torch_threads(n: int | None):
    """Run the block with torch on ``n`` threads (None: as it is), restoring the count after."""
    before = torch.get_num_threads()
    if n:
        torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


# ---------------------------------------------------------------------------------------------- one process
def _gemm(sweep: Sweep, device) -> list:
    """(dtype, n, seconds) of n³ matmuls; on CPU fp32 only (a CPU without native bf16 runs a bf16 matmul at a few
    hundred MFLOP/s; the half-precision attention peaks come from attention kernels, :func:`_dtype_kernels`)."""
    n, rows = sweep.gemm_n, []
    for name in ("bf16", "fp16", "fp32") if device.type == "cuda" else ("fp32",):
        a = torch.randn(n, n, dtype=TORCH_DTYPE[name], device=device)
        b = torch.randn(n, n, dtype=TORCH_DTYPE[name], device=device)
        rows.append((name, n, _time(lambda: a @ b, device, sweep, 3)))         # noqa: B023 - called at once
        log(f"matmul {name}: {2 * n ** 3 / rows[-1][2] / 1e9:.1f} GFLOP/s")
    return rows


def _launch(sweep: Sweep, device) -> list[float]:
    q, k, v = qkv(replace(sweep, batch=1, heads=1), 1, 1, device)
    return [_time(lambda: block_forward(q, k, v, 1.0, None), device, sweep, 1) for _ in range(3)]


def _kernels(sweep: Sweep, device, probes: list[float]) -> list[dict]:
    """Forward and backward of every grid shape (full) and of each causal-diagonal piece s × s (passed as key
    runs, as the executor passes it), timed in interleaved rounds (every shape once per round) so that a slow
    spell of the host falls on many shapes a little rather than on a few entirely."""
    shapes = [(a, b, False) for a in sweep.tokens for b in sweep.tokens] + [(s, s, True) for s in sweep.tokens]
    scale, cases = sweep.head_dim ** -0.5, []
    for s_q, s_kv, causal in shapes:
        q, k, v = qkv(sweep, s_q, s_kv, device)
        allowed = KeyRanges(np.zeros(s_q, dtype=np.int64), np.arange(1, s_q + 1), s_kv) if causal else None
        o, lse = block_forward(q, k, v, scale, allowed)
        do = torch.randn_like(q)
        pairs = allowed.pairs if causal else s_q * s_kv
        base = {"s_q": s_q, "s_kv": s_kv, "causal": causal, "batch": sweep.batch, "heads": sweep.heads,
                "head_dim": sweep.head_dim}
        flops = 4.0 * sweep.batch * sweep.heads * sweep.head_dim * pairs
        fns = {"fwd": functools.partial(block_forward, q, k, v, scale, allowed),
               "bwd": functools.partial(block_backward_from_out, q, k, v, o, do, lse, scale, allowed)}
        for p, mult in (("fwd", 1.0), ("bwd", 2.5)):
            cases.append((base | {"pass": p, "flops": mult * flops}, fns[p], *_plan(fns[p], device, sweep)))
    times: list[list[float]] = [[] for _ in cases]
    for r in range(sweep.samples):
        for i, (_, fn, reps, n) in enumerate(cases):
            if r < n:
                times[i].append(_sample(fn, device, reps))
        probes.append(probe_ms(device))
        log(f"attention kernels: round {r + 1}/{sweep.samples} of {len(shapes)} shapes")
    return [base | {"time_s": typical(t)} for (base, *_), t in zip(cases, times)]


def _segments(sweep: Sweep, device) -> list[dict]:
    """Forward and backward of blocks over each document mix of the sweep, passed as key runs as the executor
    passes them (so each document runs as its own kernel): ``causal``, every document against itself; ``rect``,
    every document's second half against its first half."""
    scale, out = sweep.head_dim ** -0.5, []
    for lens in sweep.segment_mixes:
        bounds = np.cumsum((0,) + tuple(lens))
        for kind in ("causal", "rect"):
            if kind == "causal":
                pos = np.arange(bounds[-1])
                doc = np.searchsorted(bounds, pos, side="right") - 1
                lo, hi, n_k = bounds[doc], pos + 1, int(bounds[-1])
            else:
                half = np.asarray(lens) // 2
                k_at = np.cumsum(np.r_[0, half])
                lo = np.repeat(k_at[:-1], np.asarray(lens) - half)
                hi, n_k = np.repeat(k_at[1:], np.asarray(lens) - half), int(k_at[-1])
            allowed = KeyRanges(np.asarray(lo, dtype=np.int64), np.asarray(hi, dtype=np.int64), n_k)
            q, k, v = qkv(sweep, len(lo), n_k, device)
            o, lse = block_forward(q, k, v, scale, allowed)
            do = torch.randn_like(q)
            fns = {"fwd": functools.partial(block_forward, q, k, v, scale, allowed),
                   "bwd": functools.partial(block_backward_from_out, q, k, v, o, do, lse, scale, allowed)}
            for p, fn in fns.items():
                reps, n = _plan(fn, device, sweep)
                out.append({"pass": p, "kind": kind, "doc_lens": list(lens), "batch": sweep.batch,
                            "heads": sweep.heads, "head_dim": sweep.head_dim,
                            "time_s": typical([_sample(fn, device, reps) for _ in range(n)])})
    log(f"document segments: {len(sweep.segment_mixes)} mixes")
    return out


def _plan(fn, device, sweep: Sweep) -> tuple[int, int]:
    """(calls per sample so a sample lasts ``min_sample_s``, samples to take) after a warm-up call."""
    fn()
    sync(device)
    once = _sample(fn, device, 1)
    reps = max(1, math.ceil(sweep.min_sample_s / max(once, 1e-7)))
    return reps, sweep.samples if once < LONG_CALL_S else min(3, sweep.samples)


def _sample(fn, device, reps: int) -> float:
    """Seconds per call of ``reps`` calls in a row."""
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    sync(device)
    return (time.perf_counter() - t0) / reps


def _head_dim_kernels(sweep: Sweep, rows: list) -> list:
    """(pass, head dim, s, FLOPs, seconds) of full s × s kernels in the sweep's dtype at each of ``head_dims`` (the
    sweep's among them) and s in ``head_dim_tokens``: the efficiency multiplier by head dim. The times are the
    medians over the :func:`dtype_sweep` rounds of its sweep-dtype column, so every head dim was timed in the same
    interleaved rounds. (Timing each head dim in one go let the host's drift into the multiplier: two calibrations
    of the same day put fp32's D = 128 backward at 0.97 and 1.12.)"""
    first = next((r[0] for r in rows), None)
    times: dict[tuple[str, int, int], list[float]] = {}
    for name, p, d, s, _, t_ref in rows:
        if name == first and s in sweep.head_dim_tokens:
            times.setdefault((p, d, s), []).append(t_ref)
    out = []
    for (p, d, s), ts in sorted(times.items(), key=lambda kv: (kv[0][1], kv[0][2], kv[0][0] != "fwd")):
        flops = 4.0 * sweep.batch * sweep.heads * d * s * s * (2.5 if p == "bwd" else 1.0)
        out.append((p, d, s, flops, typical(ts)))
    return out


def _dtype_kernels(sweep: Sweep, rows: list) -> list:
    """(dtype, s, seconds, seconds in the sweep's dtype) of s × s forward + backward in the other dtypes at the
    sweep's head dim, at the sizes the peak ratio is taken at (the table's largest but one or two), from the
    :func:`dtype_sweep` rows (summed over its rounds)."""
    sizes = set(_peak_sizes(sweep))
    total: dict[tuple[str, int], list[float]] = {}
    for name, _, d, s, t, t_ref in rows:
        if s in sizes and d == sweep.head_dim:
            acc = total.setdefault((name, s), [0.0, 0.0])
            acc[0], acc[1] = acc[0] + t, acc[1] + t_ref
    return [(name, s, t, t_ref) for (name, s), (t, t_ref) in sorted(total.items(), key=lambda kv: (kv[0][1], kv[0][0]))]


def _peak_sizes(sweep: Sweep) -> tuple[int, ...]:
    return sweep.tokens[-3:-1] or sweep.tokens[-1:]


def dtype_sweep(sweep: Sweep, device) -> list:
    """(dtype, pass, head dim, s, seconds in that dtype, seconds in the sweep's dtype) of s × s forward and backward
    kernels, for each of ``sweep.head_dims`` and s in ``sweep.dtype_tokens`` and ``sweep.head_dim_tokens`` (and the
    peak ratio's sizes at the sweep's own head dim): how a dtype's speed over the sweep's varies with the block
    size and head dim (on AVX512-BF16 the bf16 backward of 256 tokens takes 1.3x fp32's time at D = 64 and 1.0x at
    D = 128). Its sweep-dtype column also gives the head-dim multiplier (:func:`_head_dim_kernels`).

    Timed in ``sweep.dtype_rounds`` interleaved rounds, one row per round: a round times each shape in every
    dtype back to back (the order rotating by round), so a row's two times share the host's speed of that
    moment. (Timing each dtype's samples in one go let the host's drift, ±15% over tens of seconds here, into
    the ratio: one calibration put bf16's forward at 1.21x fp32's time at 1024 tokens, where interleaved rounds
    measure 1.01-1.04x.)"""
    dtypes = ("bf16", "fp16", "fp32")
    names = (sweep.dtype, *(d for d in dtypes if d != sweep.dtype))
    shapes = [(d, s) for d in sorted(set(sweep.head_dims) | {sweep.head_dim}) for s in sorted(
        set(sweep.dtype_tokens) | set(sweep.head_dim_tokens) | (set(_peak_sizes(sweep)) if d == sweep.head_dim
                                                                  else set()))]
    cases = []                                       # (head dim, s, pass, [(dtype, fn, calls per sample)])
    for d, s in shapes:
        fns: dict[str, list] = {"fwd": [], "bwd": []}
        for name in names:
            q, k, v = qkv(replace(sweep, dtype=name, head_dim=d), s, s, device)
            o, lse = block_forward(q, k, v, d ** -0.5, None)
            do = torch.randn_like(q)
            fns["fwd"].append((name, functools.partial(block_forward, q, k, v, d ** -0.5, None)))
            fns["bwd"].append((name, functools.partial(block_backward_from_out, q, k, v, o, do, lse, d ** -0.5,
                                                       None)))
        cases += [(d, s, p, [(n, fn, _plan(fn, device, sweep)[0]) for n, fn in fns[p]]) for p in ("fwd", "bwd")]
    rows = []
    for r in range(sweep.dtype_rounds):
        for d, s, p, timed in cases:
            shift = r % len(timed)
            t = {n: _sample(fn, device, reps) for n, fn, reps in timed[shift:] + timed[:shift]}
            rows += [(n, p, d, s, t[n], t[sweep.dtype]) for n in names[1:]]
        log(f"dtypes: round {r + 1}/{sweep.dtype_rounds} of {len(shapes)} shapes")
    ratios: dict[tuple, list[float]] = {}
    for n, p, d, s, t, t_ref in rows:
        ratios.setdefault((n, p, d, s), []).append(t / t_ref)
    for d, s in shapes:
        log(f"dtypes D={d} {s}x{s}: " + ", ".join(f"{n} {p} {float(np.median(ratios[(n, p, d, s)])):.2f}x"
                                                  for n in names[1:] for p in ("fwd", "bwd"))
            + f" the time in {sweep.dtype}")
    return rows


def _recurrence(sweep: Sweep, device) -> list:
    """(dtype, s, seconds of block_backward, seconds of block_backward_from_out) of s × s blocks in every dtype
    (the sweep's first): what a backward block costs when its query side carries D instead of O
    (on CPU the flash backward with a surrogate O, on CUDA the fp32 recurrence: :mod:`meshplan.executor.kernels`;
    on a CPU with native bf16 it takes 1.5-1.7x the flash backward in bf16, about 1.05x in fp32). The two are
    timed alternately, sample by sample."""
    rows, scale = [], sweep.head_dim ** -0.5
    for name in (sweep.dtype, *(d for d in ("bf16", "fp16", "fp32") if d != sweep.dtype)):
        for s in sweep.tokens[-3:-1] or sweep.tokens[-1:]:
            q, k, v = qkv(replace(sweep, dtype=name), s, s, device)
            o, lse = block_forward(q, k, v, scale, None)
            do = torch.randn_like(q)
            delta = (do.float() * o.float()).sum(-1)
            fns = (functools.partial(block_backward, q, k, v, do, lse, delta, scale, None),
                   functools.partial(block_backward_from_out, q, k, v, o, do, lse, scale, None))
            reps = [_plan(fn, device, sweep)[0] for fn in fns]
            times = [[_sample(fn, device, r) for fn, r in zip(fns, reps)] for _ in range(sweep.samples)]
            t_rec, t_flash = (typical([t[i] for t in times]) for i in (0, 1))
            rows.append((name, s, t_rec, t_flash))
            log(f"backward {name} {s}x{s}: from D {t_rec / t_flash:.2f}x from O")
    return rows


def memory_samples(device, memory: MemorySchedules) -> list[dict]:
    """The memory model's samples (:mod:`meshplan.executor.calibrate.memory`): the compute ops of
    ``memory.compute`` alone, then the declared run ``memory.repeats`` times."""
    from meshplan.executor.calibrate.memory import declared_run_samples, measure_memory

    repeats = memory.repeats if memory.declared is not None else 0
    log("memory: each executor op alone" + (f", then the declared run ({repeats}x)" if repeats else ""))
    return measure_memory(device, memory.compute) + (declared_run_samples(memory.declared, repeats) if repeats
                                                     else [])


def _merges(sweep: Sweep, device) -> list:
    """(dtype, bytes touched, seconds) of the executor's merge of a block's (O, LSE) into its output tensor (the
    token gather, the fp32 LSE merge and the write back: :func:`meshplan.executor.ops.combine`) with O in every
    dtype (the sweep's first); the cost model charges 3 x the output's bytes (O in the dtype + fp32 LSE). The
    merge runs in fp32 whatever O's dtype: on one AVX512-BF16 CPU a bf16 merge of 1-2K rows took 3.3-3.7x the
    fp32 one, where its bytes say 0.5x."""
    from meshplan.executor.ops import combine

    rows, b, h, d = [], sweep.batch, sweep.heads, sweep.head_dim
    for name in (sweep.dtype, *(n for n in ("bf16", "fp16", "fp32") if n != sweep.dtype)):
        dt = TORCH_DTYPE[name]
        elem = torch.empty(0, dtype=dt).element_size()
        for s in sweep.merge_tokens:
            views = {"o": torch.randn(b, s, h, d, device=device).to(dt), "lse": torch.randn(b, h, s, device=device)}
            part = {"o": torch.randn(b, h, s, d, device=device).to(dt), "lse": torch.randn(b, h, s, device=device)}
            tokens = torch.arange(s, device=device)
            t = _time(lambda: combine("merge", views, part, tokens), device, sweep)  # noqa: B023
            rows.append((name, 3 * b * h * s * (d * elem + 4), t))
    return rows
