"""The memory model: a rank's peak memory = its live buffers + the workspace of the ops running + the runtime's own.

The schedule's buffers (:func:`meshplan.plan.dataflow.peak_memory`) are a lower bound: the kernels, merges and
transfers of an op take transient memory while they run (upcasts, kernel outputs before they are merged,
wire images), and a pass's runtime takes some of its own. The model adds, per op and for the time it runs
(``[start, end)`` of the execution):

* a compute op: ``fixed + q · (B·h·s_q·D) + kv · (B·h·s_kv·D)`` bytes, with the coefficients of its pass and
  the workload's dtype (``h``: the op's query heads; ``s_q``/``s_kv``: its kernel's rows and columns);
* a merge or accumulate op: ``merge · size_bytes``;
* a send or recv: ``transfer · size_bytes`` (the executor's wire image or receive buffer);

and per pass and rank ``runtime_bytes``. ``peak_memory_total_bytes`` of a prediction is ``overhead_factor`` x the
peak of that sum over the execution + ``runtime_bytes``; ``meshplan search --memory-limit`` filters on it.

Coefficients come from ``meshplan calibrate`` (``memory`` of the calibration file: each op of a few small
schedules run alone on this host, its memory rise measured — micro-level, never the end-to-end runs compared
against), except ``overhead_factor``: the allocator's fragmentation is not seen by one op alone, so it is fitted
on one declared run (:data:`DECLARED_RUN`, a small Mesh, run by the executor during calibration) and that run
is not among those the model is judged on.

Without a calibration a device gets :data:`DEFAULTS`, not measured: for GPUs what FlashAttention-2 allocates
(``csrc/flash_attn/flash_api.cpp``: the forward only O and LSE, held until merged, 2 B per query element in bf16;
the backward ``dq_accum`` in fp32 plus dQ, 6 B per query element, and dK, dV before they are accumulated —
``dk_expanded``/``dv_expanded`` under GQA —, 4 B per key element); meshplan's own CUDA backward (an fp32
recurrence) takes more, which ``meshplan calibrate`` on the GPU measures. For CPU ranks, coefficients measured once
on the AVX2 host these tools were built on.
"""

from __future__ import annotations

from typing import Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, NonNegativeFloat, NonNegativeInt, PositiveInt

from meshplan.plan.schedule import COMPUTE, KIND, RECV, SEND, Schedule

Dtype = Literal["bf16", "fp16", "fp32"]


class MemorySample(BaseModel):
    """One op run alone and how far memory rose meanwhile (:mod:`meshplan.executor.calibrate.memory`); the
    ``raw.memory`` rows of a calibration file."""

    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)

    kind: Literal["compute", "merge", "transfer", "declared-run"] = Field(
        description="an op alone, or the declared run (meshplan.cost.memory.DECLARED_RUN) for overhead_factor")
    dtype: Literal["bf16", "fp16", "fp32"] | None = None
    pass_: Literal["fwd", "bwd"] | None = Field(None, alias="pass")
    s_q: PositiveInt | None = None
    s_kv: PositiveInt | None = None
    batch: PositiveInt | None = None
    heads: PositiveInt | None = None
    head_dim: PositiveInt | None = None
    size_bytes: PositiveInt | None = Field(None, description="merges: bytes merged; transfers: wire bytes")
    rise_bytes: NonNegativeInt


class OpCoefficients(BaseModel):
    """Workspace of compute ops in one dtype: bytes per element of the kernel's query and key sides."""

    model_config = ConfigDict(extra="forbid")
    fwd_q_bytes_per_elem: NonNegativeFloat
    fwd_kv_bytes_per_elem: NonNegativeFloat
    bwd_q_bytes_per_elem: NonNegativeFloat
    bwd_kv_bytes_per_elem: NonNegativeFloat
    fixed_bytes: NonNegativeFloat = Field(0.0, description="per compute op, whatever its size")


