"""What the plots show, computed without matplotlib (so it can be tested against known answers).

* :func:`timeline_data`: per (rank, stream) row the ops' kinds and start/end (s) of the simulated schedule and,
  given a measurement of it, of the measured run (bwd ops shifted by the fwd makespan, as the simulator does).
* :func:`assignment_grid`: the [Nq, Nkv] rank computing each block (−1: the mask skips it).
* :func:`read_pairs` and :func:`mape_pct`: predicted-vs-measured rows from JSON or CSV.
* :func:`scaling_data`: predicted makespan and bytes received per GPU against the GPU count, per algorithm.
"""

from __future__ import annotations

import csv
import hashlib
import json
import re
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, PositiveFloat, ValidationError

from meshplan.core.errors import SkipCandidate, UserError
from meshplan.plan.schedule import COMPUTE, OP_KINDS, Schedule, expand_blocks

MAX_DEFAULT_RANKS = 16
SHARED = -2     # assignment_grid: several ranks compute the block (should not happen in a verified schedule)


# ---------------------------------------------------------------------------------------------------- timeline
@dataclass(frozen=True)
class Panel:
    """One side of a timeline: ops of the selected ranks with their row, kind and times (s)."""

    label: str
    makespan_s: float
    row: np.ndarray
    kind: np.ndarray          # index into OP_KINDS
    start_s: np.ndarray
    end_s: np.ndarray
    pass_start_s: list[float] = field(default_factory=list)   # start of each later pass (a barrier)


@dataclass(frozen=True)
class TimelineData:
    """Rows (rank, stream name), one panel per timeline, and what the title says."""

    rows: list[tuple[int, str]]
    panels: list[Panel]
    title: str


def parse_ranks(text: str | None, n_ranks: int) -> tuple[list[int], bool]:
    """``0-7``, ``0,3,5-6`` -> sorted ranks; None: the first 16. Returns (ranks, truncated)."""
    if text is None:
        return list(range(min(n_ranks, MAX_DEFAULT_RANKS))), n_ranks > MAX_DEFAULT_RANKS
    ranks: set[int] = set()
    for part in text.split(","):
        m = re.fullmatch(r"\s*(\d+)\s*(?:-\s*(\d+)\s*)?", part)
        if not m:
            raise UserError("--ranks", f"cannot read {text!r}", "write e.g. 0-7 or 0,2,4-5")
        lo, hi = int(m.group(1)), int(m.group(2) or m.group(1))
        if lo > hi or hi >= n_ranks:
            raise UserError("--ranks", f"{part.strip()!r} is outside ranks 0-{n_ranks - 1}",
                            "pick ranks of the schedule")
        ranks.update(range(lo, hi + 1))
    return sorted(ranks), len(ranks) < n_ranks


def both_timelines(schedule_path: str, measurement_path: str | None = None, topo: str | None = None):
    """``(schedule, topology, simulation, measured (start_s, end_s) or None, measurement or None)`` of a file.

    Raises:
        UserError: unreadable files, a measurement of another schedule, or op ids the schedule lacks.
    """
    from meshplan.cost.simulate import simulate
    from meshplan.model.topology import Topology
    from meshplan.plan.json.io import from_json, no_gc, read_document

    doc, raw = read_document(schedule_path)
    meas = _matching_measurement(measurement_path, raw, schedule_path) if measurement_path else None
    with no_gc():
        sched = from_json(doc)
    topo_obj = Topology.load(topo or sched.topology["name"], sched.topology.get("devices"))
    sim = simulate(sched, topo_obj)
    measured = None
    if meas is not None:
        measured = measured_times(sched, [op.id for r in doc.ranks for op in r.ops], meas, measurement_path)
    return sched, topo_obj, sim, measured, meas


def timeline_data(schedule_path: str, measurement_path: str | None = None, topo: str | None = None,
                  ranks: str | None = None) -> TimelineData:
    """The predicted (and measured) timelines of a schedule file, limited to ``ranks``.

    Raises:
        UserError: unreadable files, a measurement of another schedule, or op ids the schedule lacks.
    """
    sched, topo_obj, sim, measured, meas = both_timelines(schedule_path, measurement_path, topo)
    chosen, truncated = parse_ranks(ranks, sched.n_ranks)
    rows, row_of = _rows(sched, chosen)
    later = [sim.pass_offset[p] for p in sched.passes[1:]]
    panels = [_panel("predicted", sched, row_of, sim.start, sim.end, float(sum(sim.pass_makespan.values())), later)]
    if meas is not None:
        shift = [meas.passes["fwd"].makespan_s] if len(sched.passes) > 1 and "fwd" in meas.passes else []
        panels.append(_panel("measured", sched, row_of, *measured, meas.makespan_s, shift))
    shown = f"ranks {_ranges(chosen)} of {sched.n_ranks}" if truncated else f"{sched.n_ranks} ranks"
    title = f"{sched.algorithm} on {topo_obj.name}, {shown}\n{sched.workload.describe()}"
    return TimelineData(rows, panels, title)


