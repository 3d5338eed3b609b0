"""Calibration files: what ``meshplan calibrate`` measured on a host, the parameters fitted from it, and
how a topology file that names one (``calibration: FILE``) takes its values. No torch here.

A calibration file holds the host facts (the topology's ``device.model`` it was measured for, CPU, cores,
torch, backend), the date, the fitted numbers in the topology's units (``*_tflops``, ``*_GBps``,
``*_us``), the attention efficiency table inline (:class:`~meshplan.model.kernel_tables.KernelTableSpec`), and the raw
micro-measurements (``raw``), so :func:`meshplan.truth.calibration_fit.fit_calibration` can be re-run on them. How
each number is fitted
is in :mod:`meshplan.truth.fit`; which topology keys it replaces is in :func:`apply_calibration`.
"""

from __future__ import annotations

import datetime
import functools
from importlib import resources
from pathlib import Path
from typing import Annotated, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    NonNegativeFloat,
    NonNegativeInt,
    PositiveFloat,
    PositiveInt,
    field_validator,
)

from meshplan.core.errors import UserError
from meshplan.model.kernel_tables import KernelTableSpec
from meshplan.model.memory_spec import MemorySample, MemorySpec
from meshplan.model.topology_spec import TopologySpec

LinkClass = Literal["loopback", "nvlink", "pcie", "socket", "net"]
Kappa = Annotated[float, Field(ge=0, lt=1)]
# where a link class's fit goes in a topology: fabric kind -> the fabric's key holding that class's link
_LINK_KEY = {"loopback": ("loopback", "link"), "nvlink": ("nvswitch", "port")}


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)


class HostFacts(_Strict):
    """What the numbers were measured on."""

    model: str = Field(description="the topology's node.device.model the calibration is for (must match)")
    cpu: str = Field(description="CPU model name of the host")
    isa: str | None = Field(None, description="the CPU's widest vector unit as torch sees it (amx, avx512_bf16, "
                            "avx512, avx2): half-precision kernels are native only with amx or avx512_bf16")
    cores: PositiveInt = Field(description="logical CPUs of the host")
    gpu: str | None = Field(None, description="GPU name (CUDA runs)")
    torch: str
    backend: Literal["gloo", "nccl"]
    threads_per_rank: PositiveInt = Field(description="torch threads of each measured rank")
    load_1min: NonNegativeFloat | None = Field(None, description="the host's 1-minute load average when the run "
                                               "started")
    others_busy_cores: NonNegativeFloat | None = Field(None, description="cores other processes (or the hypervisor) "
                                                       "kept busy during the run, on average: noise when above ~0.1")


class KernelSample(_Strict):
    """One attention kernel timing (the executor's block_forward / block_backward_from_out)."""

    pass_: Literal["fwd", "bwd"] = Field(alias="pass")
    s_q: PositiveInt
    s_kv: PositiveInt
    causal: bool = Field(description="a causal-diagonal piece (s_q = s_kv, elementwise mask)")
    batch: PositiveInt
    heads: PositiveInt
    head_dim: PositiveInt
    flops: PositiveFloat = Field(description="4·B·H·D·pairs (forward), 2.5x backward: the cost model's count")
    time_s: PositiveFloat


class SegmentSample(_Strict):
    """One block over packed documents run by the executor (block_forward / block_backward_from_out with the
    documents' key runs): ``causal``, each document's causal square; ``rect``, each document's second half
    (⌈L/2⌉ rows) against its first (⌊L/2⌋ keys). The kernel table's ``segment_us`` is the median over samples of
    (time − the table's price of its kernels) per document."""

    pass_: Literal["fwd", "bwd"] = Field(alias="pass")
    kind: Literal["causal", "rect"]
    doc_lens: list[PositiveInt]
    batch: PositiveInt
    heads: PositiveInt
    head_dim: PositiveInt
    time_s: PositiveFloat


class TransferSample(_Strict):
    """Point-to-point transfers: ``flows`` equal flows of ``size_bytes`` each (1: half a ping-pong round trip;
    2: both ranks send to each other at once, time until both are done)."""

    size_bytes: PositiveInt
    flows: PositiveInt = 1
    time_s: PositiveFloat


class OverlapSample(_Strict):
    """One rank's kernel alone and while its transfers were in flight, and how long the two overlapped; the
    references (``alone_s``, ``comm_alone_s``) from the same round since this session (before: one median each)."""

    rank: int
    alone_s: PositiveFloat
    with_s: PositiveFloat
    overlap_s: NonNegativeFloat
    comm_s: PositiveFloat | None = Field(None, description="how long the transfers took during the run")
    comm_alone_s: PositiveFloat | None = Field(None, description="how long the same transfers take without the kernel")


