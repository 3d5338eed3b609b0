"""``meshplan run``: check everything, then join a torchrun job or spawn the ranks, and collect rank 0's result.

All refusals happen before any process starts or communicates: an unreadable or invalid schedule,
another schema version, a world size or device map that cannot run it, a backend the host lacks, a
``--serialize`` order that would deadlock, and (through ``run``'s ``fits``) a run whose predicted memory the
host does not have. A rank that dies is reported with its reason, or the signal that ended it.

Spawned ranks rendezvous on loopback (127.0.0.1, a free port; gloo bound to the loopback interface unless
``GLOO_SOCKET_IFNAME`` says otherwise); under torchrun the job's own rendezvous (``env://``) is used.
"""

from __future__ import annotations

import os
import socket
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

from meshplan.core.errors import UserError
from meshplan.core.host import available_memory_bytes, resident_bytes
from meshplan.executor.host import HostMemory, free_gpu_bytes
from meshplan.executor.program import Program, check_world, load_program, sequential_ok
from meshplan.executor.sample import check_mode
from meshplan.executor.worker import RunConfig, rank_main


class RunFailed(RuntimeError):
    """A rank failed while running; ``str()`` is the first rank's one-line reason."""


def resolve_backend(backend: str) -> str:
    """``auto`` → nccl with CUDA, else gloo. Raises UserError for nccl without CUDA."""
    import torch

    cuda = torch.cuda.is_available()
    if backend == "auto":
        return "nccl" if cuda else "gloo"
    if backend == "nccl" and not cuda:
        raise UserError("--backend", "nccl needs CUDA GPUs and this host has none", "use --backend gloo (CPU ranks)")
    if backend not in ("gloo", "nccl"):
        raise UserError("--backend", f"unknown backend {backend!r}", "use auto, gloo or nccl")
    return backend


def prepare(path: str, nproc: int | None, cfg: RunConfig) -> tuple[Program, RunConfig, int]:
    """Load and check the schedule and the job; returns (program, config with the backend resolved, world)."""
    import torch

    prog = load_program(path)
    cfg = replace(cfg, backend=resolve_backend(cfg.backend), schedule_path=str(path))
    under_torchrun = "RANK" in os.environ and "WORLD_SIZE" in os.environ
    world = int(os.environ["WORLD_SIZE"]) if under_torchrun else (nproc or prog.n_ranks)
    cuda = cfg.backend == "nccl"
    local = [int(os.environ.get("LOCAL_RANK", 0))] if under_torchrun else list(prog.doc.device_of_rank)
    check_world(prog, world, torch.cuda.device_count() if cuda else None, local if cuda else [])
    if cfg.serialize:
        stuck = [p for p in prog.passes if not sequential_ok(prog, p)]
        if stuck:
            raise UserError("--serialize", f"running the {stuck[0]} pass one op at a time in program order would "
                            "deadlock (a recv is posted before the send it waits for)", "run without --serialize")
    cfg = replace(cfg, check=check_mode(prog.workload, cfg.check))    # full when cheap, else sampled; off if asked
    if cfg.inputs_path and not Path(cfg.inputs_path).is_file():
        raise UserError("--inputs", f"{cfg.inputs_path} does not exist", "give an .npz with q, k, v (and dout)")
    return prog, cfg, world


def run(path: str, nproc: int | None, cfg: RunConfig, fits=None) -> dict | None:
    """Run a schedule; returns rank 0's measurement dict (None on other torchrun ranks). ``fits(program, config,
    host_memory)``, when given, is called before any rank starts (it refuses a run that does not fit).

    Raises:
        UserError: refused before running (see the module docstring).
        RunFailed: a rank failed (timeout, broken transfer, killed); the message names rank, op and peer.
    """
    prog, cfg, world = prepare(path, nproc, cfg)
    if fits is not None:
        host = host_memory(prog, cfg, world)
        if host is not None:
            fits(prog, cfg, host)
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return rank_main(int(os.environ["RANK"]), world, [(prog, replace(cfg, init_method="env://"))])[0]
    return spawn(world, [(prog, cfg)])[0]


def host_memory(prog: Program, cfg: RunConfig, world: int) -> HostMemory | None:
    """What this host offers the run's ranks (None when it cannot be read): spawned, all ``world`` ranks run here;
    under torchrun, ``LOCAL_WORLD_SIZE`` of them (GPU: each on its own device)."""
    torchrun = "RANK" in os.environ and "WORLD_SIZE" in os.environ
    local = int(os.environ.get("LOCAL_WORLD_SIZE", 1)) if torchrun else world
    gpu = cfg.backend == "nccl"
    if gpu:
        devices = [int(os.environ.get("LOCAL_RANK", 0))] if torchrun else sorted(set(prog.doc.device_of_rank))
        available = free_gpu_bytes(devices)
    else:
        available = available_memory_bytes()
    return None if available is None else HostMemory(available, local, resident_bytes(), gpu)


