"""``meshplan calibrate``: run the micro-benchmarks on this host, fit them, write a calibration file.

The fitted numbers are printed beside the topology file's own values they replace (a table, or ``--json``);
progress goes to stderr. Torch is imported only by the benchmarks (:mod:`meshplan.executor.calibrate.bench`).
"""

from __future__ import annotations

import importlib.util
import json
import sys
import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from meshplan.core.errors import UserError
from meshplan.show.console import out_console

_LINK_CLASS = {"loopback": "loopback", "nvswitch": "nvlink", "pcie": "pcie"}


def calibrate_command(topo: str, backend: str, quick: bool, out: str, as_json: bool, repeat: int = 1) -> int:
    """Measure (``repeat`` times, merged by :func:`meshplan.truth.calibration_merge.merge_raws`), fit, write ``out``
    atomically, print; returns the exit status (1: a rank failed)."""
    from meshplan.core.fileio import write_atomic
    from meshplan.model.calibration_file import HostFacts, Raw, dump_yaml
    from meshplan.model.topology import Topology
    from meshplan.truth.calibration_fit import fit_calibration
    from meshplan.truth.calibration_merge import merge_raws

    if not out.endswith((".yaml", ".yml")):
        raise UserError("--out", f"{out!r} is not a .yaml name", "name the file *.yaml")
    if repeat < 1:
        raise UserError("--repeat", f"{repeat} runs", "give 1 or more (e.g. 3)")
    if importlib.util.find_spec("torch") is None:
        raise UserError("calibrate", "the micro-benchmarks need torch, which is not installed",
                        "install the [exec] extra: pip install -e '.[exec]'")
    topology = Topology.load(topo)
    from meshplan.executor.calibrate.bench import measure
    from meshplan.executor.calibrate.common import log
    from meshplan.executor.launch import RunFailed, resolve_backend

    resolved = resolve_backend(backend)
    kind = topology.spec.node.fabric.kind
    if (resolved == "gloo") != (kind == "loopback"):
        raise UserError("--topo", f"{topology.name} has a {kind} fabric but this run uses {resolved} "
                        f"({'CPU ranks' if resolved == 'gloo' else 'GPUs'})",
                        "calibrate cpu-local with gloo, and a GPU topology with nccl on its GPUs")
    t0 = time.perf_counter()
    memory = _memory_schedules(resolved == "nccl", quick)
    runs = []
    try:
        for i in range(repeat):
            if repeat > 1:
                log(f"run {i + 1} of {repeat}")
            runs.append(measure(memory, resolved, quick, _LINK_CLASS[kind]))
    except RunFailed as err:
        sys.stderr.write(f"error: calibration failed: {err}\n")
        return 1
    busy = [f["others_busy_cores"] for _, f in runs if f.get("others_busy_cores") is not None]
    facts = HostFacts(model=topology.spec.node.device.model,
                      **runs[0][1] | {"others_busy_cores": max(busy) if busy else None})
    raw = merge_raws([r for r, _ in runs])
    calib = fit_calibration(Raw.model_validate(raw), facts, topology.name, wall_s=time.perf_counter() - t0)
    write_atomic(out, dump_yaml(calib).encode())
    rows = summary(calib, topology)
    if as_json:
        body = {"calibration": out, "topology": topology.name, "wall_s": calib.wall_s, "repeats": repeat,
                "device": calib.device.model_dump(mode="json"), "fitted": rows}
        sys.stdout.write(json.dumps(body, indent=1) + "\n")
    else:
        _print(calib, rows, out, out_console())
    return 0


def calibrate_refit(topo: str, out: str, as_json: bool) -> int:
    """``--refit``: every parameter of the calibration file ``out`` fitted again from its own ``raw`` measurements
    (the same host facts, date and wall time), written back atomically; nothing is measured and torch is not
    needed. For a file measured before meshplan's fits changed."""
    from meshplan.core.fileio import write_atomic
    from meshplan.model.calibration_file import dump_yaml
    from meshplan.truth.calibration_fit import fit_calibration

    old, topology = _existing(out, topo, "--refit")
    try:
        calib = fit_calibration(old.raw, old.device, old.name, old.wall_s, old.measured_at)
    except (ValueError, ArithmeticError, LookupError) as err:     # raw measurements that cannot be fitted
        raise UserError(f"{out}: raw", f"cannot be fitted ({' '.join(str(err).split())[:160]})",
                        "measure afresh: meshplan calibrate --out FILE (nothing was written)") from None
    write_atomic(out, dump_yaml(calib).encode())
    rows = summary(calib, topology)
    if as_json:
        sys.stdout.write(json.dumps({"calibration": out, "topology": topology.name, "refit": True,
                                     "fitted": rows}, indent=1) + "\n")
    else:
        _print(calib, rows, out, out_console())
    return 0


