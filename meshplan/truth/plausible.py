"""Whether a measurement can be real: the rates it implies against what the hardware can do.

A pass that implies more FLOP/s per device than the device's peak, or more bytes per second over a link than
the link carries, is not a result: the run was broken (an op skipped, a clock misread) or context parallelism
was silently off (Megatron-Bridge #2667 reported 1,937 TFLOP/s per H200, twice its peak). Per pass:

* compute: ``max over ranks of (the rank's compute FLOPs in the pass) / (the pass's measured makespan)``
  against the device's peak in the workload's dtype (FLOP/s);
* links: ``(bytes the pass's transfers put on a link, routed on the schedule's topology) / (the makespan)``
  against the link's capacity (bytes/s), for every link.

Both are lower bounds of the rate the hardware must have delivered (the work happened within the makespan),
so an honest run stays below the ceiling (:func:`ceilings`): on GPUs the datasheet peak and link capacities
with ``DATASHEET_HEADROOM`` for timer noise; on CPU ranks, whose peaks and capacities are a calibration's
measured rates (perhaps another host's), the larger of the calibrated peak (scaled by the host-speed probe
when the host is faster now) and the rate the run itself measured for one kernel of its dtype on this host
(``env.kernel_flops_per_s``), times the threads a rank ran with and ``MEASURED_HEADROOM`` (a kernel of
another shape, the timer); link capacities by the same headroom, doubled when the calibration is another
host's (its loopback copies may be faster).
"""

from __future__ import annotations

import numpy as np

from meshplan.plan.schedule import COMPUTE, PASS_NAMES, SEND

DATASHEET_HEADROOM = 1.05
MEASURED_HEADROOM = 2.0


def ceilings(topo, meas, dtype: str, other_host: bool, speed_ratio: float | None) -> tuple[float, float, str]:
    """(FLOP/s per device, factor on link capacities, what the FLOP/s ceiling is) that an honest measurement stays
    below (module docstring). ``speed_ratio``: the run's probe over the calibration's (< 1: faster now)."""
    peak = topo.peak_flops(dtype)
    if meas.env.get("backend") == "nccl" or topo.calibration is None:
        return peak * DATASHEET_HEADROOM, DATASHEET_HEADROOM, f"the device's {dtype} peak, {peak / 1e12:.4g} TFLOP/s"
    threads = max(1, int(meas.env.get("threads_per_rank") or 1))
    faster = 1.0 / speed_ratio if speed_ratio and speed_ratio < 1.0 else 1.0
    here = float(meas.env.get("kernel_flops_per_s") or 0.0)      # this run's own kernel, in its dtype, one rank
    flops = max(peak * faster * threads, here) * MEASURED_HEADROOM
    how = (f"{MEASURED_HEADROOM:g}x the larger of the calibrated {dtype} peak ({peak / 1e12:.3g} TFLOP/s per thread) "
           f"and this run's own {dtype} kernel ({here / 1e12:.3g} TFLOP/s)")
    return flops, faster * MEASURED_HEADROOM * (2.0 if other_host else 1.0), how


def implausible(sched, topo, meas, ceiling: tuple[float, float, str]) -> list[str]:
    """One line per pass and kind whose measurement implies a compute rate above ``ceiling_flops`` per device or
    a link rate above ``link_factor`` x its capacity (empty when all is plausible; :func:`ceilings`). ``sched`` is
    the schedule that ran, ``meas`` its measurement."""
    out = []
    o = sched.ops
    ceiling_flops, link_factor, how = ceiling
    for p in sched.passes:
        name = PASS_NAMES[p]
        span = meas.passes[name].makespan_s if name in meas.passes else None
        if span is None:
            continue
        comp = (o.phase == p) & (o.kind == COMPUTE)
        flops = np.bincount(o.rank[comp], weights=o.flops[comp], minlength=sched.n_ranks).max(initial=0.0)
        rate = flops / span if span > 0 else np.inf
        if flops > 0 and rate > ceiling_flops:
            out.append(f"{name}: the measured {_time(span)} implies {rate / 1e12:.3g} TFLOP/s per device, more than "
                       f"the {ceiling_flops / 1e12:.3g} TFLOP/s it can reach ({how}): a broken run, not a result")
        line = _link_line(sched, topo, p, span, link_factor)
        if line:
            out.append(f"{name}: {line}")
    return out


def _link_line(sched, topo, p: int, span: float, factor: float) -> str | None:
    """The worst link of a pass whose bytes over the makespan exceed its capacity x ``factor``, as one phrase."""
    o = sched.ops
    sends = np.flatnonzero((o.phase == p) & (o.kind == SEND))
    if not len(sends):
        return None
    dev = np.asarray(sched.device_of_rank)
    load = topo.link_loads(dev[o.rank[sends]], dev[o.peer[sends]], o.size_bytes[sends].astype(np.float64))
    rate = load / span if span > 0 else np.where(load > 0, np.inf, 0.0)
    over = rate / (topo.link_capacity * factor)
    worst = int(np.argmax(over))
    if over[worst] <= 1.0:
        return None
    return (f"the measured {_time(span)} implies {rate[worst] / 1e9:.3g} GB/s over {topo.link_name(worst)}, which "
            f"carries {topo.link_capacity[worst] / 1e9:.3g} GB/s{_times(factor)}: a broken run, not a result")


def _times(factor: float) -> str:
    return "" if factor <= DATASHEET_HEADROOM else f" (x{factor:.3g} allowed: a measured capacity)"


def _time(seconds: float) -> str:
    from meshplan.core.units import fmt_seconds
    return fmt_seconds(seconds)