class Raw(_Strict):
    """The micro-measurements the fit used."""

    dtype: Literal["bf16", "fp16", "fp32"] = Field("bf16", description="the dtype of the kernel timings")
    gemm: list[tuple[Literal["bf16", "fp16", "fp32"], PositiveInt, PositiveFloat]] = Field(
        description="(dtype, n, seconds) of an n x n x n matmul: 2n³ FLOP")
    launch_s: list[PositiveFloat] = Field(description="a 1-token forward kernel (the fixed cost per call)")
    kernels: list[KernelSample]
    merges: list[tuple[PositiveInt, PositiveFloat]] = Field(
        description="(bytes touched = 3 x output bytes, seconds) of the executor's LSE merge")
    dtype_merges: list[tuple[Literal["bf16", "fp16", "fp32"], PositiveInt, PositiveFloat]] = Field(
        [], description="(dtype, bytes touched = 3 x output bytes in that dtype, seconds) of the same merge with O in "
        "the dtypes other than raw.dtype: the kernel table's merge_dtype is each one's median time over bytes / "
        "merge rate")
    link_class: LinkClass | None = Field(None, description="class of the route the transfers took")
    p2p: list[TransferSample] = []
    overlap: list[OverlapSample] = []
    head_dim_kernels: list[tuple[Literal["fwd", "bwd"], PositiveInt, PositiveInt, PositiveFloat,
                                 PositiveFloat]] = Field(
        [], description="(pass, head dim, s, FLOPs, seconds) of a full s x s kernel in raw.dtype (the median over the "
        "dtype sweep's rounds): the efficiency multiplier by head dim is the median over s of its efficiency over "
        "the efficiency at the kernels' own head dim")
    dtype_kernels: list[tuple[Literal["bf16", "fp16", "fp32"], PositiveInt, PositiveFloat, PositiveFloat]] = Field(
        [], description="(dtype, s, seconds in that dtype, seconds in raw.dtype) of an s x s forward + backward "
        "attention kernel: the attention-equivalent peak of another dtype is the raw.dtype peak x the time ratio")
    dtype_sweep: list[tuple[Literal["bf16", "fp16", "fp32"], Literal["fwd", "bwd"], PositiveInt, PositiveInt,
                            PositiveFloat, PositiveFloat]] = Field(
        [], description="(dtype, pass, head dim, s, seconds in that dtype, seconds in raw.dtype) of an s x s kernel "
        "over a sweep of head dims and sizes, one row per interleaved round (both times from the same round): the "
        "kernel table's dtype multipliers by head dim and size (dtype_fwd, dtype_bwd) are the median over rows of "
        "the time ratio")
    recurrence: list[tuple[PositiveInt, PositiveFloat, PositiveFloat]] = Field(
        [], description="(s, seconds of the backward from D (CPU: flash with a surrogate O; CUDA: the fp32 "
        "recurrence), seconds of the flash backward from O) of an s x s block: the kernel table's "
        "bwd_delta_factor is their median ratio")
    dtype_recurrence: list[tuple[Literal["bf16", "fp16", "fp32"], PositiveInt, PositiveFloat, PositiveFloat]] = Field(
        [], description="(dtype, s, seconds from D, seconds from O) as recurrence, in the dtypes other than raw.dtype: "
        "the kernel table's bwd_delta_dtype is each one's median ratio")
    probe_ms: list[PositiveFloat] = Field([], description="the host-speed probe kernel (meshplan.executor.probe), "
                                          "milliseconds, timed throughout the run")
    sharing: list[tuple[PositiveInt, PositiveFloat]] = Field(
        [], description="(ranks running one kernel each at once, seconds of one rank's kernel), a row per rank; "
        "the fit takes the slowest rank of each count: the pool model has them all end together")
    memory: list[MemorySample] = Field([], description="ops run alone, their memory rise: the memory model's fit")
    segment_mixes: list[SegmentSample] = Field(
        [], description="blocks over document mixes (each document its own kernel): the kernel table's segment_us")
    transfer_cpu: list[tuple[PositiveInt, NonNegativeInt, NonNegativeFloat]] = Field(
        [], description="(size_bytes, exchanges, CPU seconds of ranks 0 and 1 together) over the timed two-flow "
        "exchanges of the p2p sweep (every thread, user and system): transfer_cpu_us_per_MB is the median over sizes "
        ">= 1 MiB of CPU seconds / bytes moved (2 x size x exchanges)")
    repeats: PositiveInt = Field(1, description="calibration runs merged into this raw (calibrate --repeat): a "
                                 "timing taken once per run is their median, sample lists are pooled "
                                 "(meshplan.truth.calibration_merge)")

    @field_validator("memory")
    @classmethod
    def _complete_samples(cls, samples: list[MemorySample]) -> list[MemorySample]:
        """Each memory sample carries what its kind's fit reads (a compute op its shape, a merge or transfer its
        bytes)."""
        need = {"compute": ("dtype", "pass_", "s_q", "s_kv", "batch", "heads", "head_dim"),
                "merge": ("size_bytes",), "transfer": ("size_bytes",), "declared-run": ()}
        for k, s in enumerate(samples):
            missing = [f.rstrip("_") for f in need[s.kind] if getattr(s, f) is None]
            if missing:
                raise ValueError(f"sample {k} ({s.kind}) has no {', '.join(missing)}")
        return samples