def _existing(out: str, topo: str, flag: str):
    """(the calibration file ``out``, the topology ``topo``) for an update of ``out`` in place; refused with one
    line when it is missing, another kind of file, or for another topology."""
    from meshplan.model.calibration_file import CalibrationSpec, load_calibration
    from meshplan.model.topology import Topology

    if not Path(out).is_file():
        how = "is not a file" if Path(out).exists() else "does not exist"
        raise UserError("--out", f"{out} {how}; {flag} updates a calibration file",
                        f"run meshplan calibrate without {flag} first")
    old = load_calibration(Path(out))
    if not isinstance(old, CalibrationSpec):
        raise UserError("--out", f"{out} is a nccl-tests calibration, which holds no raw micro-benchmarks",
                        "give a file written by meshplan calibrate")
    topology = Topology.load(topo)
    if old.name != topology.name:
        raise UserError("--out", f"{out} calibrates {old.name}, not {topology.name}", f"pass --topo {old.name}")
    return old, topology


def calibrate_memory_only(topo: str, backend: str, quick: bool, out: str, as_json: bool) -> int:
    """``--memory-only``: measure the memory model's samples again and replace ``memory`` (and ``raw.memory``) of
    the existing calibration file ``out``, keeping everything else; print the fitted coefficients."""
    from meshplan.core.fileio import write_atomic
    from meshplan.model.calibration_file import CalibrationSpec, dump_yaml

    old, topology = _existing(out, topo, "--memory-only")
    if importlib.util.find_spec("torch") is None:
        raise UserError("calibrate", "the micro-benchmarks need torch, which is not installed",
                        "install the [exec] extra: pip install -e '.[exec]'")
    import torch

    from meshplan.core.host import cpu_name
    from meshplan.executor.calibrate.bench import memory_samples, torch_threads
    from meshplan.executor.host import cpu_isa
    from meshplan.executor.launch import resolve_backend
    from meshplan.executor.memory import reuse_freed_memory
    from meshplan.truth.memory_fit import fit_memory

    cuda = resolve_backend(backend) == "nccl"
    here = (torch.cuda.get_device_name(0) if cuda else None, cpu_name(), cpu_isa())
    there = (old.device.gpu, old.device.cpu, old.device.isa)
    if here != there:
        raise UserError("--out", f"{out} was measured on {' / '.join(str(x) for x in there if x)}, this host is "
                        f"{' / '.join(str(x) for x in here if x)}", "calibrate afresh without --memory-only")
    t0 = time.perf_counter()
    reuse_freed_memory()
    with torch_threads(None if cuda else 1):
        samples = memory_samples(torch.device("cuda", 0) if cuda else torch.device("cpu"),
                                 _memory_schedules(cuda, quick))
    body = old.model_dump(mode="json", by_alias=True)
    body["raw"]["memory"] = samples
    body["memory"] = fit_memory(samples).model_dump(mode="json")
    calib = CalibrationSpec.model_validate(body)
    write_atomic(out, dump_yaml(calib).encode())
    rows = memory_rows(calib, old.memory)
    wall_s = time.perf_counter() - t0
    if as_json:
        sys.stdout.write(json.dumps({"calibration": out, "topology": topology.name, "wall_s": round(wall_s, 1),
                                     "fitted": rows}, indent=1) + "\n")
        return 0
    console = out_console()
    console.print(f"{calib.name}: memory model re-measured in {wall_s:.0f} s; the rest of {out} kept")
    console.print(_fitted_table(rows))
    return 0