def run_batch(jobs: list[tuple[str, RunConfig]]) -> list[dict]:
    """Run several (schedule file, config) of one rank count in one spawned world (the tests' way to keep CI
    short); the first job's backend and timeout hold for the world."""
    jobs = [prepare(path, None, cfg)[:2] for path, cfg in jobs]
    worlds = {prog.n_ranks for prog, _ in jobs}
    if len(worlds) != 1:
        raise UserError("schedules", f"need one rank count, got {sorted(worlds)}", "batch them by rank count")
    return spawn(worlds.pop(), jobs)


def spawn(world: int, jobs: list[tuple[Program, RunConfig]]) -> list[dict]:
    """Spawn ``world`` ranks on this host (loopback rendezvous) to run the jobs; rank 0's results."""
    init = f"tcp://127.0.0.1:{free_port()}"
    return spawn_ranks(rank_main, world, [(prog, replace(cfg, init_method=init)) for prog, cfg in jobs])


def spawn_ranks(fn, world: int, payload, prefix: str = "meshplan-run-"):
    """Run ``fn(rank, world, payload)`` (a module-level function) in ``world`` spawned processes; returns rank 0's
    value. gloo binds to the loopback interface unless ``GLOO_SOCKET_IFNAME`` says otherwise.

    Raises:
        RunFailed: a rank failed; the message is the root cause among the ranks' one-line reasons.
    """
    import pickle

    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory(prefix=prefix) as tmp:
        ctx = mp.start_processes(_entry, args=(fn, world, payload, tmp), nprocs=world, join=False,
                                 start_method="spawn")
        try:
            while not ctx.join(timeout=0.5):
                pass
        except Exception as err:  # noqa: BLE001 - a rank failed; its own one-line reason is in its error file
            done = len(list(Path(tmp).glob("done-*"))) == world and (Path(tmp) / "result.pkl").exists()
            if not done:     # a rank that died after finishing its work (in teardown) changes nothing
                reason = _killed(err) or _first_error(Path(tmp)) or "a rank exited without a reason (see stderr)"
                raise RunFailed(reason) from None
        finally:
            for p in ctx.processes:
                if p.is_alive():
                    p.terminate()
        return pickle.loads((Path(tmp) / "result.pkl").read_bytes())


def _entry(rank: int, fn, world: int, payload, tmp: str) -> None:
    """A spawned rank: run, hand rank 0's value to the parent, or leave a one-line reason and exit 1."""
    import pickle

    os.environ.setdefault("GLOO_SOCKET_IFNAME", _loopback_interface())
    try:
        result = fn(rank, world, payload)
        if rank == 0:
            Path(tmp, "result.pkl").write_bytes(pickle.dumps(result))
        Path(tmp, f"done-{rank}").touch()
    except BaseException as err:  # noqa: BLE001 - reported to the parent as one line
        line = " ".join(str(err).split()) or type(err).__name__
        part = Path(tmp, f".error-{rank}.part")             # whole or not at all: the parent may be reading
        part.write_text(f"{time.time_ns()} {line}")
        os.replace(part, Path(tmp, f"error-{rank}.txt"))
        os._exit(1)  # do not wait for gloo threads or peers that will never answer
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)      # the work is done: skip the native teardown (gloo's threads have aborted there, SIGABRT)


def _killed(err: BaseException) -> str | None:
    """The reason of a rank ended by a signal (its own, not our clean-up of the others), or None."""
    name = getattr(err, "signal_name", None)
    if not name:
        return None
    rank = getattr(err, "error_index", "?")
    if name == "SIGKILL":
        return (f"rank {rank} was killed by the system (SIGKILL), likely out of memory: check the host's free "
                "memory, or run a smaller workload")
    return f"rank {rank} was ended by {name}"


def _first_error(tmp: Path) -> str | None:
    """The root cause among the ranks' failures: the executor's own reasons ("rank R: op ... peer ...") before
    a backend's (a peer's closed connection is a consequence), consequences ("stopped: ...") last, then the
    earliest."""
    found = []
    for f in tmp.glob("error-*.txt"):
        stamp, _, line = f.read_text().partition(" ")
        found.append((line.startswith("stopped:"), not line.startswith("rank "), int(stamp), line))
    return min(found)[3] if found else None


def free_port() -> int:
    """A TCP port free on the loopback interface now (for a rendezvous address)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _loopback_interface() -> str:
    names = [name for _, name in socket.if_nameindex()]
    return next((n for n in names if n.startswith("lo")), "lo")
