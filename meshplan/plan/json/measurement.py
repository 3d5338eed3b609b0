"""The Measurement JSON (``meshplan run --out``): what the executor measured, with the same op ids as the schedule.

Times are seconds from the start of each op's pass on its rank (passes start after a barrier); per op the
median over the timed iterations. A transfer starts when it is posted and ends when its completion is
observed. ``makespan_s`` is the median over iterations of the summed pass makespans (each the latest op
end over all ranks).
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, NonNegativeFloat, NonNegativeInt, field_validator

MEASUREMENT_VERSION = "1.0"


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class Spread(_Strict):
    """Spread of a time over the timed iterations (seconds)."""

    min_s: NonNegativeFloat
    p25_s: NonNegativeFloat
    p75_s: NonNegativeFloat
    max_s: NonNegativeFloat


class PassTime(_Strict):
    """One pass: median makespan over iterations and its spread."""

    makespan_s: NonNegativeFloat
    spread: Spread


class OpTime(_Strict):
    """One op's median start and end (s from its pass start on its rank)."""

    id: NonNegativeInt
    start_s: NonNegativeFloat
    end_s: NonNegativeFloat


class RankTimes(_Strict):
    """A rank's ops."""

    rank: NonNegativeInt
    ops: list[OpTime]
    peak_memory_bytes: NonNegativeInt = Field(description="live tensor bytes (CPU) or the CUDA allocator's peak")
    peak_rss_bytes: NonNegativeInt = Field(0, description="the process's peak resident set (interpreter and torch "
                                                          "included)")
    peak_rise_bytes: NonNegativeInt | None = Field(
        None, description="the rank's memory for a pass (the largest over its passes, in an extra untimed "
        "iteration): the bytes of the tensors alive at the pass start plus how far memory rose during it — the "
        "resident set's high-water mark over the resident set at the start, the freed heap returned first (CPU, "
        "Linux), or the CUDA allocator's peak over what was allocated at the start")
    stream_cpu_s: dict[str, NonNegativeFloat] | None = Field(
        None, description="per stream, the CPU seconds its thread used in one iteration (all passes; the median "
        "over the timed iterations; time.thread_time): on CPU ranks, whether a stream was slow for want of a core "
        "or busy; the backend's own threads (gloo's) are not counted; on CUDA only the host side")


class TensorError(_Strict):
    """Errors of one gathered tensor against the float64 reference (∞-norm over valid tokens)."""

    max_abs_err: float
    mean_abs_err: float
    single_process_err: float = Field(description="∞-norm error of one process in the same dtype")
    floor: float = Field(description="ε·max|reference|, ε = 2^-8 bf16, 2^-11 fp16, 2^-20 fp32 (of the input dtype, "
                         "or of a coarser dtype the tensor's partials travelled in)")
    bound: float = Field(description="max(floor, 3 × single_process_err)")
    passed: bool


class Numerics(_Strict):
    """The numerics check (docs/bugcases.md criterion); ``passed`` is None when the check did not run.

    Rows with no permitted key (padding) must come back with O = 0 and LSE = −inf (FlashAttention writes +inf
    there, torch's math path NaN); both checks hold them to it.
    """

    checked: Literal["full", "sampled", "off"] = Field(
        description="full: every returned row and key against the float64 reference; sampled: a sample of (batch, "
        "row, head) triples against it, with dO zero outside them (dK/dV: their contributions), every padding row "
        "O = 0 / LSE = -inf and dQ = 0 outside the sample; off: not checked (run --no-check)")
    sampled_triples: NonNegativeInt | None = Field(None, description="the sampled check's triples (None otherwise)")
    passed: bool | None
    reference: str = ""
    tensors: dict[str, TensorError] = Field(default_factory=dict)

    @field_validator("checked", mode="before")
    @classmethod
    def _from_bool(cls, value):
        """Files written before the sampled check said true / false."""
        return {True: "full", False: "off"}.get(value, value) if isinstance(value, bool) else value


class MeasurementJSON(_Strict):
    """A run of a schedule."""

    measurement_version: Literal["1.0"] = MEASUREMENT_VERSION
    schedule: str = Field(description="sha256 of the schedule file (decompressed)")
    schedule_path: str
    algorithm: str
    env: dict[str, object]
    settings: dict[str, object]
    numerics: Numerics
    ranks: list[RankTimes]
    passes: dict[str, PassTime]
    makespan_s: NonNegativeFloat
    makespan_spread: Spread
    peak_memory_bytes: NonNegativeInt = Field(description="max over ranks (see peak_memory_kind)")
    peak_rise_bytes: NonNegativeInt | None = Field(None, description="max over ranks of RankTimes.peak_rise_bytes")
    peak_memory_kind: Literal["live-tensors", "cuda-allocator"] = Field(
        description="live-tensors: bytes of the schedule's live tensors (CPU); cuda-allocator: max_memory_allocated")
    wall_s: NonNegativeFloat
