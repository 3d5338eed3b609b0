"""One process of a run: join the job, run warm-up and timed iterations of every pass, gather on rank 0.

Rank 0 returns the measurement as a dict (the launcher writes the file); every rank returns None on
success. Errors raise :class:`~meshplan.executor.runner.RunError` with one line naming rank, op and peer.
"""

from __future__ import annotations

import os
import platform
import resource
import socket
import sys
import time
from dataclasses import dataclass
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist

from meshplan.core.host import cpu_name
from meshplan.executor.data import Inputs, attention_rows, load_inputs, make_inputs
from meshplan.executor.host import cpu_isa
from meshplan.executor.kernels import TORCH_DTYPE, row_delta
from meshplan.executor.memory import memory_mark, memory_top, reuse_freed_memory
from meshplan.executor.numerics import assemble, dump, judge, local_results, numerics_of, sample_stats, sampled_tallies
from meshplan.executor.probe import kernel_flops_per_s, probe_ms
from meshplan.executor.program import Program
from meshplan.executor.runner import PassRunner, connect
from meshplan.executor.sample import Sample, pick_sample
from meshplan.executor.store import Store
from meshplan.executor.tally import Tally
from meshplan.plan.json.measurement import Numerics


@dataclass(frozen=True)
class RunConfig:
    """What ``meshplan run`` was asked for (see the CLI for meanings and defaults)."""

    backend: str = "gloo"
    iters: int = 5
    warmup: int = 2
    check: bool | str | None = None    # full | sampled | off (the launcher resolves None, True, False to one)
    serialize: bool = False
    timeout_s: float = 120.0
    dump_dir: str | None = None
    seed: int = 0
    inputs_path: str | None = None
    init_method: str = "env://"
    schedule_path: str = ""
    memory: bool = True            # one more, untimed iteration that measures each pass's memory rise


def rank_main(rank: int, world: int, jobs: list[tuple[Program, RunConfig]]) -> list[dict | None]:
    """Run each (schedule, config) in turn as ``rank`` of ``world`` in one process group (the first job's
    backend, rendezvous and timeout); rank 0 returns the measurement dicts, the others Nones."""
    cfg0 = jobs[0][1]
    reuse_freed_memory()
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    device = torch.device("cpu")
    if cfg0.backend == "nccl":
        local = int(os.environ.get("LOCAL_RANK", jobs[0][0].doc.device_of_rank[rank]))
        device = torch.device("cuda", local)
        torch.cuda.set_device(device)
    timeout = timedelta(seconds=max(cfg0.timeout_s, 60.0))      # rendezvous; each op wait has cfg.timeout_s
    dist.init_process_group(cfg0.backend, init_method=cfg0.init_method, rank=rank, world_size=world, timeout=timeout)
    done = False
    try:
        n_comms = max(len({s.communicator for s in p.doc.streams if s.kind == "comm"}) for p, _ in jobs)
        pool = [dist.new_group(list(range(world)), backend=cfg0.backend, timeout=timeout) for _ in range(n_comms)]
        connect(pool, device)
        results = []
        for prog, cfg in jobs:
            comms = sorted({s.communicator for s in prog.doc.streams if s.kind == "comm"})
            groups = dict(zip(comms, pool))       # one process group per communicator of this schedule
            inputs = (load_inputs(cfg.inputs_path, prog.workload) if cfg.inputs_path
                      else make_inputs(prog.workload, cfg.seed)).to(device)
            results.append(_iterate(rank, world, prog, cfg, groups, inputs, device))
        done = True
        return results
    finally:
        # a failed rank reports first and leaves without a teardown, which waits on the transfers still posted
        # (and a peer that has already left would end it with a backend error that hides the reason)
        if done:
            dist.destroy_process_group()


