"""``meshplan run`` and ``meshplan compare``: what they do and print (torch is imported only by ``run``)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from meshplan.core.errors import UserError
from meshplan.core.units import fmt_bytes, fmt_seconds
from meshplan.show.console import out_console


def run_command(schedule: str, nproc, backend, iters, warmup, check, serialize, timeout_s, out, trace, dump_dir,
                seed, inputs, as_json: bool) -> int:
    """Run, write the files, print; returns the exit status (0 ok, 1 numerics failed or a rank failed)."""
    from meshplan.core.fileio import check_writable, write_atomic

    for flag, name in ((out, "--out"), (trace, "--trace")):
        if flag is not None and not flag.endswith(".json"):
            raise UserError(name, f"{flag!r} is not a .json name", "name the file *.json")
        if flag is not None:
            check_writable(flag, name)
    _runs_here(schedule, backend)                       # before the executor's modules: they import torch
    from meshplan.executor.launch import RunFailed, run
    from meshplan.executor.worker import RunConfig
    from meshplan.plan.json.measurement import MeasurementJSON
    from meshplan.search.run_memory import check_fits

    if iters < 1 or warmup < 0 or timeout_s <= 0:
        raise UserError("--iters/--warmup/--timeout-s", "need iters ≥ 1, warmup ≥ 0, timeout > 0", "fix the value")
    if dump_dir is not None and Path(dump_dir).exists() and not Path(dump_dir).is_dir():
        raise UserError("--dump", f"{dump_dir!r} is a file, not a folder", "give a folder for the .npy files")
    cfg = RunConfig(backend=backend, iters=iters, warmup=warmup, check=check, serialize=serialize,
                    timeout_s=timeout_s, dump_dir=dump_dir, seed=seed, inputs_path=inputs)
    try:
        body = run(schedule, nproc, cfg, fits=lambda prog, c, host: check_fits(
            prog.schedule, host, schedule, gathers=c.check == "full" or c.dump_dir is not None))
    except RunFailed as err:
        sys.stderr.write(f"error: run failed: {err}\n")
        return 1
    if body is None:            # a torchrun rank other than 0
        return 0
    meas = MeasurementJSON.model_validate(body)
    cmp = _compare_quietly(schedule, meas)
    if out is not None:
        write_atomic(out, meas.model_dump_json(indent=1).encode())
    if trace is not None:
        _write_measured_trace(schedule, meas, trace)
    if as_json:
        sys.stdout.write(json.dumps({"measurement": meas.model_dump(), "comparison": cmp}, indent=1) + "\n")
    else:
        print_run(meas, cmp, out_console())
    _say_implausible(cmp)
    return 1 if meas.numerics.passed is False or (cmp or {}).get("implausible") else 0


def _runs_here(schedule: str, backend: str) -> None:
    """Refuse at once what cannot start here: no torch (``run`` needs the ``exec`` extra), or a schedule of more CPU
    ranks than this host spawns — read from the file's header before the whole file is read and checked (seconds
    and GBs at 256 ranks), and before the memory check that would name its topology's limits.

    Raises:
        UserError: one line, the fix.
    """
    import importlib.util
    import os

    from meshplan.plan.json.io import schedule_ranks
    from meshplan.search.run_memory import cpu_max_ranks, cpu_ranks_error

    if importlib.util.find_spec("torch") is None:
        raise UserError("meshplan run", "needs torch, which this environment lacks",
                        "pip install -c constraints.txt -e '.[exec]' (CPU ranks), or '.[gpu]' on a GPU host")
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return                                       # one rank of a torchrun job: the job is the cluster's
    import torch

    cpu = backend == "gloo" or (backend == "auto" and not torch.cuda.is_available())
    n = schedule_ranks(schedule) if cpu else None
    if n is not None and n > cpu_max_ranks():
        raise cpu_ranks_error(Path(schedule).name, n)


def _say_implausible(cmp: dict[str, Any] | None) -> None:
    """Each reason a measurement cannot be real, one line each on stderr."""
    for line in (cmp or {}).get("implausible", []):
        sys.stderr.write(f"implausible: {line}\n")


def _compare_quietly(schedule: str, meas) -> dict[str, Any] | None:
    """The comparison with the prediction, or None when the schedule's topology is not shipped here."""
    from meshplan.plan.json.io import from_json, read_document
    from meshplan.truth.compare import compare
    doc, _ = read_document(schedule)
    try:
        return compare(from_json(doc), [op.id for r in doc.ranks for op in r.ops], meas)
    except UserError as err:
        sys.stderr.write(f"warning: no prediction to compare with: {err}\n")
        return None


