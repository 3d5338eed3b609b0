"""Contention or a wrong model? Why a CPU run's compute took the time it did (``meshplan run`` / ``compare``).

On CPU ranks a kernel's wall time is its CPU time plus the time its thread waited for a core. The run records
each stream thread's CPU seconds per iteration (``RankTimes.stream_cpu_s``, ``time.thread_time``); the prediction
has each compute op's time alone (:meth:`meshplan.cost.cost.CostModel.op_durations`, what a kernel costs on a core
of its own) and its simulated time (stretched where ranks share the host's cores, the ``pool`` of ``cpu-local``).
Per rank, over the ops of its ``compute`` stream:

* **kernel error** = (predicted alone − measured CPU) / measured CPU: how far the kernel model (the calibration)
  is off, whatever else ran on the host;
* **waiting** = measured wall − measured CPU, against the model's own waiting (simulated − alone): the time the
  threads were runnable without a core. Waiting beyond what the model expected is load the model was not told
  about (another process, more ranks than the calibration's cores), not a model error.

The verdict (medians over ranks): ``contention`` when the unexpected waiting is more than
:data:`CONTENTION_SHARE` of the measured wall time and the kernel error within :data:`KERNEL_TOLERANCE`;
``compute model`` when the kernel error is beyond it and the waiting is not; ``contention and compute model`` when
both are (the CPU time does not wait for a core: a kernel error that large is the model's, busy host or not);
else ``consistent``. GPU runs (the CPU time of a launching thread says nothing about
its kernels) and measurements without stream CPU times get None.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from meshplan.plan.schedule import BUSY_KINDS

CONTENTION_SHARE = 0.2     # unexpected waiting over this share of the compute wall time: the host was busy
KERNEL_TOLERANCE = 0.15    # the kernels' CPU time this far from the prediction: the kernel model is off


def diagnose(pred_alone_s: float, pred_wall_s: float, meas_wall_s: float, meas_cpu_s: float) -> dict[str, Any]:
    """The verdict from one rank's (or the median rank's) compute-stream totals per iteration, seconds:
    predicted alone and simulated, measured wall and CPU. Returns the four inputs, ``kernel_error_pct``,
    ``waited_s`` (measured), ``expected_wait_s`` (the model's), ``unexpected_wait_share`` and ``verdict``."""
    waited = max(meas_wall_s - meas_cpu_s, 0.0)
    expected = max(pred_wall_s - pred_alone_s, 0.0)
    share = (waited - expected) / meas_wall_s if meas_wall_s > 0 else 0.0
    kernel = 100.0 * (pred_alone_s - meas_cpu_s) / meas_cpu_s if meas_cpu_s > 0 else None
    busy = share > CONTENTION_SHARE
    off = kernel is not None and abs(kernel) > 100 * KERNEL_TOLERANCE
    verdict = {(True, True): "contention and compute model", (True, False): "contention",
               (False, True): "compute model", (False, False): "consistent"}[busy, off]
    return {"predicted_alone_s": pred_alone_s, "predicted_wall_s": pred_wall_s, "measured_wall_s": meas_wall_s,
            "measured_cpu_s": meas_cpu_s, "kernel_error_pct": kernel, "waited_s": waited,
            "expected_wait_s": expected, "unexpected_wait_share": share, "verdict": verdict}


def contention(sched, alone: np.ndarray, p_start: np.ndarray, p_end: np.ndarray, m_start: np.ndarray,
               m_end: np.ndarray, meas) -> dict[str, Any] | None:
    """:func:`diagnose` on the median rank's compute-stream totals; None for GPU runs and measurements without
    stream CPU times. ``alone`` [n_ops]: predicted seconds alone; ``p_*`` simulated and ``m_*`` measured op times
    (one iteration, pass-relative)."""
    if meas.env.get("backend") != "gloo" or "compute" not in sched.streams.names:
        return None
    cpu = {r.rank: (r.stream_cpu_s or {}).get("compute") for r in meas.ranks}
    if not cpu or any(v is None for v in cpu.values()):
        return None
    o = sched.ops
    on = (o.stream == sched.streams.names.index("compute")) & np.isin(o.kind, BUSY_KINDS)
    rows = []
    for r in sorted(cpu):
        mine = on & (o.rank == r) & np.isfinite(m_end) & np.isfinite(m_start)
        rows.append((float(alone[mine].sum()), float((p_end - p_start)[mine].sum()),
                     float((m_end - m_start)[mine].sum()), float(cpu[r])))
    med = np.median(np.asarray(rows), axis=0)
    return diagnose(*map(float, med)) | {"ranks": len(rows)}


def contention_text(c: dict[str, Any] | None) -> str | None:
    """One line for ``run`` and ``compare``."""
    if not c:
        return None
    from meshplan.core.units import fmt_seconds
    fmt = fmt_seconds
    kernel = "-" if c["kernel_error_pct"] is None else f"{c['kernel_error_pct']:+.0f}%"
    what = (f"compute threads' CPU {fmt(c['measured_cpu_s'])} against {fmt(c['predicted_alone_s'])} predicted "
            f"(kernel error {kernel}); wall {fmt(c['measured_wall_s'])}, of which {fmt(c['waited_s'])} waiting for "
            f"a core, {fmt(c['expected_wait_s'])} expected (median rank, per iteration)")
    if c["verdict"] == "contention":
        return (f"contention: {what} — the host ran other work: the error says the host was busy, not that the model "
                "is wrong; measure on a quiet host (or with no more ranks than cores)")
    if c["verdict"] == "compute model":
        return (f"compute model: {what} — not contention: the compute ops' own time (kernels and the executor's "
                "per-op work) is off the model; recalibrate on this host (meshplan calibrate --out FILE.yaml, named "
                "in the topology's calibration:), and see the executor overhead for small ops")
    if c["verdict"] == "contention and compute model":
        return (f"contention and compute model: {what} — the host was busy (waiting the model did not expect), and "
                "the compute ops' own CPU time is off the model too: measure on a quiet host, and recalibrate on "
                "this one (meshplan calibrate --out FILE.yaml, named in the topology's calibration:)")
    return f"consistent: {what}"