def _one_iteration(prog: Program, rank: int, cfg: RunConfig, groups, inputs: Inputs, device, memory: bool = False):
    """Every pass once: (stores, pass -> (start ns, op times, stream -> thread CPU s), pass -> (memory rise, peak)
    in bytes). With ``memory`` each pass starts from a trimmed heap with the high-water mark reset (the CUDA
    allocator's peak reset) once its start tensors exist; its rise is their bytes plus how far the rank's memory
    rose during the pass (what the memory model predicts: the schedule's buffers from the pass start on, with the
    workspace), its peak the high-water mark (None where they cannot be read); that costs page faults, so it is
    an extra, untimed iteration."""
    stores, passes, rises = {}, {}, {}
    for p in prog.passes:
        stores[p] = Store(device)
        runner = PassRunner(prog, rank, p, stores[p], groups, _Filler(prog, rank, stores, inputs), cfg.timeout_s,
                            cfg.serialize)
        runner.prepare()
        held = stores[p].live_bytes                 # the pass-start tensors (their filling's scratch left out)
        base = memory_mark(device) if memory else None
        dist.barrier()                              # every rank starts the pass together
        got = runner.run()
        passes[p] = (runner.t0, got, runner.cpu_s)
        if memory:
            top = memory_top(device)
            rises[p] = (None, top) if base is None or top is None else (held + max(int(top) - int(base), 0),
                                                                        int(top))
    dist.barrier()
    return stores, passes, rises


def _iterate(rank, world, prog: Program, cfg: RunConfig, groups, inputs: Inputs, device) -> dict | None:
    t_start = time.perf_counter()
    per_iter: list[dict[int, tuple[int, int]]] = []
    pass_ms: list[dict[str, float]] = []
    peak = 0
    stores: dict[str, Store] = {}
    probes: list[float] = []
    raw: list[dict[str, tuple[int, dict, dict]]] = []   # per timed iteration: pass -> (start ns, op times, stream CPU)
    kernel_rate = kernel_flops_per_s(device, prog.workload.dtype) if rank == 0 else None
    for it in range(cfg.warmup + cfg.iters):
        if it >= cfg.warmup and rank == 0:          # the host's speed now (the others wait in the pass barrier)
            probes.append(probe_ms(device))
        stores, passes, _ = _one_iteration(prog, rank, cfg, groups, inputs, device)
        peak = max([peak] + [st.peak_bytes for st in stores.values()])
        if it >= cfg.warmup:
            raw.append(passes)
    rises = {}
    if cfg.memory:
        stores = {}
        stores, _, rises = _one_iteration(prog, rank, cfg, groups, inputs, device, memory=True)   # untimed
    checked, sample, check_inputs = stores, None, inputs
    if cfg.check == "sampled":         # dO zero outside the sample: dK, dV are the sampled rows' contributions
        sample = pick_sample(prog, cfg.seed)
        if "bwd" in prog.passes:
            check_inputs = Inputs(inputs.q, inputs.k, inputs.v, sample.masked_dout(inputs.dout))
            checked, _, _ = _one_iteration(prog, rank, cfg, groups, check_inputs, device)     # untimed
    for passes, shift in zip(raw, _clock_offsets(raw, prog.passes, world, device)):
        times, spans = {}, {}
        for p, (_, got, _) in passes.items():
            times.update({i: (s + shift[p], e + shift[p]) for i, (s, e) in got.items()})
            spans[p] = max((e for _, e in got.values()), default=0) + shift[p]
        per_iter.append(times)
        pass_ms.append(spans)
    ends = torch.tensor([[s[p] for p in prog.passes] for s in pass_ms], dtype=torch.float64, device=device)
    dist.all_reduce(ends, op=dist.ReduceOp.MAX)       # a pass's makespan: its latest op end over all ranks
    ends = ends.cpu()
    got_rise = [r for r, _ in rises.values()]
    rise = max(got_rise) if got_rise and None not in got_rise else None
    if device.type == "cuda":                          # the allocator's peak of the memory iteration
        peak = max([peak] + [top for _, top in rises.values() if top is not None])
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * (1 if sys.platform == "darwin" else 1024)
    mine = {"rank": rank, "ops": _medians(per_iter), "peak_memory_bytes": int(peak), "peak_rss_bytes": int(rss),
            "peak_rise_bytes": rise, "stream_cpu_s": _stream_cpu(raw)}
    dtype = TORCH_DTYPE[prog.workload.dtype]
    pieces = local_results(prog, rank, checked, dtype) if cfg.check != "off" else []
    dumped = [] if not cfg.dump_dir else pieces if checked is stores and pieces else local_results(prog, rank, stores,
                                                                                                    dtype)
    if cfg.check == "sampled":          # judged here, on this rank's own pieces: only the errors (tallies) travel
        checks = _sampled_check(prog, rank, world, pieces, check_inputs.to(torch.device("cpu")), sample)
    else:                               # the full check judges every piece on rank 0
        checks = pieces
    gathered = [None] * world if rank == 0 else None
    dist.gather_object((mine, checks, dumped), gathered, dst=0)
    if rank != 0:
        return None
    return _measurement(prog, cfg, (inputs, check_inputs, sample), gathered, ends.numpy() / 1e9, device,
                        time.perf_counter() - t_start, probes, kernel_rate)