def _matching_measurement(path: str, schedule_raw: bytes, schedule_path: str):
    from meshplan.truth.compare import read_measurement
    meas = read_measurement(path)
    if meas.schedule != hashlib.sha256(schedule_raw).hexdigest():
        raise UserError(Path(path).name, "was measured on another schedule (sha256 differs)",
                        f"run `meshplan run {schedule_path} --out ...` and plot that file")
    return meas


def measured_times(sched: Schedule, ids: list[int], meas, path: str = "measurement") -> tuple[np.ndarray, np.ndarray]:
    """Measured start/end (s) of every in-memory op (NaN: not measured); bwd shifted by the fwd makespan."""
    index = {op_id: i for i, op_id in enumerate(ids)}
    start, end = np.full(len(ids), np.nan), np.full(len(ids), np.nan)
    for r in meas.ranks:
        for op in r.ops:
            i = index.get(op.id)
            if i is None or int(sched.ops.rank[i]) != r.rank:
                raise UserError(f"{Path(path).name}: rank {r.rank} op {op.id}", "is not an op of that rank in the "
                                "schedule", "give the measurement `meshplan run` wrote for this schedule")
            start[i], end[i] = op.start_s, op.end_s
    if "fwd" in meas.passes:
        bwd = sched.ops.phase == 1
        start[bwd] += meas.passes["fwd"].makespan_s
        end[bwd] += meas.passes["fwd"].makespan_s
    return start, end


def _rows(sched: Schedule, ranks: list[int]) -> tuple[list[tuple[int, str]], np.ndarray]:
    """Rows (rank, stream) that hold ops, and the row of every op (−1: not shown)."""
    o, n_streams = sched.ops, len(sched.streams.names)
    used = np.zeros((sched.n_ranks, n_streams), dtype=bool)
    timed = o.kind < OP_KINDS.index("alloc")
    used[o.rank[timed], o.stream[timed]] = True
    table = np.full((sched.n_ranks, n_streams), -1)
    rows = []
    for r in ranks:
        for s in np.flatnonzero(used[r]).tolist():
            table[r, s] = len(rows)
            rows.append((r, sched.streams.names[s]))
    row_of = np.where(timed, table[o.rank, o.stream], -1)
    return rows, row_of


def _panel(label, sched, row_of, start, end, makespan_s, later) -> Panel:
    sel = (row_of >= 0) & np.isfinite(start) & np.isfinite(end)
    return Panel(label, makespan_s, row_of[sel], sched.ops.kind[sel], start[sel], end[sel], later)


def _ranges(ranks: list[int]) -> str:
    """[0, 1, 2, 5] -> '0-2, 5'."""
    out, i = [], 0
    while i < len(ranks):
        j = i
        while j + 1 < len(ranks) and ranks[j + 1] == ranks[j] + 1:
            j += 1
        out.append(str(ranks[i]) if i == j else f"{ranks[i]}-{ranks[j]}")
        i = j + 1
    return ", ".join(out)


# ---------------------------------------------------------------------------------------------------- matrix
def assignment_grid(sched: Schedule) -> np.ndarray:
    """[Nq, Nkv] rank computing each block in the first pass, for the head range holding head 0.

    −1 where the mask permits no pair (no rank computes it); :data:`SHARED` where several ranks do.
    """
    from meshplan.model.matrix import attn_matrix
    o, n = sched.ops, sched.n_chunks
    ops = np.flatnonzero((o.kind == COMPUTE) & (o.phase == sched.passes[0]) & (o.h0 <= 0) & (o.h1 > 0))
    op_of, qi, kj = expand_blocks(o, ops)
    owner = np.full((n, n), -1, dtype=np.int64)
    owner[qi, kj] = o.rank[op_of]
    clash = np.zeros((n, n), dtype=bool)
    clash[qi, kj] = owner[qi, kj] != o.rank[op_of]
    owner[clash] = SHARED
    owner[~attn_matrix(sched.workload, n).permitted] = -1
    return owner


def tile_shape(knobs: dict) -> tuple[int, int] | None:
    """(a, b) of a ``tile`` knob ``AxB`` (a query chunks x b KV chunks per rank), or None."""
    m = re.fullmatch(r"\s*(\d+)\s*x\s*(\d+)\s*", str(knobs.get("tile", "")), flags=re.IGNORECASE)
    return (int(m.group(1)), int(m.group(2))) if m else None