def _write_measured_trace(schedule: str, meas, path: str) -> None:
    from meshplan.plan.json.io import from_json, read_document
    from meshplan.show.plot_data import measured_times
    from meshplan.show.trace import trace_events, write_trace
    doc, _ = read_document(schedule)
    sched = from_json(doc)
    start, end = measured_times(sched, [op.id for r in doc.ranks for op in r.ops], meas, schedule)
    write_trace(path, trace_events(sched, start, end, label="measured"))


def write_comparison_trace(schedule: str, measurement: str, topo: str | None, path: str) -> None:
    """One Chrome trace with the predicted timeline (processes 0..N−1) above the measured one (N..2N−1)."""
    from meshplan.show.plot_data import both_timelines
    from meshplan.show.trace import trace_events, write_trace
    sched, _, sim, measured, _ = both_timelines(schedule, measurement, topo)
    events = trace_events(sched, sim.start, sim.end, label="predicted") + trace_events(
        sched, *measured, label="measured", pid_offset=sched.n_ranks)
    write_trace(path, events)


def print_run(meas, cmp: dict[str, Any] | None, console: Console) -> None:
    """Numerics per tensor, then measured against predicted per pass."""
    n, s = meas.numerics, meas.settings
    how = {"full": "", "sampled": f" ({n.sampled_triples} sampled rows)", "off": ""}[n.checked]
    verdict = "not checked (--no-check)" if n.checked == "off" else ("passed" if n.passed else "FAILED") + how
    console.print(f"{meas.algorithm}: {len(meas.ranks)} ranks ({meas.env.get('backend')}), {s['iters']} timed "
                  f"iterations after {s['warmup']} warm-up{', serialized' if s['serialize'] else ''}; "
                  f"numerics {verdict}")
    if n.checked != "off":
        t = Table("tensor", "max |error|", "bound", "1-process error", "floor", "ok")
        for name, e in n.tensors.items():
            t.add_row(name, f"{e.max_abs_err:.3g}", f"{e.bound:.3g}", f"{e.single_process_err:.3g}", f"{e.floor:.3g}",
                      "yes" if e.passed else "NO")
        console.print(t)
    t = Table("pass", "measured (median)", "min – max", "predicted", "error")
    e2e = (cmp or {}).get("end_to_end", {})
    for name, p in list(meas.passes.items()) + [("total", None)]:
        m = p.makespan_s if p else meas.makespan_s
        spread = p.spread if p else meas.makespan_spread
        row = e2e.get(name, {})
        t.add_row(name, fmt_seconds(m), f"{fmt_seconds(spread.min_s)} – {fmt_seconds(spread.max_s)}",
                  fmt_seconds(row["predicted_s"]) if row else "-", _pct(row.get("error_pct")))
    console.print(t)
    _print_speed((cmp or {}).get("host_speed"), e2e, console)
    _print_contention((cmp or {}).get("contention"), console)
    mem = f"peak memory per rank: {fmt_bytes(meas.peak_memory_bytes)} measured ({meas.peak_memory_kind})"
    if cmp:
        mem += f", {fmt_bytes(cmp['peak_memory']['predicted_bytes'])} predicted"
        rise = cmp.get("memory_rise")
        if rise:
            mem += (f" (the buffers); the largest pass took {fmt_bytes(rise['measured_rise_bytes'])} "
                    f"({rise['kind']}: its start tensors and the rise), the memory model (buffers, workspace, "
                    f"runtime) predicts {fmt_bytes(rise['predicted_bytes'])}, error {_pct(rise['error_pct'])}")
        if cmp["note"]:
            mem += f"\nnote: {cmp['note']}"
    console.print(mem)
    from meshplan.truth.compare import stream_cpu
    _print_stream_cpu(stream_cpu(meas), console)