def _sampled_check(prog: Program, rank: int, world: int, pieces: list[tuple], inputs: Inputs,
                   sample: Sample) -> dict:
    """This rank's tallies of the sampled check (:mod:`meshplan.executor.sample`): the rows it returns computed
    here, every rank's rows' LSE and D exchanged, then its own pieces judged."""
    backward = "bwd" in prog.passes
    mine = sample.owner == rank
    ref, one = sample_stats(inputs, prog.workload, sample, backward, which=mine)
    every = [None] * world
    dist.all_gather_object(every, (ref, one, mine))
    for r_ref, r_one, which in every:
        ref.fill(r_ref, which)
        one.fill(r_one, which)
    return sampled_tallies(prog, pieces, inputs, sample, ref, one)


def _clock_offsets(raw: list[dict], passes: list[str], world: int, device) -> list[dict[str, int]]:
    """Per timed iteration and pass, ns to add to this rank's op times so that every rank's times count from the
    earliest rank's pass start. Ranks on one host share its monotonic clock (``perf_counter_ns``), so the
    barrier's release skew (up to a few ms) is taken out and a transfer's start on one rank compares with its
    match's on another (:func:`meshplan.truth.compare.transfer_spans`); ranks on several hosts keep their own origin."""
    t0 = torch.tensor([[it[p][0] for p in passes] for it in raw] or [[0] * len(passes)], dtype=torch.int64,
                      device=device)
    every = [torch.empty_like(t0) for _ in range(world)]
    dist.all_gather(every, t0)
    hosts = [None] * world
    dist.all_gather_object(hosts, socket.gethostname())
    if len(set(hosts)) != 1 or not raw:
        return [dict.fromkeys(passes, 0) for _ in raw]
    off = (t0 - torch.stack(every).min(dim=0).values).cpu().tolist()
    return [dict(zip(passes, row)) for row in off]


class _Filler:
    """Creates the tensors alive at a pass start: inputs from the data, the rest at the identity."""

    def __init__(self, prog: Program, rank: int, stores: dict[str, Store], inputs: Inputs) -> None:
        self.prog, self.rank, self.stores, self.inputs = prog, rank, stores, inputs

    def __call__(self, tid: int) -> None:
        t, prog = self.prog.tensors[tid], self.prog
        store = self.stores[t.pass_]
        layout = prog.layout(tid)
        parts = store.alloc(tid, layout, t.dtype)
        if t.role != "input":
            return
        pos = torch.from_numpy(prog.tokens_of(t.kind, t.chunks)).to(store.device)
        h0, h1 = t.heads
        k0, k1 = layout.kv_heads
        src = self.inputs
        values = {"q": lambda: src.q[:, pos, h0:h1], "do": lambda: src.dout[:, pos, h0:h1],
                  "k": lambda: src.k[:, pos, k0:k1], "v": lambda: src.v[:, pos, k0:k1]}
        need_fwd = any(x in parts for x in ("o", "lse", "delta"))
        o, lse = self._forward(t, pos.cpu().numpy(), h0, h1) if need_fwd else (None, None)
        for part, x in parts.items():
            if part in values:
                x.copy_(values[part]())
            elif part == "o":
                x.copy_(o)
            elif part == "lse":
                x.copy_(lse)
            elif part == "delta":
                x.copy_(row_delta(o.transpose(1, 2), values["do"]().transpose(1, 2)))

    def _forward(self, t, pos: np.ndarray, h0: int, h1: int):
        """Final (O in the input dtype, LSE) of these rows: this iteration's forward output on this rank when it
        holds them, else one process's forward of the rows (e.g. a backward-only schedule)."""
        fwd = self.stores.get("fwd")
        dt = TORCH_DTYPE[self.prog.workload.dtype]
        if fwd is not None:
            for u in self.prog.doc.tensors:
                if (u.rank == self.rank and u.pass_ == "fwd" and u.role == "output" and u.kind == "out"
                        and u.chunks == t.chunks and u.heads[0] <= h0 and h1 <= u.heads[1] and u.id in fwd.data):
                    parts, a = fwd.data[u.id], h0 - u.heads[0]
                    return parts["o"][:, :, a:a + h1 - h0].to(dt), parts["lse"][:, a:a + h1 - h0]
        return attention_rows(self.inputs, self.prog.workload, pos, h0, h1)