class MemorySpec(BaseModel):
    """The ``memory`` section of a calibration file (or a device default)."""

    model_config = ConfigDict(extra="forbid")
    source: str = Field(description="how the coefficients were obtained")
    compute: dict[Dtype, OpCoefficients] = Field(description="per workload dtype")
    merge_bytes_per_byte: NonNegativeFloat = Field(description="merge/accumulate ops, per byte merged")
    transfer_bytes_per_byte: NonNegativeFloat = Field(description="sends and recvs, per wire byte")
    runtime_bytes: NonNegativeFloat = Field(description="per pass and rank: the runtime's own rise")
    overhead_factor: float = Field(1.0, ge=1.0, description="the allocator's overhead (fragmentation): a declared "
                                   "run's measured memory over the model's peak without it; multiplies the peak")
    tolerance_pct: NonNegativeFloat | None = Field(
        None, description="the largest error of the fit on its own samples (calibrated models)")

    def coefficients(self, dtype: str) -> OpCoefficients:
        """The coefficients for ``dtype``: its own, else those of a dtype of the same size, else fp32's."""
        same_size = {"bf16": "fp16", "fp16": "bf16"}.get(dtype)
        for d in (dtype, same_size, "fp32", *self.compute):
            if d in self.compute:
                return self.compute[d]
        raise ValueError("a memory model needs compute coefficients")


_FLASH2 = OpCoefficients(fwd_q_bytes_per_elem=2.0, fwd_kv_bytes_per_elem=0.0,
                         bwd_q_bytes_per_elem=6.0, bwd_kv_bytes_per_elem=4.0)
DEFAULTS = {
    "gpu": MemorySpec(source="uncalibrated default: FlashAttention-2's allocations (flash_api.cpp)",
                      compute={"bf16": _FLASH2, "fp16": _FLASH2,
                               "fp32": _FLASH2.model_copy(update={"fwd_q_bytes_per_elem": 4.0,
                                                                  "bwd_q_bytes_per_elem": 8.0,
                                                                  "bwd_kv_bytes_per_elem": 8.0})},
                      merge_bytes_per_byte=2.0, transfer_bytes_per_byte=1.0, runtime_bytes=0.0),
    "cpu": MemorySpec(source="uncalibrated default, measured once on an AVX2 host (torch 2.13 CPU kernels)",
                      compute={"bf16": OpCoefficients(fwd_q_bytes_per_elem=10.0, fwd_kv_bytes_per_elem=10.0,
                                                      bwd_q_bytes_per_elem=20.0, bwd_kv_bytes_per_elem=18.0),
                               "fp32": OpCoefficients(fwd_q_bytes_per_elem=8.0, fwd_kv_bytes_per_elem=4.0,
                                                      bwd_q_bytes_per_elem=16.0, bwd_kv_bytes_per_elem=12.0)},
                      merge_bytes_per_byte=4.0, transfer_bytes_per_byte=1.0, runtime_bytes=0.0),
}


# the one end-to-end run calibration fits overhead_factor on (benchmarks/memory_cpu.py's runs differ from it)
DECLARED_RUN = {"algorithm": "mesh", "ranks": 4, "seq_len": 4096, "heads": 4, "head_dim": 64, "dtype": "bf16",
                "passes": "fwd+bwd"}


def op_workspace_bytes(sched: Schedule, spec: MemorySpec) -> np.ndarray:
    """[n_ops] transient bytes each op holds while it runs (module docstring)."""
    o, w = sched.ops, sched.workload
    coef = spec.coefficients(w.dtype)
    ws = np.zeros(len(o))
    elems = w.batch * (o.h1 - o.h0).astype(np.float64) * w.head_dim
    for phase, (cq, ckv) in enumerate(((coef.fwd_q_bytes_per_elem, coef.fwd_kv_bytes_per_elem),
                                       (coef.bwd_q_bytes_per_elem, coef.bwd_kv_bytes_per_elem))):
        sel = (o.kind == COMPUTE) & (o.phase == phase) & (o.flops > 0)
        ws[sel] = coef.fixed_bytes + elems[sel] * (cq * o.s_q[sel] + ckv * o.s_kv[sel])
    side = (o.kind == KIND["merge"]) | (o.kind == KIND["accumulate"])
    ws[side] = spec.merge_bytes_per_byte * o.size_bytes[side]
    comm = (o.kind == SEND) | (o.kind == RECV)
    ws[comm] = spec.transfer_bytes_per_byte * o.size_bytes[comm]
    return ws


