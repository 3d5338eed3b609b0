"""Attention-kernel efficiency tables: achieved FLOP/s as a fraction of the device's peak, by kernel shape.

docs/cost-model.md: ``t_block = t_launch + FLOPs / (peak · e(shape, pass, mask))``, with ``e`` keyed by the
kernel's shape (s_q query rows, s_kv key columns), not by FLOPs, because zigzag blocks run as c × c/2
kernels. Tables live in ``meshplan/topologies/kernels/*.yaml`` with their sources; a topology's
``device.kernel`` names one (or gives a path). Calibration (``meshplan calibrate``) writes new ones.

Interpolation is bilinear in (log2 s_q, log2 s_kv); above the largest grid size the edge value holds;
below the smallest it falls linearly with the size (a kernel on 16 tokens does not run at the
efficiency of one on 64).
"""

from __future__ import annotations

import functools
from importlib import resources
from pathlib import Path
from typing import Annotated, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, PositiveInt, model_validator

Efficiency = Annotated[float, Field(gt=0, le=1)]


class KernelTableSpec(BaseModel):
    """A kernel efficiency file."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str
    source: str = Field(description="where the numbers come from")
    launch_us: Annotated[float, Field(ge=0)] = Field(description="fixed cost per kernel call, microseconds")
    tokens: list[PositiveInt] = Field(description="grid of s_q and s_kv sizes, ascending")
    fwd: list[list[Efficiency]] = Field(description="forward efficiency, rows s_q, columns s_kv")
    bwd: list[list[Efficiency]] | None = None
    bwd_factor: Annotated[float, Field(gt=0, le=1)] | None = Field(None, description="bwd = factor x fwd")
    elementwise_factor: Annotated[float, Field(gt=0, le=1)] = Field(
        1.0, description="multiplier for blocks needing an elementwise mask (causal diagonal, window, docs)")
    elementwise: list[Annotated[float, Field(gt=0, le=1.5)]] | None = Field(
        None, description="the elementwise multiplier by kernel size, one per tokens entry (at √(s_q·s_kv), linear "
        "in log2 between, the edge value outside); replaces elementwise_factor (calibrated tables: a causal kernel "
        "of a few hundred tokens runs far below a full one, one of thousands nearly as fast)")
    bwd_delta_factor: Annotated[float, Field(ge=1)] = Field(
        1.0, description="backward blocks whose query side carries D = rowsum(dO*O) instead of O (pass-Q, Mesh, "
        "StarTrail, CHARM+) take this many times longer: on CPU the executor runs torch's flash backward with a "
        "surrogate O (dO·D/|dO|², built per call), on CUDA the FlashAttention-2 recurrence (1: no extra cost)")
    bwd_delta_dtype: dict[Literal["bf16", "fp16", "fp32"], Annotated[float, Field(ge=1)]] | None = Field(
        None, description="bwd_delta_factor for the other dtypes (none given: bwd_delta_factor): on a CPU with native "
        "bf16 the surrogate-O backward takes 1.5-1.7x the flash backward in bf16, 1.03-1.07x in fp32")
    segments: Literal["varlen", "per_call"] = Field(
        "varlen", description="how a block cut by document boundaries runs (docs/cost-model.md, Documents): varlen = "
        "one launch, every document segment's tiles at the efficiency of the call's shape (FlashAttention's varlen "
        "path); per_call = one kernel call per segment at its own shape (torch's CPU flash kernel, as the CPU "
        "executor runs)")
    tile_fwd: tuple[PositiveInt, PositiveInt] = Field(
        (1, 1), description="forward tile (query rows, keys) a segment is rounded up to (1 x 1: no rounding)")
    tile_bwd: tuple[PositiveInt, PositiveInt] = Field(
        (1, 1), description="backward tile (query rows, keys)")
    segment_us: Annotated[float, Field(ge=0)] = Field(
        0.0, description="fixed cost per document segment beyond its tiles and launch, microseconds")
    stage_inputs: bool = Field(
        False, description="the executor copies each compute op's inputs into kernel layout before its kernels (a "
        "gather of its tokens, [B, T, h, D] -> contiguous [B, h, T, D], GQA's KV heads expanded): priced, memory "
        "bound, at the merge rate (docs/cost-model.md, Compute). True for tables meshplan calibrate times on the "
        "executor; the published GPU tables price frameworks whose kernels read their inputs in place")
    merge_hbm_fraction: Annotated[float, Field(gt=0, le=1)] = Field(
        0.8, description="merges and accumulations run at this fraction of the memory bandwidth")
    merge_dtype: dict[Literal["bf16", "fp16", "fp32"], Annotated[float, Field(gt=0)]] | None = Field(
        None, description="a block's LSE merge into its output (combine: merge) takes this many times its bytes / "
        "merge rate when O is in that dtype (none given: 1): the executor merges in fp32, so a bf16 O is converted "
        "both ways; on one AVX512-BF16 CPU 3-7x at 1-2K rows")
    head_dims: list[PositiveInt] | None = Field(
        None, description="head dims of head_dim_fwd / head_dim_bwd, ascending (none: the tables hold for any D)")
    head_dim_fwd: list[Annotated[float, Field(gt=0)]] | None = Field(
        None, description="forward efficiency multiplier at each of head_dims (1 at the dim the tables were timed at)")
    head_dim_bwd: list[Annotated[float, Field(gt=0)]] | None = Field(
        None, description="backward efficiency multiplier at each of head_dims")
    dtype_tokens: list[PositiveInt] | None = Field(
        None, description="kernel sizes (s × s) of dtype_fwd / dtype_bwd, ascending")
    dtype_head_dims: list[PositiveInt] | None = Field(
        None, description="head dims of the rows of dtype_fwd / dtype_bwd, ascending (linear in log2 D between, "
        "the edge row outside; none: one row for any head dim)")
    dtype_fwd: dict[Literal["bf16", "fp16", "fp32"], list[list[Annotated[float, Field(gt=0)]]]] | None = Field(
        None, description="per dtype other than the tables', the forward efficiency multiplier at each of "
        "dtype_head_dims (one row each) and dtype_tokens (at √(s_q·s_kv), linear in log2 between, the edge value "
        "outside), relative to that dtype's peak: its measured speed over the tables' dtype at that head dim and "
        "size divided by the peaks' ratio (a CPU's bf16 kernels are not uniformly faster than fp32: slower on "
        "small blocks, faster on large backward ones, and where the crossover lies depends on the head dim)")
    dtype_bwd: dict[Literal["bf16", "fp16", "fp32"], list[list[Annotated[float, Field(gt=0)]]]] | None = Field(
        None, description="per dtype, the backward efficiency multiplier at each of dtype_head_dims and dtype_tokens")

    def _dtype_shapes(self) -> None:
        sizes, tables = self.dtype_tokens, (self.dtype_fwd, self.dtype_bwd)
        if (sizes is None) != (tables[0] is None) or (sizes is None) != (tables[1] is None):
            raise ValueError("give dtype_tokens, dtype_fwd and dtype_bwd together")
        if sizes is None:
            if self.dtype_head_dims is not None:
                raise ValueError("dtype_head_dims needs dtype_tokens, dtype_fwd and dtype_bwd")
            return
        dims = self.dtype_head_dims or [None]
        for name, axis in (("dtype_tokens", sizes), ("dtype_head_dims", self.dtype_head_dims or [])):
            if any(b <= a for a, b in zip(axis, axis[1:])):
                raise ValueError(f"{name} must be ascending")
        if any(len(rows) != len(dims) or any(len(r) != len(sizes) for r in rows)
               for t in tables for rows in t.values()):
            raise ValueError(f"dtype_fwd and dtype_bwd need {len(dims)} row(s) per dtype (one per dtype_head_dims) "
                             f"of {len(sizes)} values (one per dtype_tokens)")

    @model_validator(mode="after")
    def _shapes(self) -> KernelTableSpec:
        n = len(self.tokens)
        if n < 2 or any(b <= a for a, b in zip(self.tokens, self.tokens[1:])):
            raise ValueError("tokens must hold at least two ascending sizes")
        for name in ("fwd", "bwd"):
            table = getattr(self, name)
            if table is not None and (len(table) != n or any(len(r) != n for r in table)):
                raise ValueError(f"{name} must be a {n} x {n} table (tokens x tokens)")
        if (self.bwd is None) == (self.bwd_factor is None):
            raise ValueError("give exactly one of bwd (a table) or bwd_factor")
        if self.elementwise is not None and len(self.elementwise) != n:
            raise ValueError(f"elementwise needs {n} values (one per tokens entry)")
        self._dtype_shapes()
        dims = self.head_dims
        given = [x is not None for x in (dims, self.head_dim_fwd, self.head_dim_bwd)]
        if any(given) and not all(given):
            raise ValueError("give head_dims, head_dim_fwd and head_dim_bwd together")
        if dims is not None:
            if any(b <= a for a, b in zip(dims, dims[1:])):
                raise ValueError("head_dims must be ascending")
            if len(self.head_dim_fwd) != len(dims) or len(self.head_dim_bwd) != len(dims):
                raise ValueError(f"head_dim_fwd and head_dim_bwd need {len(dims)} values (one per head dim)")
        return self


class KernelTable:
    """Vectorised efficiency lookup for one kernel family on one device."""

    def __init__(self, spec: KernelTableSpec) -> None:
        self.spec = spec
        self.launch_s = spec.launch_us * 1e-6
        self._log_tokens = np.log2(np.asarray(spec.tokens, dtype=np.float64))
        fwd = np.asarray(spec.fwd, dtype=np.float64)
        bwd = fwd * spec.bwd_factor if spec.bwd is None else np.asarray(spec.bwd, dtype=np.float64)
        self._tables = {"fwd": fwd, "bwd": bwd}
        self._symmetric = {k: bool(np.array_equal(t, t.T)) for k, t in self._tables.items()}
        # monotone envelopes (the best efficiency at this size or any smaller one), for lower bounds: measured
        # tables dip at some sizes (a CPU's caches), so the largest shape an op can have is not the fastest
        self._envelopes = {k: np.maximum.accumulate(np.maximum.accumulate(t, axis=0), axis=1)
                           for k, t in self._tables.items()}
        self._masked_envelope = None if spec.elementwise is None else \
            np.maximum.accumulate(np.asarray(spec.elementwise, dtype=np.float64))

    def efficiency(self, s_q, s_kv, pass_: str, elementwise, head_dim: int | None = None,
                   envelope: bool = False, dtype: str | None = None) -> np.ndarray:
        """Efficiency for kernels of shape (s_q, s_kv) tokens (arrays broadcast) and head dim ``head_dim``.

        ``e = table(s_q, s_kv) · f(D)``, f the table's head-dim multiplier, linear in log2 D between its dims and
        the edge value outside (1 without one: the tables then hold for any D). A symmetric table gives
        bit-identical results for (a, b) and (b, a), which the simulator's symmetry reduction relies on.
        ``envelope``: the largest efficiency at (s_q, s_kv) or any smaller shape (monotone in both sizes), so
        a bound taken at the largest shape a kernel can have holds for every smaller one. ``dtype``: times the
        table's multiplier for that dtype by head dim and size (:meth:`dtype_factor`; 1 for the tables' own dtype).
        """
        s_q = np.asarray(s_q, dtype=np.float64)
        s_kv = np.asarray(s_kv, dtype=np.float64)
        if self._symmetric[pass_]:
            s_q, s_kv = np.minimum(s_q, s_kv), np.maximum(s_q, s_kv)
        tables = self._envelopes if envelope else self._tables
        e = self._bilinear(tables[pass_], s_q, s_kv) * self.head_dim_factor(head_dim, pass_)
        e = e * self.dtype_factor(dtype, pass_, s_q, s_kv, envelope, head_dim)
        return np.where(np.asarray(elementwise, dtype=bool), e * self._masked(s_q, s_kv, envelope), e)

    def dtype_factor(self, dtype: str | None, pass_: str, s_q, s_kv, envelope: bool = False,
                     head_dim: int | None = None):
        """The efficiency multiplier of ``dtype`` kernels at (s_q, s_kv) and ``head_dim``: linear in log2 of the
        head dim between rows and in log2 √(s_q·s_kv) along them, edges held (1 for a dtype without one; the
        first row without a head dim); with ``envelope`` each row's largest at that size or any smaller one."""
        spec = self.spec
        table = (spec.dtype_fwd if pass_ == "fwd" else spec.dtype_bwd) or {}
        if dtype not in table:
            return 1.0
        rows = np.asarray(table[dtype], dtype=np.float64)
        if envelope:
            rows = np.maximum.accumulate(rows, axis=1)
        row = rows[0]
        if len(rows) > 1 and head_dim is not None:      # the row at this head dim, then by size
            dims = np.log2(np.asarray(spec.dtype_head_dims, dtype=np.float64))
            row = np.array([np.interp(np.log2(head_dim), dims, col) for col in rows.T])
        size = 0.5 * (np.log2(np.maximum(s_q, 1.0)) + np.log2(np.maximum(s_kv, 1.0)))
        return np.interp(size, np.log2(spec.dtype_tokens), row)

    def _masked(self, s_q: np.ndarray, s_kv: np.ndarray, envelope: bool = False):
        """The elementwise multiplier at kernels of (s_q, s_kv) tokens (symmetric: by √(s_q·s_kv))."""
        if self.spec.elementwise is None:
            return self.spec.elementwise_factor
        size = 0.5 * (np.log2(np.maximum(s_q, 1.0)) + np.log2(np.maximum(s_kv, 1.0)))
        return np.interp(size, self._log_tokens, self._masked_envelope if envelope else self.spec.elementwise)

    def tile(self, pass_: str) -> tuple[int, int]:
        """(query rows, keys) of the kernel's tile in ``pass_`` (what a document segment is rounded up to)."""
        return tuple(self.spec.tile_fwd if pass_ == "fwd" else self.spec.tile_bwd)

    def bwd_delta(self, dtype: str | None) -> float:
        """How many times longer a backward block carrying D instead of O takes in ``dtype``
        (``bwd_delta_dtype``, else ``bwd_delta_factor``)."""
        return (self.spec.bwd_delta_dtype or {}).get(dtype, self.spec.bwd_delta_factor)

    def merge_factor(self, dtype: str | None) -> float:
        """How many times its bytes / merge rate a block's LSE merge into an output in ``dtype`` takes
        (``merge_dtype``, else 1)."""
        return (self.spec.merge_dtype or {}).get(dtype, 1.0)

    def head_dim_factor(self, head_dim: int | None, pass_: str) -> float:
        """The efficiency multiplier at ``head_dim`` (1 without head-dim data or without a head dim)."""
        spec = self.spec
        if head_dim is None or spec.head_dims is None:
            return 1.0
        values = spec.head_dim_fwd if pass_ == "fwd" else spec.head_dim_bwd
        return float(np.interp(np.log2(head_dim), np.log2(spec.head_dims), values))

    def _bilinear(self, table: np.ndarray, s_q: np.ndarray, s_kv: np.ndarray) -> np.ndarray:
        lt = self._log_tokens
        iq, wq, sq_scale = self._axis(np.log2(np.maximum(s_q, 1.0)), lt)
        ik, wk, sk_scale = self._axis(np.log2(np.maximum(s_kv, 1.0)), lt)
        e = ((1 - wq) * (1 - wk) * table[iq, ik] + wq * (1 - wk) * table[iq + 1, ik]
             + (1 - wq) * wk * table[iq, ik + 1] + wq * wk * table[iq + 1, ik + 1])
        return e * sq_scale * sk_scale

    @staticmethod
    def _axis(x: np.ndarray, grid: np.ndarray):
        xc = np.clip(x, grid[0], grid[-1])
        i = np.clip(np.searchsorted(grid, xc, side="right") - 1, 0, len(grid) - 2)
        w = (xc - grid[i]) / (grid[i + 1] - grid[i])
        below = np.where(x < grid[0], np.exp2(x - grid[0]), 1.0)  # linear fall-off below the grid
        return i, w, below