def _medians(per_iter: list[dict[int, tuple[int, int]]]) -> list[dict]:
    ids = sorted(per_iter[0]) if per_iter else []
    out = []
    for i in ids:
        s = np.median([it[i][0] for it in per_iter]) / 1e9
        e = np.median([it[i][1] for it in per_iter]) / 1e9
        out.append({"id": i, "start_s": float(s), "end_s": float(max(e, s))})
    return out


def _stream_cpu(raw: list[dict]) -> dict[str, float] | None:
    """Per stream, the CPU seconds its thread used in one timed iteration (all passes), the median over them."""
    per_iter = []
    for passes in raw:
        total: dict[str, float] = {}
        for _, _, cpu in passes.values():
            for stream, sec in cpu.items():
                total[stream] = total.get(stream, 0.0) + sec
        per_iter.append(total)
    if not per_iter:
        return None
    return {s: float(np.median([it.get(s, 0.0) for it in per_iter])) for s in sorted(set().union(*per_iter))}


def _spread(x: np.ndarray) -> dict:
    return {"min_s": float(x.min()), "p25_s": float(np.percentile(x, 25)), "p75_s": float(np.percentile(x, 75)),
            "max_s": float(x.max())}


def _measurement(prog: Program, cfg: RunConfig, inputs: tuple[Inputs, Inputs, Sample | None], gathered,
                 ends_s: np.ndarray, device, wall_s: float, probes: list[float], kernel_rate: float | None) -> dict:
    """Rank 0's measurement dict; ``inputs``: (the run's, the check iteration's, the sample or None)."""
    ranks = [g[0] for g in gathered]
    cpu = torch.device("cpu")
    numerics = Numerics(checked="off", passed=None)
    if cfg.check == "sampled":
        merged: dict = {}
        for g in gathered:
            for name, t in g[1].items():
                merged.setdefault(name, Tally()).merge(t)
        numerics = numerics_of(prog, merged, "sampled", len(inputs[2]))
    elif cfg.check == "full":
        results = assemble(prog, [p for g in gathered for p in g[1]])
        for g in gathered:
            if g[1] is not g[2]:                # each piece is in the assembled arrays now: free it (unless dumped)
                g[1].clear()
        numerics = judge(prog, inputs[1].to(cpu), results, cfg.check, inputs[2])
        del results
    if cfg.dump_dir:
        dump(cfg.dump_dir, prog, inputs[0].to(cpu), assemble(prog, [p for g in gathered for p in g[2]]))
    total = ends_s.sum(axis=1)
    passes = {p: {"makespan_s": float(np.median(ends_s[:, i])), "spread": _spread(ends_s[:, i])}
              for i, p in enumerate(prog.passes)}
    return {
        "schedule": prog.sha256, "schedule_path": cfg.schedule_path, "algorithm": prog.doc.algorithm,
        "env": _env(cfg, device, len(ranks)) | {"probe_ms": float(np.median(probes)) if probes else None,
                                                "kernel_flops_per_s": kernel_rate},
        "settings": {
            "iters": cfg.iters, "warmup": cfg.warmup, "serialize": cfg.serialize, "timeout_s": cfg.timeout_s,
            "check": cfg.check, "seed": cfg.seed, "inputs": cfg.inputs_path},
        "numerics": numerics.model_dump(), "ranks": ranks, "passes": passes,
        "makespan_s": float(np.median(total)), "makespan_spread": _spread(total),
        "peak_memory_bytes": max(r["peak_memory_bytes"] for r in ranks),
        "peak_rise_bytes": max((r["peak_rise_bytes"] for r in ranks if r["peak_rise_bytes"] is not None),
                               default=None),
        "peak_memory_kind": "cuda-allocator" if device.type == "cuda" else "live-tensors", "wall_s": wall_s,
    }


def _env(cfg: RunConfig, device, world: int) -> dict:
    try:
        import flash_attn  # noqa: F401
        has_flash = True
    except ImportError:
        has_flash = False
    return {"torch": torch.__version__, "python": platform.python_version(), "backend": cfg.backend,
            "device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
            "host": socket.gethostname(), "cpu": cpu_name(), "isa": cpu_isa(), "cpu_count": os.cpu_count(),
            "world_size": world, "threads_per_rank": torch.get_num_threads(), "flash_attn": has_flash}
