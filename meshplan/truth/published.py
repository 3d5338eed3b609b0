"""Published measurements to predict: the CHARM+ paper's tables (arXiv 2611.05906, NeurIPS 2026).

Copies ship in ``meshplan/data/`` with their source on the first line (``# source: …``); a user may pass
another file with the same columns. Every row is validated (pydantic); a missing column or a bad value is
refused with one line naming it.

``charm_plus_h100_2x8.csv``: 16 H100 (2 nodes × 8), 12 heads × 192 head dim, MHA, bf16, full attention,
forward and backward rows. ``T_comm_ring_ms`` / ``T_comp_ring_ms`` are Ring's per-step communication and
computation times summed over the steps, measured during the overlapped run (micro-level, noisy);
``ring_ms``, ``charm_ms``, ``tasp_ms`` are end-to-end times (what we predict).
"""

from __future__ import annotations

import csv
import io
from importlib import resources
from pathlib import Path
from typing import Literal, Optional

from pydantic import BaseModel, ConfigDict, Field, PositiveInt, ValidationError, field_validator

from meshplan.core.errors import UserError

# The CHARM+ H100 experiments' attention shape (docs/published-data.md).
CHARM_HEADS, CHARM_HEAD_DIM, CHARM_ELEM_BYTES = 12, 192, 2


class _Row(BaseModel):
    model_config = ConfigDict(extra="ignore", frozen=True)

    @field_validator("*", mode="before")
    @classmethod
    def _empty_is_none(cls, v):
        return None if v == "" else v


class H100Row(_Row):
    """One row of ``charm_plus_h100_2x8.csv`` (times in ms)."""

    gpus: PositiveInt
    pass_: Literal["forward", "backward"] = Field(alias="pass")
    B: PositiveInt
    S: PositiveInt
    S_per_gpu: PositiveInt
    T_comm_ring_ms: float = Field(gt=0, description="Ring's per-step transfer times summed (micro, noisy)")
    T_comp_ring_ms: float = Field(gt=0, description="Ring's per-step compute times summed (micro, noisy)")
    ring_ms: float = Field(gt=0)
    tasp_ms: Optional[float] = Field(None, gt=0)
    charm_ms: float = Field(gt=0)

    @property
    def pass_name(self) -> str:
        """``fwd`` or ``bwd``."""
        return "fwd" if self.pass_ == "forward" else "bwd"

    @property
    def label(self) -> str:
        """Short row label, e.g. ``fwd B=16 S=26880``."""
        return f"{self.pass_name} B={self.B} S={self.S}"

    def measured_ms(self, method: str) -> float | None:
        """The published end-to-end time of ``ring``, ``charm`` or ``tasp`` (None where not measured)."""
        return getattr(self, f"{method}_ms")


class AblationRow(_Row):
    """One row of ``charm_plus_ablation_fwd.csv`` (forward times in ms)."""

    gpus: PositiveInt
    topology: str
    cross_hardware: Literal["no", "numa", "node"]
    S: PositiveInt
    ring_ms: float = Field(gt=0)
    rmplus_ms: float = Field(gt=0)
    charm_ms: Optional[float] = Field(None, gt=0)


class MemoryRow(_Row):
    """One row of ``charm_plus_memory_l20x8.csv``: peak memory of forward+backward on 8 L20, MB (MHA)."""

    B: PositiveInt
    S: PositiveInt
    heads: PositiveInt
    ring_MB: float = Field(gt=0)
    charm_MB: float = Field(gt=0)


TABLES = {"charm-h100": ("charm_plus_h100_2x8.csv", H100Row), "charm-ablation": ("charm_plus_ablation_fwd.csv",
                                                                                   AblationRow),
          "charm-memory": ("charm_plus_memory_l20x8.csv", MemoryRow)}


def load_rows(table: str, path: str | Path | None = None) -> list:
    """Rows of a published table: the shipped copy, or ``path`` with the same columns.

    Raises:
        UserError: unknown table, unreadable file, a missing column or an invalid value (one line).
    """
    if table not in TABLES:
        raise UserError("TABLE", f"unknown table {table!r}", f"use one of {', '.join(TABLES)}")
    name, model = TABLES[table]
    if path is None:
        text, where = resources.files("meshplan").joinpath(f"data/{name}").read_text(), name
    else:
        try:
            text, where = Path(path).read_text(), Path(path).name
        except OSError as err:
            raise UserError("--data", f"cannot read {path}: {err.strerror}", "give a CSV file") from None
    lines = [ln for ln in text.splitlines() if ln.strip() and not ln.startswith("#")]
    reader = csv.DictReader(io.StringIO("\n".join(lines)))
    need = [f.alias or k for k, f in model.model_fields.items()]
    missing = [c for c in need if c not in (reader.fieldnames or [])]
    if missing:
        raise UserError(f"--data {where}", f"missing column {missing[0]!r}", f"the columns are {', '.join(need)}")
    rows = []
    for i, raw in enumerate(reader, start=2):
        try:
            rows.append(model.model_validate(raw))
        except ValidationError as err:
            first = err.errors()[0]
            raise UserError(f"--data {where} line {i}", f"{first['loc'][0]}: {first['msg']}",
                            "fix the value") from None
    if not rows:
        raise UserError(f"--data {where}", "no rows", "give a table with at least one row")
    return rows


def kv_step_bytes(row: H100Row) -> float:
    """Bytes Ring moves per step and rank in this row: K and V of one chunk (bf16); in backward also their
    gradients, which the CHARM+ baseline sends in fp32 (2 × the bytes of K and V).
    """
    kv = row.B * row.S_per_gpu * 2 * CHARM_HEADS * CHARM_HEAD_DIM * CHARM_ELEM_BYTES
    return kv if row.pass_name == "fwd" else 3 * kv


def ring_block_flops(row: H100Row) -> float:
    """FLOPs of one Ring step's block: 4·B·H·s²·D forward, × 2.5 backward (docs/cost-model.md)."""
    f = 4.0 * row.B * CHARM_HEADS * row.S_per_gpu ** 2 * CHARM_HEAD_DIM
    return f if row.pass_name == "fwd" else 2.5 * f
