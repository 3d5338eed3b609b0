"""Predicted against measured: per op kind, per P2P step, end to end, and peak memory (``meshplan compare``).

The prediction is the event simulation of the schedule on the topology it was planned for (or ``--topo``);
the measurement a :mod:`meshplan.plan.json.measurement` file of the same schedule (checked by its sha256). Errors are
``(predicted − measured) / measured`` in percent. Op kinds compare summed durations over all ranks (a
transfer: posted to completed); steps compare the time the last transfer of each batched-P2P step ends;
end to end compares each pass's makespan. A CPU (gloo) run is comparable with ``cpu-local`` predictions
only, a GPU (nccl) run with GPU topologies only; otherwise the table is printed with that warning. A
measurement that implies more than the hardware can do is listed in ``implausible`` (:mod:`meshplan.truth.plausible`).
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import numpy as np

from meshplan.core.errors import UserError
from meshplan.plan.json.measurement import MeasurementJSON
from meshplan.plan.schedule import OP_KINDS, PASS_NAMES
from meshplan.truth.plausible import ceilings, implausible

KIND_GROUPS = {"compute": "compute", "send": "transfer", "recv": "transfer", "merge": "merge",
               "accumulate": "accumulate", "collective": "collective"}


def read_measurement(path: str | Path) -> MeasurementJSON:
    """Read and validate a Measurement JSON. Raises UserError naming the first bad field."""
    import re

    from pydantic import ValidationError
    try:
        raw = Path(path).read_bytes()
    except OSError as err:
        raise UserError(str(path), f"cannot read the measurement ({type(err).__name__})",
                        "give the file `meshplan run --out` wrote") from None
    if raw[:2] == b"\x1f\x8b" or re.match(rb'\s*\{\s*"schema_version"', raw):
        raise UserError(Path(path).name, "is a schedule, not a measurement",
                        "give the file `meshplan run --out` wrote; compare takes the schedule first: "
                        "meshplan compare SCHEDULE MEASUREMENT")
    try:
        return MeasurementJSON.model_validate_json(raw)
    except ValidationError as err:
        first = err.errors(include_url=False)[0]
        if first["type"] == "json_invalid":
            raise UserError(Path(path).name, f"is not valid JSON ({first['msg'].removeprefix('Invalid JSON: ')})",
                            "the file is cut short or corrupted: measure again (meshplan run --out)") from None
        loc = ".".join(str(p) for p in first["loc"])
        raise UserError(f"{Path(path).name}: {loc}" if loc else Path(path).name, first["msg"],
                        "give the file `meshplan run --out` wrote") from None


def compare_files(schedule_path: str, measurement_path: str, topo: str | None = None) -> dict[str, Any]:
    """Compare a schedule's prediction with a measurement of it (see the module docstring)."""
    from meshplan.plan.json.io import from_json, no_gc, read_document

    doc, raw = read_document(schedule_path)
    meas = read_measurement(measurement_path)
    if meas.schedule != hashlib.sha256(raw).hexdigest():
        raise UserError(Path(measurement_path).name, "was measured on another schedule (sha256 differs)",
                        f"run `meshplan run {schedule_path} --out ...` and compare that file")
    with no_gc():
        sched = from_json(doc)
    ids = [op.id for r in doc.ranks for op in r.ops]
    return compare(sched, ids, meas, topo)


def compare(sched, ids: list[int], meas: MeasurementJSON, topo: str | None = None) -> dict[str, Any]:
    """The comparison body; ``ids[i]`` is the file's id of in-memory op i."""
    from meshplan.cost.cost import CostModel
    from meshplan.cost.metrics import pass_metrics
    from meshplan.cost.simulate import simulate
    from meshplan.model.topology import Topology
    from meshplan.truth.contention import contention

    topo_obj = Topology.load(topo or sched.topology["name"], sched.topology.get("devices"))
    sim = simulate(sched, topo_obj)
    offset = np.array([sim.pass_offset.get(int(p), 0.0) for p in sched.ops.phase])
    p_start, p_end = sim.start - offset, sim.end - offset
    index = {op_id: i for i, op_id in enumerate(ids)}
    m_start, m_end = np.full(len(ids), np.nan), np.full(len(ids), np.nan)
    for r in meas.ranks:
        for op in r.ops:
            if op.id in index:
                m_start[index[op.id]], m_end[index[op.id]] = op.start_s, op.end_s
    metrics = [pass_metrics(sched, topo_obj, sim, p) for p in sched.passes]
    peak_pred = max(m.peak_memory_bytes for m in metrics)
    total_pred = max(m.peak_memory_total_bytes for m in metrics)
    speed = host_speed(topo_obj, meas)
    gpu_run = meas.env.get("backend") == "nccl"
    comparable = gpu_run == (topo_obj.name != "cpu-local")
    other_host = host_match(topo_obj, meas)
    ceiling = ceilings(topo_obj, meas, sched.workload.dtype, bool(other_host), speed["ratio"] if speed else None)
    return {
        "schedule": meas.schedule, "topology": topo_obj.name, "backend": meas.env.get("backend"),
        "comparable": comparable,
        "note": "; ".join(x for x in (
            "" if comparable else (f"planned for {topo_obj.name} but run with {meas.env.get('backend')}: "
                                   "errors say nothing about the model"),
            other_host) if x),
        "implausible": implausible(sched, topo_obj, meas, ceiling),
        "host_speed": speed,
        "end_to_end": _end_to_end(sched, sim, meas, speed["ratio"] if speed else None),
        "per_kind": _per_kind(sched, p_start, p_end, m_start, m_end),
        "per_step": _per_step(sched, p_end, m_end),
        "executor_overhead": executor_overhead(sched, m_start, m_end),
        "stream_cpu_s": stream_cpu(meas),
        "contention": contention(sched, CostModel(topo_obj).op_durations(sched), p_start, p_end, m_start, m_end,
                                 meas),
        "peak_memory": _row({"predicted_bytes": float(peak_pred), "measured_bytes": float(meas.peak_memory_bytes)},
                            "predicted_bytes", "measured_bytes") | {"measured_kind": meas.peak_memory_kind},
        "memory_rise": _memory_rise(float(peak_pred), total_pred, topo_obj.memory_model.source, meas),
    }