def model_peak_bytes(sched: Schedule, spec: MemorySpec, phase: int, start: np.ndarray, end: np.ndarray,
                     workspace: np.ndarray | None = None) -> float:
    """The memory model's peak of one pass along an execution (op start/end times), max over ranks:
    ``overhead_factor`` x (buffers + each op's workspace while it runs) + ``runtime_bytes``. ``workspace``:
    :func:`op_workspace_bytes` when the caller has it already."""
    from meshplan.plan.dataflow import peak_memory

    ws = op_workspace_bytes(sched, spec) if workspace is None else workspace
    return spec.overhead_factor * float(peak_memory(sched, phase, start, end, ws).max(initial=0.0)) \
        + spec.runtime_bytes


def kernel_workspace_bytes(spec: MemorySpec, dtype: str, pass_: str, batch: int, heads: int, head_dim: int,
                           s_q: float, s_kv: float) -> float:
    """The workspace of one compute op of kernel shape s_q × s_kv tokens over ``heads`` query heads."""
    c = spec.coefficients(dtype)
    cq, ckv = ((c.fwd_q_bytes_per_elem, c.fwd_kv_bytes_per_elem) if pass_ == "fwd"
               else (c.bwd_q_bytes_per_elem, c.bwd_kv_bytes_per_elem))
    return c.fixed_bytes + batch * heads * head_dim * (cq * s_q + ckv * s_kv)


def closed_form_peak_bytes(spec: MemorySpec, plan, pass_: str, buffers_bytes: float, wire_bytes: float) -> float:
    """The memory-model peak of a closed form (Ring, pass-Q and Mesh timings, which run one block per op): its
    buffer peak + the largest block's kernel workspace + the wire images of ``wire_bytes`` in flight + the
    runtime's. An estimate: ``search`` checks simulated candidates on their simulated total, and the schedules
    it writes on their own."""
    w, m = plan.workload, plan.matrix
    ok = m.permitted
    ws = kernel_workspace_bytes(spec, w.dtype, pass_, w.batch, w.n_heads, w.head_dim, m.s_q[ok], m.s_kv[ok])
    peak = float(buffers_bytes) + float(np.max(ws, initial=0.0)) + spec.transfer_bytes_per_byte * wire_bytes
    return spec.overhead_factor * peak + spec.runtime_bytes


def estimated_peak_bytes(timing: dict) -> float:
    """A candidate's memory-model peak before it is simulated: the largest over passes of each closed form's
    ``peak_memory_total_bytes`` (its buffer peak where it has none)."""
    return max(t.peak_memory_bytes if t.peak_memory_total_bytes is None else t.peak_memory_total_bytes
               for t in timing.values())


def declared_workload():
    """The Workload of :data:`DECLARED_RUN`."""
    from meshplan.model.workload import resolve
    d = DECLARED_RUN
    return resolve(seq_len=d["seq_len"], heads=d["heads"], kv_heads=d["heads"], head_dim=d["head_dim"],
                   dtype=d["dtype"], passes=d["passes"])


def declared_candidate():
    """:data:`DECLARED_RUN` planned and simulated on ``cpu-local`` (a :class:`meshplan.search.candidate.Candidate`)."""
    from meshplan.search.candidate import predict
    from meshplan.model.topology import Topology

    n = DECLARED_RUN["ranks"]
    return predict(DECLARED_RUN["algorithm"], declared_workload(), Topology.load("cpu-local", n), n, {})