def heads_split(sched: Schedule) -> bool:
    """Whether compute ops cover fewer than all query heads (Ulysses-style head split)."""
    o = sched.ops
    comp = o.kind == COMPUTE
    return bool(comp.any() and ((o.h1 - o.h0)[comp] < sched.workload.n_heads).any())


# ---------------------------------------------------------------------------------------------------- scatter
class ScatterRow(BaseModel):
    """One predicted-vs-measured point."""

    model_config = ConfigDict(extra="forbid")
    label: str = Field(description="what was run (shown beside the point)")
    algorithm: str = Field(description="algorithm name (the point's colour)")
    predicted_s: PositiveFloat = Field(description="predicted time, seconds")
    measured_s: PositiveFloat = Field(description="measured time, seconds")


class ScatterFile(BaseModel):
    """A pairs file: ``{"rows": [...]}`` (a bare list of rows is accepted too)."""

    model_config = ConfigDict(extra="forbid")
    rows: list[ScatterRow] = Field(min_length=1, description="the points")


def read_pairs(path: str | Path) -> list[ScatterRow]:
    """Rows of a JSON (list or ``{"rows": [...]}``) or CSV file (columns label, algorithm, predicted_s, measured_s).

    Raises:
        UserError: unreadable file, or the first missing or bad field (``row 3: measured_s: Field required``).
    """
    path = Path(path)
    fix = "each row needs label, algorithm, predicted_s and measured_s (seconds > 0)"
    try:
        text = path.read_text()
        if path.suffix.lower() == ".csv":
            data = {"rows": [{k: v for k, v in row.items() if v not in (None, "")}
                             for row in csv.DictReader(text.splitlines())]}
        else:
            loaded = json.loads(text)
            data = {"rows": loaded} if isinstance(loaded, list) else loaded
    except (OSError, ValueError, csv.Error) as err:
        raise UserError(str(path), f"cannot read the pairs file ({type(err).__name__})", fix) from None
    try:
        return ScatterFile.model_validate(data).rows
    except ValidationError as err:
        first = err.errors(include_url=False)[0]
        loc = list(first["loc"])
        where = f"row {loc[1]}: " + ".".join(map(str, loc[2:])) if loc[:1] == ["rows"] and len(loc) > 2 else \
            ".".join(map(str, loc)) or "rows"
        raise UserError(f"{path.name}: {where}", first["msg"], fix) from None


def mape_pct(rows: list[ScatterRow]) -> float:
    """Mean absolute percentage error, 100 · mean(|predicted − measured| / measured)."""
    p = np.array([r.predicted_s for r in rows])
    m = np.array([r.measured_s for r in rows])
    return float(100.0 * np.mean(np.abs(p - m) / m))


# ---------------------------------------------------------------------------------------------------- scaling
@dataclass
class ScalingData:
    """Per algorithm the GPU counts it ran at, its makespans (s) and max bytes received per GPU."""

    gpus: dict[str, list[int]] = field(default_factory=dict)
    makespan_s: dict[str, list[float]] = field(default_factory=dict)
    recv_bytes: dict[str, list[float]] = field(default_factory=dict)
    skipped: list[str] = field(default_factory=list)               # why, one line each
    skipped_at: dict[str, list[int]] = field(default_factory=dict)  # per algorithm, the GPU counts skipped


def parse_list(text: str, flag: str) -> list[str]:
    """``a,b,c`` -> ['a', 'b', 'c'] (refuses an empty list)."""
    items = [x.strip() for x in text.split(",") if x.strip()]
    if not items:
        raise UserError(flag, f"cannot read {text!r}", "give a comma-separated list")
    return items


def scaling_data(topo: str, gpus: list[int], algos: list[str], workload) -> ScalingData:
    """Simulate every algorithm at every GPU count; a combination it cannot run is skipped and noted.

    Raises:
        UserError: an unknown algorithm, or a GPU count the topology refuses.
    """
    from meshplan import algorithms
    from meshplan.model.topology import Topology
    from meshplan.search.candidate import make_candidate, simulate_candidate

    for name in algos:
        if name not in algorithms.NAMES:
            raise UserError("--algos", f"unknown algorithm {name!r}", f"use some of {', '.join(algorithms.NAMES)}")
    topos = {n: Topology.load(topo, n) for n in gpus}
    out = ScalingData()
    for name in algos:
        for n in gpus:
            try:
                cand = simulate_candidate(make_candidate(name, workload, topos[n], n, {}), topos[n], None)
            except (SkipCandidate, UserError) as err:
                out.skipped.append(f"{name} at {n} GPUs: {err}")
                out.skipped_at.setdefault(name, []).append(n)
                continue
            out.gpus.setdefault(name, []).append(n)
            out.makespan_s.setdefault(name, []).append(float(cand.predicted.makespan_s))
            out.recv_bytes.setdefault(name, []).append(float(cand.predicted.total.comm_bytes_per_gpu_max))
    return out
