"""Human-readable tables for the CLI (rich), printed on stdout; units converted here only."""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.table import Table

from meshplan.core.units import fmt_bytes, fmt_seconds

_ROWS = [("makespan_s", "makespan", fmt_seconds), ("compute_s", "compute (critical rank)", fmt_seconds),
         ("exposed_comm_s", "exposed communication", fmt_seconds), ("comm_busy_s", "communication busy", fmt_seconds),
         ("comm_bytes_per_gpu_max", "bytes received / GPU (max)", fmt_bytes),
         ("inter_node_bytes_per_gpu_max", "inter-node bytes / GPU (max)", fmt_bytes),
         ("compute_to_comm", "compute / communication", lambda x: f"{x:.3g}"),
         ("ring_ccr", "Ring CCR (CHARM+ definition)", lambda x: f"{x:.3g}"),
         ("bytes_per_flop", "bytes / FLOP", lambda x: f"{x:.3g}"),
         ("peak_memory_bytes", "peak buffer memory / GPU", fmt_bytes),
         ("peak_memory_total_bytes", "peak memory / GPU (+ workspace)", fmt_bytes),
         ("work_imbalance", "work imbalance (max / mean rank)", lambda x: f"{x:.3g}")]


def fmt_or_dash(value: Any, f) -> str:
    """``f(value)``, or "-" for a value the prediction does not have (None)."""
    return "-" if value is None else f(value)


def print_simulation(body: dict[str, Any], console: Console, title: str) -> None:
    """The predicted metrics of one schedule, a column per pass."""
    pred = body["predicted"]
    parts = [p for p in ("fwd", "bwd", "total") if p in pred] or [body["pass"]]
    console.print(title)
    table = Table()
    table.add_column("predicted")
    for p in parts:
        table.add_column(p, justify="right")
    for key, label, f in _ROWS:
        table.add_row(label, *[fmt_or_dash((pred[p] if p in pred else pred).get(key), f) for p in parts])
    console.print(table)


def knob_text(knobs: dict[str, Any], algorithm: str | None = None) -> str:
    """Knobs that differ from the algorithm's defaults (an ``auto`` that resolved shows what it chose)."""
    from meshplan.algorithms import REGISTRY
    defaults = {k: kn.default for k, kn in REGISTRY[algorithm].knobs.items()} if algorithm in REGISTRY else {}
    return " ".join(f"{k}={v}" for k, v in knobs.items()
                    if v not in (None, "auto") and (k not in defaults or v != defaults[k]))


def print_topology(info: dict[str, Any], console: Console) -> None:
    """A topology's devices and link classes."""
    console.print(f"[bold]{info['name']}[/bold]: {info['description']}")
    console.print(f"{info['devices']} devices = {info['nodes']} node(s) x {info['devices_per_node']} "
                  f"in {info['domains']} domain(s); "
                  f"{info['device']['model']}, {info['device']['peak_bf16_tflops']} TFLOP/s BF16, "
                  f"{info['device']['memory_GB']:.0f} GB; kernel table {info['device']['kernel']}")
    table = Table(title="links by class (per direction)", title_justify="left")
    for col in ("class", "links", "usable GB/s", "latency us", "per-flow cap GB/s", "kappa"):
        table.add_column(col, justify="right" if col != "class" else "left")
    for row in info["link_classes"]:
        table.add_row(row["class"], str(row["links"]), row["GBps"], row["latency_us"], row["flow_cap_GBps"],
                      f"{row['kappa']:.2f}")
    console.print(table)
    net = info.get("network") or {}
    if info["nodes"] > 1 and net:
        if net["kind"] == "rail":
            how = ("NVLink to the source node's GPU on the destination's rail, then that GPU's NIC (PXN)"
                   if net["cross_rail"] == "pxn" else
                   "leaf -> spine -> leaf, " + (f"{net['spine_oversubscription']:g}:1 oversubscribed"
                                                  if net['spine_oversubscription'] > 1 else "non-blocking")
                   + f" (+{net['spine_latency_us']:g} us)")
            console.print(f"network: rail-optimised, {net['rails']} rails (NIC k on leaf k); same-rail traffic stays "
                          f"in its leaf; cross-rail: {how}")
        else:
            console.print(f"network: non-blocking switch ({net['latency_us']:g} us)")
    overhead = info.get("p2p_overhead_us")
    routes = Table(title="example routes" + (f" (latency: the software's {overhead:g} us a message + the hops')"
                                             if overhead else ""), title_justify="left")
    for col in ("from", "to", "hops", "GB/s", "latency us"):
        routes.add_column(col)
    for r in info["routes"]:
        routes.add_row(str(r["src"]), str(r["dst"]), " -> ".join(r["path"]), f"{r['GBps']:.4g}",
                       f"{r['latency_us']:.3g}")
    console.print(routes)


