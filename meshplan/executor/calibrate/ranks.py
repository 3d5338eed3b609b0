"""The spawned part of ``meshplan calibrate`` (:mod:`meshplan.executor.calibrate.bench`): ranks on this host.

gloo ranks rendezvous on loopback (NCCL: GPUs 0 and 1), as ``meshplan run`` spawns them
(:mod:`meshplan.executor.launch`). Ranks 0 and 1 time point-to-point transfers (each message packed into its
wire image and unpacked, as the executor moves tensors) and one overlap run while
the others wait in a barrier (an idle gloo rank takes no CPU); then, on CPU, 1, 2, ... ranks run the same
kernel at once (core sharing). Rank 0 returns everything; a failing rank leaves its one-line reason.
"""

from __future__ import annotations

import math
import resource
import threading
import time
from dataclasses import replace
from datetime import timedelta

import torch
import torch.distributed as dist

from meshplan.executor.calibrate.common import Sweep, log, qkv, sync, typical
from meshplan.executor.kernels import block_forward
from meshplan.executor.launch import free_port, spawn_ranks
from meshplan.executor.memory import reuse_freed_memory
from meshplan.executor.store import pack, unpack


def spawn(world: int, sweep: Sweep) -> dict:
    """Run :func:`_rank_main` in ``world`` spawned ranks (loopback rendezvous, as ``meshplan run``); rank 0's result."""
    sweep = replace(sweep, init_method=f"tcp://127.0.0.1:{free_port()}")
    return spawn_ranks(_rank_main, world, sweep, prefix="meshplan-calibrate-")


def _rank_main(rank: int, world: int, sweep: Sweep) -> dict:
    try:
        return _measure_ranks(rank, world, sweep)
    except Exception as err:
        raise RuntimeError(f"rank {rank}: {err}") from err


