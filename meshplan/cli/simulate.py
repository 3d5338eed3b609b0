"""What the CLI commands do, kept out of :mod:`meshplan.cli.app` so that ``--help`` imports nothing heavy."""

from __future__ import annotations

import json
import sys
from typing import Any

from meshplan.core.errors import UserError
from meshplan.core.fileio import check_writable
from meshplan.show.console import out_console


def _log(message: str) -> None:
    sys.stderr.write(message + "\n")


def simulate_named(algo, gpus, topo, workload, knobs, out, trace, as_json, emit) -> None:
    """``meshplan simulate --algo NAME``: plan, schedule, simulate; optionally write schedule and trace."""
    from meshplan.algorithms import get
    from meshplan.cli.options import topology
    from meshplan.search.candidate import predict, result_json
    from meshplan.show.tables import print_simulation

    if algo is None:
        raise UserError("--algo", "simulate needs an algorithm or a schedule file",
                        "give --algo NAME (ring, pass-q, ...) or a SCHEDULE.json")
    get(algo)
    if out is not None and not (out.endswith(".json") or out.endswith(".json.gz")):
        raise UserError("--out", f"{out!r} is not a .json or .json.gz name", "name the file *.json or *.json.gz")
    if out is not None:
        check_writable(out, "--out")                     # before the work, not after it
    topo_obj = topology(topo, gpus, "simulate")
    n = gpus if gpus is not None else topo_obj.n_devices
    cand = predict(algo, workload, topo_obj, n, knobs, keep_schedule=out is not None or trace is not None,
                   on_whole=lambda: _log(f"note: {algo}'s ranks are not alike by node here: every rank's program is "
                                         f"built and simulated ({n} ranks: minutes and GBs)"))
    body = result_json(cand) | {"topology": {"name": topo_obj.name, "devices": topo_obj.n_devices}}
    if out is not None:
        write_verified(cand.schedule, topo_obj, out)
        body["schedule_path"] = out
    if trace is not None:
        write_timeline_trace(cand.schedule, cand.sim, trace)
    title = schedule_title(cand.algorithm, cand.knobs, topo_obj, n, cand.workload)   # doc-place: as planned
    emit(body, as_json, lambda c: print_simulation(body, c, title))
    _warn_memory(body["predicted"]["peak_memory_total_bytes"], topo_obj)


def _warn_memory(peak: float, topo) -> None:
    """A note on stderr when the memory model's peak exceeds the device's memory."""
    if peak > topo.memory_bytes:
        from meshplan.core.units import fmt_bytes
        sys.stderr.write(f"note: the plan needs {fmt_bytes(peak)} per GPU by the memory model (buffers, workspace, "
                         f"runtime), more than the device's {fmt_bytes(topo.memory_bytes)}\n")


def schedule_title(algo, knobs, topo, n, w) -> str:
    """The one-line title of a simulation: method, knobs, topology, ranks, workload."""
    from meshplan.show.tables import knob_text
    kn = knob_text(knobs, algo)
    return f"{algo}{f' ({kn})' if kn else ''} on {topo.name} x {n}: {w.describe()}"


def write_verified(sched, topo, path: str) -> None:
    """Verify ``sched`` against ``topo``'s device memory and write it; a failing schedule is refused (UserError),
    nothing written."""
    from meshplan.plan.json.io import write_schedule
    from meshplan.plan.verify import verify
    report = verify(sched, topo.memory_bytes)
    if not report.ok:
        memory = report.over_memory_only
        raise UserError("--out", f"the schedule fails verification: {report.violations[0]}",
                        "the plan does not fit the device: add GPUs, or shorten --seq-len or --batch; nothing was "
                        "written" if memory else "this is a planner bug; nothing was written")
    write_schedule(sched, path)


def write_timeline_trace(sched, sim, path: str) -> None:
    """Write the simulated timeline ``sim`` of ``sched`` as a Chrome/Perfetto trace at ``path``."""
    from meshplan.show.trace import trace_events, write_trace
    write_trace(path, trace_events(sched, sim.start, sim.end))


def simulate_file(path, topo, trace, as_json, emit) -> None:
    """``meshplan simulate SCHEDULE.json [--topo T]``: verify, then simulate on its topology or ``T``."""
    from meshplan.algorithms.ring import ring_ccr
    from meshplan.cost.metrics import predicted
    from meshplan.cost.simulate import simulate
    from meshplan.model.topology import Topology
    from meshplan.plan.json.io import read_schedule
    from meshplan.plan.verify import verify
    from meshplan.show.tables import print_simulation

    sched = read_schedule(path)
    name = topo or sched.topology.get("name")
    topo_obj = Topology.load(name, sched.topology.get("devices"))
    report = verify(sched, topo_obj.memory_bytes)
    if not report.ok:
        raise UserError(str(path), f"invalid schedule: {report.violations[0]}", "run meshplan validate for the list")
    sim = simulate(sched, topo_obj)
    if topo is None and topo_obj.content_hash != sched.topology.get("hash"):     # after any refusal: one line
        _log(f"warning: the shipped {name} differs from the one the schedule was planned for (hash)")
    body = {"algorithm": sched.algorithm, "knobs": sched.knobs, "workload": sched.workload.to_dict(),
            "pass": sched.workload.passes, "model_level": "simulated",
            "predicted": predicted(sched, topo_obj, sim, ring_ccr(sched.workload, topo_obj, sched.n_ranks)).json(),
            "simulation": sim.json(), "topology": {"name": topo_obj.name, "devices": topo_obj.n_devices}}
    if trace is not None:
        write_timeline_trace(sched, sim, trace)
    emit(body, as_json, lambda c: print_simulation(body, c, f"{path} on {topo_obj.name}"))