def fit_overhead(spec: MemorySpec, measured_bytes: float) -> float:
    """``overhead_factor``: the declared run's measured memory over ``spec``'s peak for it without the factor (at
    least 1)."""
    cand = declared_candidate()
    plain = spec.model_copy(update={"overhead_factor": 1.0, "runtime_bytes": 0.0})
    ws, off = op_workspace_bytes(cand.schedule, plain), cand.sim.pass_offset
    peak = max(model_peak_bytes(cand.schedule, plain, p, cand.sim.start - off[p], cand.sim.end - off[p], ws)
               for p in cand.schedule.passes)
    return _r(max(1.0, (measured_bytes - spec.runtime_bytes) / peak))


def fit_memory(samples: list[dict], runtime_bytes: float = 0.0) -> MemorySpec:
    """The coefficients from ``raw.memory`` samples (:mod:`meshplan.executor.calibrate.memory`).

    Compute ops, per dtype: non-negative least squares of the rise on ``[1, fwd q elems, fwd kv elems, bwd q
    elems, bwd kv elems]`` (scipy's NNLS; one ``fixed_bytes`` for both passes). Merges and wire images: the
    median of rise / bytes. ``tolerance_pct``: the largest relative error of the fit on its compute samples.
    ``overhead_factor``: from the ``declared-run`` sample, where there is one (:func:`fit_overhead`).

    Raises:
        ValueError: no compute samples.
    """
    from scipy.optimize import nnls

    compute: dict[str, OpCoefficients] = {}
    worst = 0.0
    for dtype in sorted({s["dtype"] for s in samples if s["kind"] == "compute"}):
        rows = [s for s in samples if s["kind"] == "compute" and s["dtype"] == dtype]
        a = np.zeros((len(rows), 5))
        y = np.array([float(s["rise_bytes"]) for s in rows])
        for i, s in enumerate(rows):
            e = s["batch"] * s["heads"] * s["head_dim"]
            col = 1 if s["pass"] == "fwd" else 3
            a[i, 0], a[i, col], a[i, col + 1] = 1.0, e * s["s_q"], e * s["s_kv"]
        scale = np.maximum(y, 1.0)                          # relative residuals: small ops count as much
        x, _ = nnls(a / scale[:, None], y / scale)
        worst = max(worst, float(np.max(np.abs(a @ x - y) / scale)) * 100)
        compute[dtype] = OpCoefficients(fwd_q_bytes_per_elem=_r(x[1]), fwd_kv_bytes_per_elem=_r(x[2]),
                                        bwd_q_bytes_per_elem=_r(x[3]), bwd_kv_bytes_per_elem=_r(x[4]),
                                        fixed_bytes=round(float(x[0])))
    if not compute:
        raise ValueError("no compute-op memory samples")

    def ratio(kind: str) -> float:
        r = [s["rise_bytes"] / s["size_bytes"] for s in samples if s["kind"] == kind and s["size_bytes"]]
        return _r(float(np.median(r))) if r else 0.0

    spec = MemorySpec(source="meshplan calibrate: each executor op run alone, its memory rise measured "
                             "(meshplan.executor.calibrate.memory); NNLS fit",
                      compute=compute, merge_bytes_per_byte=ratio("merge"),
                      transfer_bytes_per_byte=ratio("transfer"), runtime_bytes=round(runtime_bytes),
                      tolerance_pct=_r(worst))
    runs = [s["rise_bytes"] for s in samples if s["kind"] == "declared-run"]
    if runs:
        spec = spec.model_copy(update={"overhead_factor": fit_overhead(spec, float(np.median(runs))),
                                       "source": spec.source + "; overhead_factor from the declared run"})
    return spec


def _r(x: float) -> float:
    return float(f"{float(x):.4g}")