class LinkFit(_Strict):
    """A link class's fitted per-hop latency and usable bandwidth per direction."""

    latency_us: NonNegativeFloat
    usable_GBps: PositiveFloat


class PoolFit(_Strict):
    """The shared compute pool: ranks' worth of compute the host's cores give together."""

    capacity_ranks: PositiveFloat
    threads_per_rank: PositiveInt


class CalibrationSpec(_Strict):
    """A calibration file."""

    name: str = Field(description="the topology it was measured for")
    device: HostFacts
    measured_at: datetime.date
    wall_s: NonNegativeFloat = Field(description="how long the calibration ran")
    peak_bf16_tflops: PositiveFloat = Field(description="measured BF16 matmul FLOP/s (the efficiencies' peak)")
    peak_fp16_tflops: PositiveFloat | None = None
    peak_fp32_tflops: PositiveFloat
    hbm_GBps: PositiveFloat = Field(description="merge bytes/s / kernel.merge_hbm_fraction")
    kernel: KernelTableSpec
    links: dict[LinkClass, LinkFit] = {}
    shared_GBps: PositiveFloat | None = Field(None, description="all loopback traffic together (loopback)")
    p2p_overhead_us: NonNegativeFloat | None = None
    overlap_kappa: dict[LinkClass, Kappa] = {}
    transfer_kappa: dict[LinkClass, Kappa] = {}
    transfer_cpu_us_per_MB: dict[LinkClass, NonNegativeFloat] = Field(
        {}, description="core-microseconds a transfer takes from the compute pool per MB moved (raw.transfer_cpu)")
    compute_pool: PoolFit | None = None
    host_probe_ms: PositiveFloat | None = Field(None, description="median of raw.probe_ms: the host's speed when "
                                                "calibrated (a run's env.probe_ms against it says how it drifted)")
    memory: MemorySpec | None = Field(None, description="the memory model's coefficients (meshplan.cost.memory)")
    raw: Raw


def dump_yaml(calib: CalibrationSpec) -> str:
    """The file text: a header comment, then the fields (flat rows in flow style)."""
    import yaml

    head = (f"# {calib.name}: measured by `meshplan calibrate` on {calib.measured_at} ({calib.device.cpu}, "
            f"{calib.device.cores} CPUs, torch {calib.device.torch}, {calib.device.backend}).\n"
            "# Fitted values (meshplan/truth/fit.py) replace the topology's placeholders; "
            "`raw` holds the measurements.\n")
    body = calib.model_dump(mode="json", by_alias=True)
    return head + yaml.safe_dump(body, sort_keys=False, default_flow_style=None, width=160, allow_unicode=True)


def load_calibration(path: Path) -> CalibrationSpec:
    """Read and validate a calibration file (cached while the file is unchanged).

    Raises:
        UserError: unreadable, invalid YAML, or a field that does not validate (named).
    """
    try:
        stamp = Path(path).stat().st_mtime_ns
    except OSError as err:
        raise UserError("calibration", f"cannot read {path}: {err.strerror}", "fix the path") from None
    return _load(str(path), stamp)


@functools.lru_cache(maxsize=16)
def _load(path: str, _mtime_ns: int) -> CalibrationSpec:
    import yaml
    from pydantic import ValidationError

    name = Path(path).name
    try:
        raw = yaml.load(Path(path).read_text(), Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))
    except yaml.YAMLError:
        raise UserError(f"calibration {name}", "invalid YAML", "fix the file or recalibrate") from None
    model = CalibrationSpec
    if isinstance(raw, dict) and raw.get("kind") == "nccl-tests":     # link classes fitted from nccl-tests output
        from meshplan.model.nccl_calibration_file import NcclCalibrationSpec as model
    try:
        return model.model_validate(raw)
    except ValidationError as err:
        first = err.errors()[0]
        loc = ".".join(str(p) for p in first["loc"]) or "(top level)"
        msg = first["msg"].replace("Extra inputs are not permitted", "unknown key")
        raise UserError(f"calibration {name}: {loc}", msg, "fix the file or recalibrate") from None