def _measure_ranks(rank: int, world: int, sweep: Sweep) -> dict:
    reuse_freed_memory()                      # as the executor's ranks do
    cuda = sweep.backend == "nccl"
    device = torch.device("cuda", rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    else:
        torch.set_num_threads(1)
    dist.init_process_group(sweep.backend, init_method=sweep.init_method, rank=rank, world_size=world,
                            timeout=timedelta(seconds=120))
    try:
        pair = dist.new_group([0, 1])
        mine: dict = {"p2p": [], "overlap": [], "sharing": [], "transfer_cpu": []}
        if rank < 2:
            mine["p2p"], mine["transfer_cpu"] = _p2p(rank, sweep, device, pair)
            mine["overlap"] = _overlap(rank, sweep, device, pair, mine["p2p"])
        dist.barrier()
        if not cuda:
            mine["sharing"] = _sharing(rank, sweep, device)
        gathered = [None] * world if rank == 0 else None
        dist.gather_object(mine, gathered, dst=0)
        if rank != 0:
            return {}
        both = zip(gathered[0]["transfer_cpu"], gathered[1]["transfer_cpu"])     # the same sizes, in order
        return {"p2p": gathered[0]["p2p"], "overlap": [r for g in gathered for r in g["overlap"]],
                "sharing": [r for g in gathered for r in g["sharing"]],
                "transfer_cpu": [] if cuda else [(a[0], a[1], a[2] + b[2]) for a, b in both]}
    finally:
        dist.destroy_process_group()


def _wire(size: int, device) -> tuple[dict, dict]:
    """(parts to send, parts to receive into) of a ``kv`` tensor whose wire image is ``size`` bytes (fp32 K and V
    of 64 channels; sizes are multiples of 512 B), as the executor's store holds them."""
    tokens = max(1, size // 512)
    make = lambda: {p: torch.zeros(1, tokens, 1, 64, device=device) for p in ("k", "v")}  # noqa: E731
    return make(), make()


def _exchange(peer: int, out: dict, into: dict, rounds: int = 1) -> None:
    """Both directions at once, as the executor runs a batch: pack, post a recv from and a send to ``peer``,
    wait for both, unpack; ``rounds`` times."""
    for _ in range(rounds):
        buf = pack(out, "kv", "fp32")
        got = torch.empty_like(buf)
        for w in (dist.irecv(got, src=peer), dist.isend(buf, dst=peer)):
            w.wait()
        unpack(got, into, "kv", "fp32")


def _ping(rank: int, out: dict, into: dict, rounds: int) -> None:
    """Round trips between ranks 0 and 1 (0 sends, 1 answers), each message packed and unpacked as the executor
    does it."""
    for _ in range(rounds):
        buf = pack(out, "kv", "fp32")
        got = torch.empty_like(buf)
        if rank == 0:
            dist.send(buf, dst=1)
            dist.recv(got, src=1)
        else:
            dist.recv(got, src=0)
            dist.send(buf, dst=0)
        unpack(got, into, "kv", "fp32")


def _p2p(rank: int, sweep: Sweep, device, pair) -> tuple[list[dict], list[tuple[int, int, float]]]:
    """Ping-pong (one flow: half a round trip) and a simultaneous exchange (two flows) per size; each round
    timed on its own, so a round another process delayed does not spoil the others. Also, per size, this
    process's CPU time over its timed exchanges (every thread, user and system: packing, gloo's I/O, the kernel's
    socket copies) as (size_bytes, exchanges, cpu_s): what a transfer takes from a shared compute pool."""
    rows, cpu_rows = [], []
    for size in sweep.p2p_sizes:
        buf, got = _wire(size, device)
        rounds = max(3, min(50, (16 << 20) // size))
        for flows in (1, 2):
            times, cpu_s, exchanges = [], 0.0, 0
            for sample in range(sweep.samples + 1):          # the first is a warm-up
                dist.barrier(group=pair)
                for _ in range(rounds):
                    c0, t0 = _process_cpu_s(), time.perf_counter()
                    if flows == 1:
                        _ping(rank, buf, got, 1)
                    else:
                        _exchange(1 - rank, buf, got, 1)
                    sync(device)
                    if sample:
                        times.append((time.perf_counter() - t0) / (2 if flows == 1 else 1))
                        cpu_s, exchanges = cpu_s + _process_cpu_s() - c0, exchanges + 1
            rows.append({"size_bytes": size, "flows": flows, "time_s": typical(times)})
        cpu_rows.append((size, exchanges, cpu_s))
        if rank == 0:
            log(f"p2p {size} B: {rows[-2]['time_s'] * 1e6:.1f} us one way, {rows[-1]['time_s'] * 1e6:.1f} us "
                "both ways at once")
    return rows, cpu_rows


def _process_cpu_s() -> float:
    """CPU seconds this process has used so far, every thread, user and system."""
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _timed_kernel(kernel, device) -> tuple[float, float]:
    t0 = time.perf_counter()
    kernel()
    sync(device)
    return t0, time.perf_counter()


def _overlap(rank: int, sweep: Sweep, device, pair, p2p: list[dict]) -> list[dict]:
    """Ranks 0 and 1 run a kernel while exchanging messages with each other (a thread posts them, as the
    executor's comm stream does) for about 1.5 x the kernel's time; records the overlap. Each round times the
    kernel alone, the exchanges alone and both together back to back, and a row keeps its own round's
    references, so the host's drift does not enter κ or κ_t (timed in separate phases, one calibration's
    "alone" kernel fell into a slow spell, 87 ms against 52 in the others, and halved κ)."""
    q, k, v = qkv(sweep, sweep.overlap_tokens, sweep.overlap_tokens, device)
    kernel = lambda: block_forward(q, k, v, sweep.head_dim ** -0.5, None)  # noqa: E731
    kernel()
    dist.barrier(group=pair)
    t0, t1 = _timed_kernel(kernel, device)
    size = sweep.overlap_msg_bytes
    ref = max((r for r in p2p if r["flows"] == 2), key=lambda r: r["size_bytes"])
    t_msg = ref["time_s"] * size / ref["size_bytes"]
    n = torch.tensor([min(10_000, math.ceil(1.5 * (t1 - t0) / max(t_msg, 1e-6)))], dtype=torch.int64,
                     device=device)
    dist.all_reduce(n, op=dist.ReduceOp.MAX, group=pair)               # both ranks post as many messages
    buf, got = _wire(size, device)
    span, rows = {}, []

    def comm():
        span["start"] = time.perf_counter()
        _exchange(1 - rank, buf, got, int(n.item()))
        sync(device)
        span["end"] = time.perf_counter()

    for _ in range(sweep.samples):
        dist.barrier(group=pair)
        t0, t1 = _timed_kernel(kernel, device)
        alone = t1 - t0
        dist.barrier(group=pair)            # the same transfers from the same thread, no kernel: the reference
        th = threading.Thread(target=comm, daemon=True)
        th.start()
        th.join()
        comm_alone = span["end"] - span["start"]
        dist.barrier(group=pair)
        th = threading.Thread(target=comm, daemon=True)
        th.start()
        t0, t1 = _timed_kernel(kernel, device)
        th.join()
        overlap = max(0.0, min(t1, span["end"]) - max(t0, span["start"]))
        rows.append({"rank": rank, "alone_s": alone, "with_s": t1 - t0, "overlap_s": overlap,
                     "comm_s": span["end"] - span["start"], "comm_alone_s": comm_alone})
    if rank == 0:
        log(f"overlap: kernel {typical([r['alone_s'] for r in rows]) * 1e3:.1f} ms alone, "
            f"{typical([r['with_s'] for r in rows]) * 1e3:.1f} ms during transfers ({int(n.item())} exchanges of "
            f"{size} B)")
    return rows


def _sharing(rank: int, sweep: Sweep, device) -> list:
    """(k, seconds) for each k in ``sharing_ranks``: ranks 0..k−1 run the kernel at once, the rest wait."""
    q, k, v = qkv(sweep, sweep.sharing_tokens, sweep.sharing_tokens, device)
    kernel = lambda: block_forward(q, k, v, sweep.head_dim ** -0.5, None)  # noqa: E731
    kernel()
    rows = []
    for active in sweep.sharing_ranks:
        times = []
        for _ in range(sweep.samples):
            dist.barrier()
            if rank < active:
                t0, t1 = _timed_kernel(lambda: (kernel(), kernel()), device)
                times.append((t1 - t0) / 2)
        if rank < active:
            rows.append((active, typical(times)))
        if rank == 0:
            log(f"core sharing: {active} rank(s) at once, {rows[-1][1] * 1e3:.1f} ms per kernel on rank 0")
    return rows