def memory_rows(calib, before=None) -> list[dict[str, Any]]:
    """Rows of the memory model's fitted coefficients (``replaces``: ``before``'s, else the uncalibrated default's)."""
    from meshplan.model.memory_spec import DEFAULTS

    m = calib.memory
    if m is None:
        return []
    default = before or DEFAULTS["gpu" if calib.device.gpu else "cpu"]
    rows = []
    for dtype, c in m.compute.items():
        d = default.coefficients(dtype)
        for key in ("fwd_q_bytes_per_elem", "fwd_kv_bytes_per_elem", "bwd_q_bytes_per_elem", "bwd_kv_bytes_per_elem"):
            rows.append((f"memory {dtype} {key.removesuffix('_bytes_per_elem')}", "B per element", getattr(c, key),
                         getattr(d, key)))
    rows += [("memory merge", "B per byte merged", m.merge_bytes_per_byte, default.merge_bytes_per_byte),
             ("memory transfer", "B per wire byte", m.transfer_bytes_per_byte, default.transfer_bytes_per_byte),
             ("memory fit max error", "% on its samples", m.tolerance_pct, default.tolerance_pct)]
    return [{"name": n, "unit": u, "fitted": v, "replaces": w} for n, u, v, w in rows]


def summary(calib, topology) -> list[dict[str, Any]]:
    """Rows ``{"name", "unit", "fitted", "replaces"}``: each fitted number and the topology file's own value."""
    from meshplan.model.kernel_tables import load_kernel_table

    f = topology.file_spec
    dev, fab, pool = f.node.device, f.node.fabric, f.node.compute_pool
    base = str(Path(topology.source).parent) if topology.source else None
    old = load_kernel_table(dev.kernel, base).spec
    new = calib.kernel
    old_bwd = old.bwd or [[x * old.bwd_factor for x in row] for row in old.fwd]
    rows = [("peak_bf16_tflops", "TFLOP/s", calib.peak_bf16_tflops, dev.peak_bf16_tflops),
            ("peak_fp32_tflops", "TFLOP/s", calib.peak_fp32_tflops, dev.peak_fp32_tflops),
            ("hbm_GBps (merges / 0.8)", "GB/s", calib.hbm_GBps, dev.hbm_GBps),
            ("kernel launch_us", "us", new.launch_us, old.launch_us),
            ("kernel fwd efficiency", f"{new.tokens[0]}..{new.tokens[-1]} tokens", _span(new.fwd), _span(old.fwd)),
            ("kernel bwd efficiency", f"{new.tokens[0]}..{new.tokens[-1]} tokens", _span(new.bwd), _span(old_bwd)),
            ("kernel elementwise_factor", "", new.elementwise_factor, old.elementwise_factor),
            ("kernel bwd_delta_factor", "x flash bwd", new.bwd_delta_factor, old.bwd_delta_factor),
            ("kernel segment_us", "us per document segment", new.segment_us, old.segment_us)]
    for dt, factor in (new.bwd_delta_dtype or {}).items():
        rows.append((f"kernel bwd_delta_factor, {dt}", "x flash bwd", factor, None))
    for dt, factor in (new.merge_dtype or {}).items():
        rows.append((f"kernel merge_dtype, {dt}", "x its bytes / merge rate", factor, None))
    for dt in sorted(new.dtype_fwd or {}):
        for i, d in enumerate(new.dtype_head_dims or [None]):
            rows.append((f"kernel {dt} x by size, fwd / bwd" + (f", D={d}" if d else ""),
                         f"{new.dtype_tokens[0]}..{new.dtype_tokens[-1]} tokens",
                         f"{_span([new.dtype_fwd[dt][i]])} / {_span([new.dtype_bwd[dt][i]])}", None))
    links = {"loopback": getattr(fab, "link", None), "nvlink": getattr(fab, "port", None)}
    for cls, link in calib.links.items():
        was = links.get(cls)
        rows += [(f"{cls} link usable_GBps", "GB/s", link.usable_GBps, was.bytes_per_s / 1e9 if was else None),
                 (f"{cls} link latency_us", "us", link.latency_us, was.latency_us if was else None)]
    if calib.shared_GBps is not None:
        rows.append(("loopback shared_GBps", "GB/s", calib.shared_GBps, getattr(fab, "shared_GBps", None)))
    if calib.p2p_overhead_us is not None:
        rows.append(("p2p_overhead_us", "us", calib.p2p_overhead_us, f.p2p_overhead_us))
    for cls, kappa in calib.overlap_kappa.items():
        rows.append((f"overlap_kappa.{cls}", "", kappa, getattr(f.overlap_kappa, cls)))
    for cls, kappa in calib.transfer_kappa.items():
        rows.append((f"transfer_kappa.{cls}", "", kappa, getattr(f.transfer_kappa, cls)))
    for cls, cpu in calib.transfer_cpu_us_per_MB.items():
        rows.append((f"transfer_cpu_us_per_MB.{cls}", "core-us per MB moved", cpu,
                     getattr(f.transfer_cpu_us_per_MB, cls)))
    if calib.compute_pool is not None:
        was = None if pool is None else (pool.capacity_ranks or pool.cores / pool.threads_per_rank)
        rows.append(("compute pool capacity", "ranks at full speed", calib.compute_pool.capacity_ranks, was))
    err = p2p_error_pct(calib)
    if err is not None:
        rows.append(("p2p error, messages >= 1 MiB", "% max on its samples (target <= 8)", err, None))
    return [{"name": n, "unit": u, "fitted": v, "replaces": w} for n, u, v, w in rows] + memory_rows(calib)