def find_calibration(name: str, base_dir: str | None) -> Path:
    """The file a topology's ``calibration:`` names: relative to the topology file, else a shipped file of
    that path under ``meshplan/topologies/`` (so a copied shipped topology keeps its calibration)."""
    path = Path(name)
    if not path.is_absolute() and base_dir:
        path = Path(base_dir) / path
    if path.is_file():
        return path
    shipped = resources.files("meshplan").joinpath("topologies", name)
    if not Path(name).is_absolute() and shipped.is_file():
        return Path(str(shipped))
    raise UserError("calibration", f"no calibration file {str(path)!r}",
                    "give a path relative to the topology file, or run meshplan calibrate --out FILE")


def apply_calibration(spec: TopologySpec, calib: CalibrationSpec) -> TopologySpec:
    """The topology with the calibration's values in place of its own (device peaks and memory bandwidth,
    the link classes' latency and bandwidth, ``shared_GBps``, ``p2p_overhead_us``, ``overlap_kappa``, the
    compute pool's capacity). The kernel table is the calibration's (:attr:`Topology.kernel`); ``device.kernel``
    says so (``FILE#kernel``, a label, not a table name).

    Raises:
        UserError: measured for another device model, or for a fabric this topology does not have.
    """
    dev = spec.node.device
    if calib.device.model != dev.model:
        raise UserError("calibration", f"measured on {calib.device.model!r}, but {spec.name}'s device is "
                        f"{dev.model!r}", f"run meshplan calibrate --topo {spec.name} --out FILE.yaml on that device")
    d = spec.model_dump()
    d["node"]["device"].update(peak_bf16_tflops=calib.peak_bf16_tflops, peak_fp32_tflops=calib.peak_fp32_tflops,
                               hbm_GBps=calib.hbm_GBps, kernel=f"{spec.calibration or calib.name}#kernel")
    if calib.peak_fp16_tflops is not None:
        d["node"]["device"]["peak_fp16_tflops"] = calib.peak_fp16_tflops
    fab = d["node"]["fabric"]
    for cls, link in calib.links.items():
        kind, key = _LINK_KEY.get(cls, (None, None))
        if kind != fab["kind"]:
            raise UserError(f"calibration: links.{cls}", f"{spec.name} has a {fab['kind']} fabric with no {cls} "
                            "link this calibration can set", "calibrate with this topology")
        fab[key] = {"usable_GBps": link.usable_GBps, "latency_us": link.latency_us}
    if calib.shared_GBps is not None:
        if fab["kind"] != "loopback":
            raise UserError("calibration: shared_GBps", f"{spec.name} has no loopback pool", "remove it")
        fab["shared_GBps"] = calib.shared_GBps
    if calib.p2p_overhead_us is not None:
        d["p2p_overhead_us"] = calib.p2p_overhead_us
    d["overlap_kappa"].update(calib.overlap_kappa)
    d["transfer_kappa"].update(calib.transfer_kappa)
    d["transfer_cpu_us_per_MB"].update(calib.transfer_cpu_us_per_MB)
    if calib.compute_pool is not None:
        pool = d["node"]["compute_pool"] or {"cores": calib.device.cores}
        pool.update(threads_per_rank=calib.compute_pool.threads_per_rank,
                    capacity_ranks=calib.compute_pool.capacity_ranks)
        d["node"]["compute_pool"] = pool
    return TopologySpec.model_validate(d)


def calibrated(spec: TopologySpec, source: str) -> tuple[TopologySpec, CalibrationSpec | None]:
    """(the spec with its calibration applied, the calibration); unchanged and None without one. A file of link
    classes fitted from nccl-tests (:mod:`meshplan.model.nccl_calibration_file`) is applied and gives None: it has no
    kernel
    table or host probe, which is what a :class:`CalibrationSpec` adds to the spec."""
    if spec.calibration is None:
        return spec, None
    base = str(Path(source).parent) if source else None
    calib = load_calibration(find_calibration(spec.calibration, base))
    if not isinstance(calib, CalibrationSpec):
        from meshplan.model.nccl_calibration_file import apply_nccl_calibration
        return apply_nccl_calibration(spec, calib), None
    return apply_calibration(spec, calib), calib
