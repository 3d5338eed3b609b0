"""A calibration file's parameters fitted from its raw micro-measurements (the file's types, loading and how a
topology takes its values: :mod:`meshplan.model.calibration_file`; each fitted form: :mod:`meshplan.truth.fit`)."""

from __future__ import annotations

import datetime

import numpy as np

from meshplan.core.units import round_sig
from meshplan.model.calibration_file import CalibrationSpec, HostFacts, LinkFit, PoolFit, Raw
from meshplan.truth import fit
from meshplan.truth.calibration_kernel import kernel_table, merge_by_dtype
from meshplan.truth.memory_fit import fit_memory


def fit_calibration(raw: Raw, device: HostFacts, name: str, wall_s: float = 0.0,
                    measured_at: datetime.date | None = None) -> CalibrationSpec:
    """Fit every parameter from ``raw`` (see :mod:`meshplan.truth.fit` for each form). The efficiency table is relative
    to the ``raw.dtype`` peak (its matmul FLOP/s, or the best attention kernel's when that is higher, so no
    efficiency exceeds 1). Another dtype's peak is what its attention kernels reach
    relative to ``raw.dtype``'s at the same shapes (``raw.dtype_kernels``; the median ratio), so the one table
    holds for both — a matmul peak would not (on CPUs fp32 attention is far closer to bf16 than fp32 matmul
    is); without such samples, that dtype's matmul peak."""
    peaks = {dt: max(2.0 * n ** 3 / t for d, n, t in raw.gemm if d == dt) for dt in {d for d, _, _ in raw.gemm}}
    if raw.dtype in peaks:          # a CPU's attention kernels can beat a noisy single-thread matmul: the peak is
        best = max((s.flops / s.time_s for s in raw.kernels), default=0.0)       # at least the best kernel seen
        peaks[raw.dtype] = max(peaks[raw.dtype], best)
    for dt in {d for d, *_ in raw.dtype_kernels}:
        ratio = float(np.median([t_ref / t for d, _, t, t_ref in raw.dtype_kernels if d == dt]))
        peaks[dt] = peaks[raw.dtype] * ratio
    if raw.dtype not in peaks or "fp32" not in peaks:
        raise ValueError(f"need {raw.dtype} and fp32 matmul timings")
    # as written, so the table fits the file's peak and launch exactly
    launch_s = round_sig(float(np.median(raw.launch_s)) * 1e6) * 1e-6
    peak = round_sig(peaks[raw.dtype] / 1e12) * 1e12
    kernel = kernel_table(raw, peak, launch_s, {dt: round_sig(peaks[dt] / 1e12) / round_sig(peaks[raw.dtype] / 1e12)
                                                 for dt in peaks},
                          segments="per_call" if device.backend == "gloo" else "varlen")
    merge_rate = fit.fit_throughput([b for b, _ in raw.merges], [t for _, t in raw.merges])
    kernel = kernel.model_copy(update={"merge_dtype": merge_by_dtype(raw, merge_rate)})
    body = {"name": name, "device": device, "measured_at": measured_at or datetime.date.today(),
            "wall_s": round(wall_s, 1), "peak_bf16_tflops": round_sig(peaks["bf16"] / 1e12),
            "peak_fp16_tflops": round_sig(peaks["fp16"] / 1e12) if "fp16" in peaks else None,
            "peak_fp32_tflops": round_sig(peaks["fp32"] / 1e12),
            "hbm_GBps": round_sig(merge_rate / kernel.merge_hbm_fraction / 1e9), "kernel": kernel, "raw": raw}
    if raw.memory:
        body["memory"] = fit_memory([m.model_dump(by_alias=True) for m in raw.memory])
    if raw.probe_ms:
        body["host_probe_ms"] = round_sig(float(np.median(raw.probe_ms)))
    body |= _transfer_fits(raw)
    if raw.sharing:
        slowest: dict[int, float] = {}      # per rank count: the slowest rank (the OS lets some finish early)
        for k, t in raw.sharing:
            slowest[k] = max(slowest.get(k, 0.0), t)
        cap = fit.fit_pool_capacity(list(slowest), list(slowest.values()))
        body["compute_pool"] = PoolFit(capacity_ranks=round_sig(cap), threads_per_rank=device.threads_per_rank)
    return CalibrationSpec.model_validate(body)


def _transfer_fits(raw: Raw) -> dict:
    """The transfer parameters of ``raw``'s link class: the link and α (ping-pong), the shared loopback (two flows),
    κ and κ_t (the overlap run) and the transfers' CPU per byte (their exchanges' process CPU)."""
    out: dict = {}
    one = [s for s in raw.p2p if s.flows == 1]
    if one and raw.link_class is not None:
        alpha_s, bw = fit.fit_alpha_beta([s.size_bytes for s in one], [s.time_s for s in one])
        # on one host the per-message software cost and the hops' latency are one number: all of it is
        # alpha_sw (p2p_overhead_us); the hops get 0
        out |= {"links": {raw.link_class: LinkFit(latency_us=0.0, usable_GBps=round_sig(bw / 1e9))},
                "p2p_overhead_us": round_sig(alpha_s * 1e6)}
        two = [s for s in raw.p2p if s.flows == 2]
        if two and raw.link_class == "loopback":
            agg = fit.fit_shared_bandwidth([s.size_bytes for s in two], [s.time_s for s in two], 2, alpha_s)
            out["shared_GBps"] = round_sig(agg / 1e9)
    if raw.overlap and raw.link_class is not None:
        o = raw.overlap
        kappa = fit.fit_kappa([s.alone_s for s in o], [s.with_s for s in o], [s.overlap_s for s in o])
        out["overlap_kappa"] = {raw.link_class: round_sig(kappa)}
        timed = [s for s in o if s.comm_s is not None and s.comm_alone_s is not None]
        if timed and raw.link_class == "loopback":
            t_kappa = fit.fit_transfer_kappa([s.comm_s for s in timed], [s.comm_alone_s for s in timed],
                                             [s.overlap_s for s in timed])
            out["transfer_kappa"] = {raw.link_class: round_sig(t_kappa)}
    if raw.transfer_cpu and raw.link_class == "loopback":
        per_byte = fit.fit_transfer_cpu(*zip(*raw.transfer_cpu))
        if per_byte is not None:
            out["transfer_cpu_us_per_MB"] = {raw.link_class: round_sig(per_byte * 1e12)}
    return out