def print_batch(body: dict[str, Any], console: Console) -> None:
    """``plan-batch``: the plan beside per-document zigzag Ring and the best fixed method."""
    role_text = {"plan": "doc-place plan", "per_doc_ring": "per-document Ring", "best_fixed": "best fixed method",
                 "other": "other"}
    docs = body["documents"]
    batch = f", batch {body['batch']}" if body.get("batch", 1) > 1 else ""
    console.print(f"{docs} document{'s' if docs != 1 else ''}, {body['tokens']} tokens{batch} on "
                  f"{body['topology']['name']} x {body['ranks']}")
    table = Table()
    for name, justify in (("", "left"), ("method", "left"), ("settings", "left"), ("fwd", "right"),
                          ("bwd", "right"), ("total", "right"), ("vs best", "right")):
        table.add_column(name, justify=justify)
    best = body["best"]["predicted"]["makespan_s"]
    for c in body["candidates"]:
        p = c["predicted"]
        mark = "*" if c == body["best"] else ""
        table.add_row(role_text[c["role"]] + mark, _method(c), knob_text(c["knobs"], c["algorithm"]),
                      fmt_or_dash(p.get("fwd_s"), fmt_seconds), fmt_or_dash(p.get("bwd_s"), fmt_seconds),
                      fmt_seconds(p["makespan_s"]), f"{p['makespan_s'] / best:.2f}x")
    console.print(table)
    plan = body["candidates"][0]
    cached = " (from the cache)" if body["cached"] else ""
    how = "simulate" if plan["model_level"] == "simulated" else "estimate"
    console.print(f"* fastest: {_method(body['best'])}; doc-place took {fmt_seconds(body['plan_s'])} to plan "
                  f"(place, build, verify, {how}){cached}")
    if plan["model_level"] != "simulated":
        console.print("doc-place's time is the contended closed form (docs/cost-model.md; --simulate to simulate "
                      "it); the references are simulated")
    if plan != body["best"]:
        console.print(f"doc-place is {plan['predicted']['makespan_s'] / best:.2f}x the fastest's time here")
    for note in body.get("notes", []):
        console.print(f"note: {note}")
    if "schedule_path" in body:
        console.print(f"doc-place plan written to {body['schedule_path']}")


def _method(c: dict[str, Any]) -> str:
    """``algorithm layout`` (the layout left out where the method plans its own: doc-place)."""
    return c["algorithm"] if c["layout"] == c["algorithm"] else f"{c['algorithm']} {c['layout']}"


def print_distribution(body: dict[str, Any], console: Console) -> None:
    """``search --doc-lengths``: fixed methods and per-batch planning by mean step time over the packs."""
    docs = body["documents_per_pack"]
    span = f"{min(docs)}" if min(docs) == max(docs) else f"{min(docs)}-{max(docs)}"
    console.print(f"{body['batches']} packs of {body['seq_len']} tokens ({span} documents) drawn "
                  f"from {body['histogram']}, on {body['topology']['name']} x {body['ranks']}")
    table = Table()
    for name, justify in (("#", "right"), ("method", "left"), ("settings", "left"), ("mean", "right"),
                          ("p90", "right"), ("vs per-batch", "right")):
        table.add_column(name, justify=justify)
    rows = body["rows"]
    per_batch = next(r for r in rows if r["role"] == "per_batch")
    for i, r in enumerate(rows, start=1):
        method = "per-batch planning" if r["role"] == "per_batch" else _method(r)
        table.add_row(str(i), method, knob_text(r["knobs"], r["algorithm"]), fmt_seconds(r["mean_s"]),
                      fmt_seconds(r["p90_s"]), f"{r['mean_s'] / per_batch['mean_s']:.2f}x")
    console.print(table)
    fixed = [r for r in rows if r["role"] == "fixed"]
    if fixed:
        gain = fixed[0]["mean_s"] / per_batch["mean_s"] - 1
        verdict = (f"per-batch planning is {gain + 1:.2f}x faster than the best fixed method ({_method(fixed[0])}) "
                   "on average" if gain > 0.005 else f"per-batch planning does not pay here: the best fixed method "
                   f"({_method(fixed[0])}) is within {max(gain, 0):.1%} of it")
        console.print(verdict)