@functools.cache
def load_kernel_table(name_or_path: str, base_dir: str | None = None) -> KernelTable:
    """Load a kernel table by shipped name (``fa2-hopper``) or by path (relative to ``base_dir``).

    Raises:
        UserError: no such table, or the file does not validate.
    """
    import yaml
    from pydantic import ValidationError

    from meshplan.core.errors import UserError

    path = Path(name_or_path)
    if base_dir and not path.is_absolute():
        path = Path(base_dir) / path
    if path.suffix in (".yaml", ".yml") and path.exists():
        text = path.read_text()
    else:
        shipped = resources.files("meshplan").joinpath(f"topologies/kernels/{name_or_path}.yaml")
        if not shipped.is_file():
            names = sorted(p.name[:-5] for p in resources.files("meshplan").joinpath("topologies/kernels").iterdir()
                           if p.name.endswith(".yaml"))
            raise UserError("node.device.kernel", f"no kernel table {name_or_path!r}",
                            f"use one of {', '.join(names)} or a path to a .yaml file")
        text = shipped.read_text()
    try:
        return KernelTable(KernelTableSpec.model_validate(yaml.safe_load(text)))
    except ValidationError as err:
        first = err.errors()[0]
        loc = ".".join(str(p) for p in first["loc"])
        raise UserError(f"kernel table {name_or_path}: {loc}", first["msg"]) from None