def _print_speed(speed: dict | None, e2e: dict, console: Console) -> None:
    """One line: the host-speed probe against the calibration's, and the total error with that drift taken out."""
    if not speed:
        return
    r = speed["ratio"]
    how = f"{abs(r - 1) * 100:.0f}% {'slower' if r >= 1 else 'faster'} than"
    adj = e2e.get("total", {}).get("speed_adjusted_error_pct")
    console.print(f"host speed: probe {speed['probe_ms']:.1f} ms, {how} at calibration "
                  f"({speed['calibrated_probe_ms']:.1f} ms); total error with that drift taken out: {_pct(adj)}")


def _print_contention(c: dict | None, console: Console) -> None:
    """One line: contention on the host or the kernel model (:mod:`meshplan.truth.contention`)."""
    from meshplan.truth.contention import contention_text
    if (text := contention_text(c)) is not None:
        console.print(text)


def _print_stream_cpu(cpu: dict[str, float] | None, console: Console) -> None:
    """One line: each stream thread's CPU time per iteration (median over ranks)."""
    if cpu:
        each = ", ".join(f"{s} {fmt_seconds(v)}" for s, v in cpu.items())
        console.print(f"thread CPU per iteration (median over ranks; the backend's own threads not counted): {each}")


def _pct(x) -> str:
    return "-" if x is None else f"{x:+.1f}%"


def compare_command(schedule: str, measurement: str, topo: str | None, as_json: bool, trace: str | None = None) -> int:
    """``meshplan compare`` (with ``--trace``: both timelines in one Chrome trace); returns the exit status: 1 when
    the measurement is implausible (each reason on stderr), else 0."""
    from meshplan.truth.compare import compare_files
    body = compare_files(schedule, measurement, topo)
    if trace is not None:
        write_comparison_trace(schedule, measurement, topo, trace)
    _say_implausible(body)
    if as_json:
        sys.stdout.write(json.dumps(body, indent=1) + "\n")
    else:
        _print_comparison(schedule, measurement, body)
    return 1 if body["implausible"] else 0


def _print_comparison(schedule: str, measurement: str, body: dict[str, Any]) -> None:
    """The human tables of ``meshplan compare``."""
    console = out_console()
    console.print(f"{schedule} on {body['topology']} against {measurement} ({body['backend']})")
    if body["note"]:
        console.print(f"note: {body['note']}")
    t = Table("end to end", "predicted", "measured", "error")
    for name, r in body["end_to_end"].items():
        t.add_row(name, fmt_seconds(r["predicted_s"]), fmt_seconds(r["measured_s"]), _pct(r["error_pct"]))
    console.print(t)
    _print_speed(body.get("host_speed"), body["end_to_end"], console)
    _print_contention(body.get("contention"), console)
    t = Table("pass", "op kind", "ops", "predicted (sum)", "measured (sum)", "error")
    for r in body["per_kind"]:
        t.add_row(r["pass"], r["kind"], str(r["ops"]), fmt_seconds(r["predicted_s"]), fmt_seconds(r["measured_s"]),
                  _pct(r["error_pct"]))
    console.print(t)
    t = Table("pass", "step", "predicted end", "measured end", "error")
    for r in body["per_step"]:
        t.add_row(r["pass"], str(r["step"]), fmt_seconds(r["predicted_s"]), fmt_seconds(r["measured_s"]),
                  _pct(r["error_pct"]))
    console.print(t)
    m = body["peak_memory"]
    console.print(f"peak memory per rank: predicted {fmt_bytes(m['predicted_bytes'])}, measured "
                  f"{fmt_bytes(m['measured_bytes'])} ({m['measured_kind']}), error {_pct(m['error_pct'])}")
    rise = body.get("memory_rise")
    if rise:
        calibrated = "calibrated" if rise["model"].startswith("meshplan calibrate") else "uncalibrated default"
        console.print(f"memory of the largest pass: measured {fmt_bytes(rise['measured_rise_bytes'])} "
                      f"({rise['kind']}), "
                      f"predicted {fmt_bytes(rise['predicted_bytes'])} (the memory model, {calibrated}: buffers + "
                      f"workspace + runtime), error {_pct(rise['error_pct'])}; the buffers alone "
                      f"{fmt_bytes(rise['predicted_buffers_bytes'])}")
    over = ", ".join(f"{p} {o['overhead_pct']:.1f}%" for p, o in body["executor_overhead"].items())
    console.print(f"executor overhead (makespan − critical path of measured ops): {over}")
    _print_stream_cpu(body.get("stream_cpu_s"), console)