def p2p_error_pct(calib) -> float | None:
    """The largest error, in %, of the fitted transfer model on the calibration's own transfers of 1 MiB and more
    (docs/cost-model.md's micro-level target: <= 8%): one flow ``alpha + S / bw``, k at once ``alpha + S / min(bw,
    shared / k)``; None without transfers."""
    if not calib.links or calib.p2p_overhead_us is None:
        return None
    link = next(iter(calib.links.values()))
    bw, alpha = link.usable_GBps * 1e9, calib.p2p_overhead_us * 1e-6 + link.latency_us * 1e-6
    errs = []
    for s in calib.raw.p2p:
        if s.size_bytes >= 1 << 20 and (s.flows == 1 or calib.shared_GBps is not None):
            rate = bw if s.flows == 1 else min(bw, calib.shared_GBps * 1e9 / s.flows)
            errs.append(abs(alpha + s.size_bytes / rate - s.time_s) / s.time_s * 100)
    return round(max(errs), 2) if errs else None


def _span(table: list[list[float]]) -> str:
    flat = [x for row in table for x in row]
    return f"{min(flat):.3g}–{max(flat):.3g}"


def _fmt(x) -> str:
    if x is None:
        return "-"
    return x if isinstance(x, str) else f"{x:.4g}"


def _fitted_table(rows: list[dict]) -> Table:
    t = Table("parameter", "fitted", "replaces", "unit")
    for r in rows:
        t.add_row(r["name"], _fmt(r["fitted"]), _fmt(r["replaces"]), r["unit"])
    return t


def _print(calib, rows: list[dict], out: str, console: Console) -> None:
    d = calib.device
    console.print(f"{calib.name}: measured on {d.cpu} ({d.cores} CPUs{', ' + d.gpu if d.gpu else ''}, torch "
                  f"{d.torch}, {d.backend}) in {calib.wall_s:.0f} s"
                  f"{f' ({calib.raw.repeats} runs merged)' if calib.raw.repeats > 1 else ''}; wrote {out}")
    console.print(_fitted_table(rows))
    console.print(f"use it: add `calibration: {out}` to the topology file (a path relative to it)")


