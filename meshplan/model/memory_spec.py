"""The memory model's declared coefficients: the ``memory`` section of a calibration file and the uncalibrated
device defaults (how they are used: :mod:`meshplan.cost.memory`; how they are fitted: :mod:`meshplan.truth.memory_fit`).

Without a calibration a device gets :data:`DEFAULTS`, not measured: for GPUs what FlashAttention-2 allocates
(``csrc/flash_attn/flash_api.cpp``: the forward only O and LSE, held until merged, 2 B per query element in bf16;
the backward ``dq_accum`` in fp32 plus dQ, 6 B per query element, and dK, dV before they are accumulated —
``dk_expanded``/``dv_expanded`` under GQA —, 4 B per key element); meshplan's own CUDA backward (an fp32
recurrence) takes more, which ``meshplan calibrate`` on the GPU measures. For CPU ranks, coefficients measured once
on an AVX2 host.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, NonNegativeFloat, NonNegativeInt, PositiveInt

Dtype = Literal["bf16", "fp16", "fp32"]


class MemorySample(BaseModel):
    """One op run alone and how far memory rose meanwhile (:mod:`meshplan.executor.calibrate.memory`); the
    ``raw.memory`` rows of a calibration file."""

    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)

    kind: Literal["compute", "merge", "transfer", "declared-run"] = Field(
        description="an op alone, or the declared run (meshplan.truth.memory_fit.DECLARED_RUN) for overhead_factor")
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