def _memory_rise(peak_pred: float, total_pred: float, source: str, meas: MeasurementJSON) -> dict[str, Any] | None:
    """The memory model's peak (buffers + workspace + runtime, :mod:`meshplan.cost.memory`) against how far the
    ranks' memory rose during a pass (RSS from a trimmed heap on CPU, the CUDA allocator's peak on GPUs), with
    the buffers alone beside it (a lower bound). None for measurements without the rise."""
    rise = meas.peak_rise_bytes
    if rise is None:
        return None
    return {"predicted_bytes": total_pred, "measured_rise_bytes": float(rise),
            "error_pct": _err_pct(total_pred, float(rise)), "model": source,
            "predicted_buffers_bytes": peak_pred,
            "kind": "cuda-allocator" if meas.peak_memory_kind == "cuda-allocator" else "rss",
            "rise_over_buffers": float(rise) / peak_pred if peak_pred else None}


def _err_pct(pred: float, meas: float) -> float | None:
    return None if not meas or not np.isfinite(meas) else 100.0 * (pred - meas) / meas


def _row(d: dict, pred_key: str = "predicted_s", meas_key: str = "measured_s") -> dict:
    return d | {"error_pct": _err_pct(d[pred_key], d[meas_key])}


def host_speed(topo, meas: MeasurementJSON) -> dict | None:
    """The host-speed probe of the run against the calibration's (:mod:`meshplan.executor.probe`): ``ratio`` > 1
    means the host ran slower than when it was calibrated. None without both probes."""
    calib = getattr(topo, "calibration", None)
    now = meas.env.get("probe_ms")
    if calib is None or calib.host_probe_ms is None or not now:
        return None
    return {"probe_ms": float(now), "calibrated_probe_ms": calib.host_probe_ms,
            "ratio": float(now) / calib.host_probe_ms}


def stream_cpu(meas: MeasurementJSON) -> dict[str, float] | None:
    """Per stream, the median over ranks of the CPU seconds its thread used in one iteration
    (``RankTimes.stream_cpu_s``); None for measurements without it. Against the measured makespan it says whether
    a stream was busy or waiting for a core (CPU ranks sharing cores)."""
    got = [r.stream_cpu_s for r in meas.ranks if r.stream_cpu_s]
    if not got:
        return None
    return {s: float(np.median([g.get(s, 0.0) for g in got])) for s in sorted(set().union(*got))}


def host_match(topo, meas: MeasurementJSON) -> str:
    """'' when a CPU run's host is the one the topology's calibration was measured on (CPU name, vector unit and
    core count; or when either side does not record them), else one line naming both: another host's kernel rates
    (e.g. bf16 with and without native bf16 units, 20x apart) make the errors say little about the model."""
    calib = getattr(topo, "calibration", None)
    env = meas.env
    if calib is None or env.get("backend") != "gloo" or not env.get("cpu") or not calib.device.cpu:
        return ""
    here = (env.get("cpu"), env.get("isa"), env.get("cpu_count"))
    there = (calib.device.cpu, calib.device.isa, calib.device.cores)
    if here == there:
        return ""
    name = lambda h: f"{h[0]} ({h[1]}, {h[2]} cores)"  # noqa: E731
    return (f"the prediction uses a calibration measured on {name(there)}, this run's host is {name(here)}: "
            "run `meshplan calibrate --out FILE.yaml` on this host (named in the topology's calibration:) for a "
            "meaningful error")