def validate_file(path, topo, as_json: bool) -> int:
    """``meshplan validate``: 0 valid, 1 invalid, 2 unreadable (raised as UserError)."""
    from meshplan.core.heap import keep_large_arrays
    from meshplan.plan.json.io import read_schedule
    from meshplan.plan.verify import verify

    keep_large_arrays()                     # a short command: its large arrays' pages reused, not faulted in anew
    sched = read_schedule(path)
    memory = None
    if topo:
        from meshplan.model.topology import Topology  # networkx and all: only when asked
        memory = Topology.load(topo, sched.topology.get("devices")).memory_bytes
    report = verify(sched, memory, both_cores=True)
    body = {"valid": report.ok, "violations": report.violations, "counts": report.counts,
            "peak_memory_bytes": report.peak_memory_bytes, "ops": len(sched.ops), "ranks": sched.n_ranks}
    if as_json:
        sys.stdout.write(json.dumps(body, indent=1) + "\n")
        return 0 if report.ok else 1
    say = out_console()              # wrapped at the terminal's width (100 columns piped)
    if report.ok:
        from meshplan.core.units import fmt_bytes
        say.print(f"valid: {len(sched.ops)} ops on {sched.n_ranks} ranks; every permitted block once, no padding "
                  f"computed, transfers matched and batched in one order, no hazard, no deadlock; peak buffers "
                  f"{fmt_bytes(report.peak_memory_bytes)} per rank", markup=False, highlight=False)
    else:
        say.print(f"invalid: {sum(report.counts.values())} violation(s)", markup=False, highlight=False)
        for v in report.violations:
            say.print(f"  {v}", markup=False, highlight=False)
    return 0 if report.ok else 1


def topology_info(name: str, gpus: int | None) -> dict[str, Any]:
    """What ``topo show`` prints: devices, link classes and example routes."""
    import numpy as np

    from meshplan.model.topology import LINK_CLASSES, Topology
    t = Topology.load(name, gpus)
    d = t.spec.node.device
    classes = []
    kappa = t.kappa()
    for k, cls in enumerate(LINK_CLASSES):
        sel = t.link_class == k
        if sel.any():
            caps = sorted(set(np.round(t.link_capacity[sel] / 1e9, 3).tolist()))
            lats = sorted(set(np.round(t.link_latency_s[sel] * 1e6, 3).tolist()))
            flow = sorted(set(np.round(t.link_flow_cap[sel] / 1e9, 3).tolist()))
            classes.append({"class": cls, "links": int(sel.sum()), "GBps": ", ".join(map(str, caps)),
                            "latency_us": ", ".join(map(str, lats)),
                            "flow_cap_GBps": ", ".join("-" if not np.isfinite(f) else str(f) for f in flow),
                            "kappa": float(kappa[k])})
    pairs = {(0, min(1, t.n_devices - 1)), (0, t.n_devices // 2), (0, t.n_devices - 1)}
    if t.n_nodes > 1 and t.spec.network.kind == "rail":
        pairs |= {(0, t.gpus_per_node), (0, t.gpus_per_node + 1)}          # the same rail, and across rails
    pairs = sorted(pairs)
    routes = []
    for a, b in pairs:
        if a == b:
            continue
        path = [t.device_vertex[a]] + [t.link_name(x).split(" -> ")[1] for x in t.route(a, b)]
        lat, bw = t.pair_stats(a, b)
        routes.append({"src": a, "dst": b, "path": path, "GBps": float(bw) / 1e9, "latency_us": float(lat) * 1e6})
    memory = t.memory_bytes
    return {"name": t.name, "description": t.spec.description, "source": t.source, "hash": t.content_hash,
            "devices": t.n_devices, "nodes": t.n_nodes, "devices_per_node": min(t.gpus_per_node, t.n_devices),
            "domains": t.n_domains, "domain_of_device": t.domain_of_device.tolist(),
            "device": {"model": d.model, "peak_bf16_tflops": d.peak_bf16_tflops, "memory_GB": memory / 1e9,
                       "kernel": d.kernel}, "link_classes": classes, "routes": routes,
            "p2p_overhead_us": t.spec.p2p_overhead_us, "network": _network_info(t)}


def _network_info(t) -> dict[str, Any]:
    """The inter-node routing ``topo show`` reports."""
    net = t.spec.network
    body: dict[str, Any] = {"kind": net.kind, "latency_us": net.latency_us}
    if net.kind == "rail":
        body |= {"rails": t.spec.node.nics.count if t.spec.node.nics else 0, "cross_rail": net.cross_rail,
                 "spine_oversubscription": net.spine_oversubscription, "spine_latency_us": net.spine_latency_us}
    return body
