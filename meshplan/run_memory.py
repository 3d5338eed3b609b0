"""Will a run fit this host? The memory model's peak per rank against the memory the host has, before any rank
starts (``meshplan run``).

A run that does not fit is ended by the kernel's out-of-memory killer minutes later with no reason given (16
CPU ranks of a 1M-token plan on a 24 GB host). So before spawning, ``meshplan run`` predicts each rank's peak
with the memory model (:mod:`meshplan.memory_model`: buffers, workspace and runtime, timed by simulating the
schedule on the device the ranks run on — ``cpu-local`` for CPU ranks, the schedule's topology for GPUs) and
compares:

* CPU ranks: ``local ranks × (peak + a rank's base)`` with ``HOST_SHARE`` of the host's available memory
  (``MemAvailable``), the base being this process's resident set (the interpreter, torch and the schedule,
  which every spawned rank loads too);
* GPU ranks: ``peak`` with ``HOST_SHARE`` of each local device's free memory.

A refusal names the numbers and, for masks a sequence length can scale (full, causal, window), the largest
power-of-two fraction of ``--seq-len`` whose plan fits, as the ``meshplan simulate`` command that writes it
(planned and checked here, so the suggestion runs).
"""

from __future__ import annotations

from meshplan.errors import UserError
from meshplan.units import fmt_bytes

HOST_SHARE = 0.9          # of the available memory, what a run may take (the page cache, this process, noise)
MAX_HALVINGS = 10


def rank_peak_bytes(sched, topo) -> float:
    """The memory model's peak of the busiest rank (bytes), over the passes, simulated on ``topo``."""
    from meshplan.memory_model import model_peak_bytes
    from meshplan.simulate import simulate

    sim = simulate(sched, topo)
    peaks = []
    for p in sched.passes:
        off = sim.pass_offset[p]
        peaks.append(model_peak_bytes(sched, topo.memory_model, p, sim.start - off, sim.end - off))
    return max(peaks, default=0.0)


def run_topology(sched, gpu: bool):
    """The topology whose device the ranks run on: ``cpu-local`` with the schedule's ranks for CPU ranks, else the
    schedule's own."""
    from meshplan.topology import Topology
    if not gpu:
        return Topology.load("cpu-local", sched.n_ranks)
    return Topology.load(sched.topology.get("name"), sched.topology.get("devices"))


def check_fits(sched, host, name: str) -> None:
    """Refuse (UserError, before anything starts) a run whose predicted memory exceeds the host's
    (``host``: a :class:`meshplan.executor.host.HostMemory`).

    Raises:
        UserError: one line with the numbers and a smaller workload that fits (see the module docstring).
    """
    topo = run_topology(sched, host.gpu)
    peak = rank_peak_bytes(sched, topo)
    if _total(peak, host) <= HOST_SHARE * host.available_bytes:
        return
    where = "the least free GPU has" if host.gpu else "this host has"
    each = "" if host.gpu else f" plus {fmt_bytes(host.base_bytes)} for the process"
    raise UserError(name, f"{host.local_ranks} rank{'s' if host.local_ranks > 1 else ''} need "
                    f"{fmt_bytes(_total(peak, host))} by the memory model ({fmt_bytes(peak)} per rank at its "
                    f"peak{each}), {where} {fmt_bytes(host.available_bytes)} available; nothing was started",
                    _smaller(sched, topo, host) or "run it on a host with more memory, or plan it for fewer tokens")


def _total(peak: float, host) -> float:
    return peak if host.gpu else host.local_ranks * (peak + host.base_bytes)


def _smaller(sched, topo, host) -> str | None:
    """The ``simulate`` command of the longest power-of-two fraction of the sequence whose plan fits, or None."""
    from meshplan.algorithms.base import knob_flag
    from meshplan.predict import predict
    from meshplan.topology import Topology

    w = sched.workload
    if w.mask.kind == "docs" or w.prefix_len or w.valid_len is not None:
        return None
    try:
        planned_on = Topology.load(sched.topology.get("name"), sched.topology.get("devices"))
    except UserError:
        return None
    seq = w.seq_len
    for _ in range(MAX_HALVINGS):
        seq //= 2
        try:
            cand = predict(sched.algorithm, w.with_(seq_len=seq), planned_on, sched.n_ranks, dict(sched.knobs))
        except UserError:
            return None
        peak = rank_peak_bytes(cand.schedule, run_topology(cand.schedule, host.gpu))
        if _total(peak, host) <= HOST_SHARE * host.available_bytes:
            knobs = " ".join(f"{knob_flag(k)}={v}" if knob_flag(k).startswith("--knob") else f"{knob_flag(k)} {v}"
                             for k, v in sched.knobs.items() if v is not None)
            flags = f"{w.with_(seq_len=seq).cli_flags()}{' ' + knobs if knobs else ''}"
            return (f"plan {seq} tokens instead ({fmt_bytes(_total(peak, host))} by the model): meshplan simulate "
                    f"--algo {sched.algorithm} --gpus {sched.n_ranks} --topo {planned_on.name} {flags} --out "
                    "smaller.json && meshplan run smaller.json")
    return None