def calibrate_from_nccl_tests(topo: str, files: list[str], out: str, as_json: bool) -> int:
    """``--from-nccl-tests``: fit the files (``[CLASS:]FILE``, comma-separated or repeated), check that the topology
    takes the result, write ``out`` atomically, print. No torch (:mod:`meshplan.model.nccl_calibration_file`)."""
    from meshplan.core.fileio import write_atomic
    from meshplan.model.nccl_calibration_file import PREFIXES, apply_nccl_calibration, dump_yaml
    from meshplan.model.topology import Topology
    from meshplan.truth import nccl_tests
    from meshplan.truth.nccl_fit import build

    if not out.endswith((".yaml", ".yml")):
        raise UserError("--out", f"{out!r} is not a .yaml name", "name the file *.yaml")
    spec = Topology.load(topo).file_spec
    if spec.node.fabric.kind == "loopback":
        raise UserError("--topo", f"{spec.name} is CPU ranks over loopback, which nccl-tests do not measure",
                        "give the GPU topology the files were measured on: --topo FILE")
    fits = []
    items = [x.strip() for arg in files for x in arg.split(",") if x.strip()]
    if not items:
        raise UserError("--from-nccl-tests", "no file given", "give nccl-tests output files: FILE or CLASS:FILE")
    for item in items:
        prefix, _, rest = item.partition(":")
        if rest and prefix not in PREFIXES and not Path(item).exists():
            raise UserError("--from-nccl-tests", f"{prefix!r} is not a link class", "prefix a file with intra:, "
                            "nvlink: or net:, or leave the prefix out (one host: intra; several: net)")
        cls = PREFIXES.get(prefix) if rest else None
        f = nccl_tests.fit_run(nccl_tests.read(rest if cls else item))
        if cls == "nvlink" and f.run.hosts > 1 and f.run.ranks > (spec.node.gpus or 0):
            raise UserError("--from-nccl-tests", f"{Path(rest).name} ran {f.run.ranks} ranks on {f.run.hosts} hosts, "
                            f"more than one {spec.name} node holds, so it measured the network, not the NVLink ports",
                            f"prefix it with net: (or drop {prefix}:)")
        fits.append((f, cls or ("nvlink" if f.run.hosts == 1 else "net")))
    calib = build(fits, spec)
    applied = apply_nccl_calibration(spec, calib)          # refuses what the topology cannot take, before writing
    write_atomic(out, dump_yaml(calib).encode())
    rows = _nccl_rows(spec, applied, calib)
    per_file = [r.model_dump(mode="json", exclude={"rows"}) for r in calib.fits]
    if as_json:
        body = {"calibration": out, "topology": spec.name, "files": per_file, "fitted": rows}
        sys.stdout.write(json.dumps(body, indent=1) + "\n")
        return 0
    console = out_console()
    t = Table("file", "test", "ranks", "hosts", "class", "alpha us", "busbw GB/s", "rate GB/s", "max error ≥ 1 MiB")
    for r in per_file:
        t.add_row(r["file"], r["collective"], str(r["ranks"]), str(r["hosts"]), r["link_class"], _fmt(r["alpha_us"]),
                  _fmt(r["busbw_GBps"]), _fmt(r["rate_GBps"]), f"{r['max_error']:.1%}")
    console.print(t)
    console.print(_fitted_table(rows))
    console.print(f"wrote {out}; use it: add `calibration: {out}` to the topology file (a path relative to it)")
    return 0


def _nccl_rows(old, new, calib) -> list[dict[str, Any]]:
    """The topology keys the nccl-tests calibration sets: fitted (applied) and the file's own value."""
    keys = []
    if calib.nvlink is not None:
        keys += [("p2p_overhead_us", "us", lambda s: s.p2p_overhead_us),
                 ("nvlink port usable_GBps", "GB/s", lambda s: s.node.fabric.port.bytes_per_s / 1e9),
                 ("nvlink port latency_us", "us", lambda s: s.node.fabric.port.latency_us)]
    if calib.net is not None:
        keys += [("network latency_us", "us", lambda s: s.network.latency_us),
                 ("nics port usable_GBps", "GB/s", lambda s: s.node.nics.port.bytes_per_s / 1e9),
                 ("nics per_flow_GBps", "GB/s", lambda s: s.node.nics.per_flow_GBps),
                 ("nics node_aggregate_GBps", "GB/s", lambda s: s.node.nics.node_aggregate_GBps),
                 ("nics port + gpu_link latency_us", "us",
                  lambda s: s.node.nics.port.latency_us + s.node.nics.gpu_link.latency_us)]
    return [{"name": n, "unit": u, "fitted": get(new), "replaces": get(old)} for n, u, get in keys]


def _memory_schedules(cuda: bool, quick: bool):
    """The schedules the memory samples run, planned here and handed to the executor: the small ones whose ops
    run alone, and on CPU the declared run (1 time with --quick, else 3; on GPUs none is declared yet)."""
    from meshplan.executor.calibrate.bench import MemorySchedules
    from meshplan.truth.memory_fit import declared_candidate, sample_schedules

    repeats = 0 if cuda else 1 if quick else 3
    return MemorySchedules(tuple(sample_schedules(cuda, quick)),
                           declared_candidate().schedule if repeats else None, repeats)