def _end_to_end(sched, sim, meas: MeasurementJSON, ratio: float | None) -> dict:
    """Per pass and total: predicted, measured, error; with a host-speed ratio also the error of the prediction
    scaled by it (the drift of the host since calibration taken out)."""
    rows = {}
    for p in sched.passes:
        name = PASS_NAMES[p]
        if name in meas.passes:
            rows[name] = _row({"predicted_s": sim.pass_makespan[p], "measured_s": meas.passes[name].makespan_s})
    rows["total"] = _row({"predicted_s": float(sum(sim.pass_makespan.values())), "measured_s": meas.makespan_s})
    for r in rows.values():
        r["speed_adjusted_error_pct"] = None if ratio is None else _err_pct(r["predicted_s"] * ratio, r["measured_s"])
    return rows


def _per_kind(sched, p_start, p_end, m_start, m_end) -> list[dict]:
    o, rows = sched.ops, []
    groups = np.array([KIND_GROUPS.get(k, k) for k in OP_KINDS])[o.kind]
    for p in sched.passes:
        for g in ("compute", "transfer", "merge", "accumulate"):
            sel = (o.phase == p) & (groups == g) & np.isfinite(m_end)
            if g == "transfer":
                sel &= o.kind == OP_KINDS.index("recv")   # a transfer once (its recv: posted to landed)
            if sel.any():
                rows.append(_row({"pass": PASS_NAMES[p], "kind": g, "ops": int(sel.sum()),
                                  "predicted_s": float((p_end - p_start)[sel].sum()),
                                  "measured_s": float((m_end - m_start)[sel].sum())}))
    return rows


def _per_step(sched, p_end, m_end) -> list[dict]:
    o, rows = sched.ops, []
    comm = np.isin(o.kind, [OP_KINDS.index("send"), OP_KINDS.index("recv")]) & (o.step >= 0) & np.isfinite(m_end)
    for p in sched.passes:
        for s in np.unique(o.step[comm & (o.phase == p)]):
            sel = comm & (o.phase == p) & (o.step == s)
            rows.append(_row({"pass": PASS_NAMES[p], "step": int(s), "predicted_s": float(p_end[sel].max()),
                              "measured_s": float(m_end[sel].max())}))
    return rows


def transfer_spans(sched, start: np.ndarray, end: np.ndarray) -> np.ndarray:
    """Per op (seconds): for a recv, ``end − max(its post, its matching send's post)`` — how long the bytes took
    once both sides had posted, i.e. the measured transfer less the wait for a peer still computing (what a
    CCR of serialized steps needs); 0 for every other op. ``start``/``end`` per op (NaN: not measured)."""
    partner, _, _ = sched.match_transfers()
    recv = np.flatnonzero((sched.ops.kind == OP_KINDS.index("recv")) & (partner >= 0))
    out = np.zeros(len(sched.ops))
    span = end[recv] - np.maximum(start[recv], start[partner[recv]])
    out[recv] = np.where(np.isfinite(span), np.maximum(span, 0.0), 0.0)
    return out


def executor_overhead(sched, start: np.ndarray, end: np.ndarray) -> dict[str, dict]:
    """Per pass: the measured makespan (latest op end, from the per-op medians), the critical path of the
    measured op durations, and the overhead: makespan − critical path, the time the executor itself added
    between an op's predecessors ending and the op starting (thread wake-ups, bookkeeping, allocation).

    The path runs over units (a P2P batch counts once) along stream order and deps; a transfer's duration
    includes waiting for its peer, so cross-rank dependencies are inside the durations.
    """
    o, out = sched.ops, {}
    for p in sched.passes:
        ops = np.flatnonzero((o.phase == p) & np.isfinite(end))
        if not len(ops):
            continue
        unit, last_unit, finish = {}, {}, {}
        for i in ops.tolist():
            key = (int(o.rank[i]), int(o.stream[i]))
            prev = last_unit.get(key)
            batch = prev is not None and o.step[i] >= 0 and o.kind[i] in (1, 2) and o.step[prev[1]] == o.step[i] \
                and o.kind[prev[1]] in (1, 2)
            u = prev[0] if batch else i
            unit[i] = u
            preds = [unit[d] for d in o.deps[o.dep_ptr[i]:o.dep_ptr[i + 1]].tolist() if d in unit]
            if prev is not None and not batch:
                preds.append(prev[0])
            base = max((finish[q] for q in preds if q != u), default=0.0)
            finish[u] = max(finish.get(u, 0.0), base + float(end[i] - start[i]))
            last_unit[key] = (u, i)
        makespan = float(end[ops].max())
        path = max(finish.values())
        out[PASS_NAMES[p]] = {"makespan_s": makespan, "critical_path_s": path,
                              "overhead_pct": 100.0 * (makespan - path) / makespan if makespan > 0 else 0.0}
    return out
