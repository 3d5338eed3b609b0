"""The search's human output (``meshplan search``): the ranked table — compact, or every column with ``--wide`` —
and what is said under it: the lead over #2 and over Ring's best setting, why (in words), what keeps the pick
from being proven the best, the framework rows and the inference rule. Units converted here only."""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.table import Table

from meshplan.core.units import fmt_bytes, fmt_seconds
from meshplan.search.ranking import NEAR_TIE, reference_slack
from meshplan.show.tables import fmt_or_dash, knob_text


def plan_text(c: dict[str, Any]) -> str:
    """A candidate as one phrase: algorithm, layout, the knobs that differ from the defaults."""
    return f"{c['algorithm']} {c['layout']} {knob_text(c['knobs'], c['algorithm'])}".strip()


def print_search(body: dict[str, Any], console: Console, top: int, wide: bool = False) -> None:
    """The ranked candidates of a search: a compact table (the plan in one column, which wraps; times, exposed
    communication, inter-node bytes, peak memory) that fits 100 columns, or with ``wide`` every column; then
    what is said under it (:func:`_print_notes`)."""
    console.print(f"{body['topology']['name']} x {body['n_ranks']} ranks; {_workload_text(body['workload'])}")
    table = _search_table(body, top, wide, narrow=not wide and console.width < NARROW_COLUMNS)
    if wide:                               # every column at its natural width: wider than the terminal if need be
        from rich.measure import Measurement
        need = Measurement.get(console, console.options.update(width=10_000), table).maximum
        was = console.width
        console.width = max(need, was)
        try:
            console.print(table)
        finally:
            console.width = was
    else:
        console.print(table)
    _print_notes(body, console)


_WIDE = (("#", "right"), ("algorithm", "left"), ("layout", "left"), ("knobs", "left"), ("level", "left"),
         ("time", "right"), ("fwd", "right"), ("bwd", "right"), ("exposed comm", "right"), ("bytes/GPU", "right"),
         ("inter-node/GPU", "right"), ("comp/comm", "right"), ("peak mem (+ws)", "right"))
_COMPACT = (("#", "right"), ("plan", "left"), ("time", "right"), ("fwd", "right"), ("bwd", "right"),
            ("exposed\ncomm", "right"), ("inter-node\nper GPU", "right"), ("peak\nmemory", "right"))


#: a terminal narrower than this: the compact table leaves out the passes' times (the plan column keeps its words)
NARROW_COLUMNS = 96
_PASS_COLUMNS = ("fwd", "bwd")


def _search_table(body: dict[str, Any], top: int, wide: bool, narrow: bool = False) -> Table:
    """The top ``top`` rows (and Ring's reference row under them when it is not among them); ``narrow``: without
    the fwd and bwd columns."""
    table = Table()
    for col, just in _WIDE if wide else _COMPACT:
        if narrow and col in _PASS_COLUMNS:
            continue
        # only the plan (or knobs) column wraps; numbers and names are never cut
        table.add_column(col, justify=just, no_wrap=col not in ("plan", "knobs"), overflow="fold")
    solver = any(c["scheduler"]["requested"] != "greedy" for c in body["candidates"])
    if solver:
        table.add_column("order kept (CP-SAT status, gap to its own bound)", justify="left", overflow="fold")
    job = body.get("job")
    if job:
        table.add_column(f"job: {job['groups']} CP groups at once", justify="right")
    docs = any("documents" in c for c in body["candidates"])
    if docs:
        table.add_column("segments/rank, tile waste", justify="right")
    ref, shown = body.get("reference"), body["candidates"][:top]
    rows = list(enumerate(shown, start=1))
    if ref is not None and ref not in shown:          # Ring's best setting, the reference everyone knows
        rows.append(("ring", ref))
    for i, c in rows:
        if i == "ring":
            table.add_section()
        table.add_row(*_row(str(i), c, body["workload"]["passes"], wide, narrow),
                      *([_order_text(c["scheduler"])] if solver else []),
                      *([fmt_or_dash((c.get("job") or {}).get("together_s"), fmt_seconds)] if job else []),
                      *([_doc_text(c.get("documents"))] if docs else []))
    return table


def _row(label: str, c: dict[str, Any], passes: str, wide: bool, narrow: bool = False) -> tuple[str, ...]:
    """One candidate's cells; lower bounds (unsimulated) shown with ≥; ``narrow``: no fwd and bwd cells."""
    p = c["predicted"]
    sim = c["model_level"] == "simulated"
    t = fmt_seconds if sim else (lambda x: "≥" + fmt_seconds(x))
    part = lambda name: (p["makespan_s"] if passes == name else  # noqa: E731  (a single-pass search: its total)
                         (p.get(name) or {}).get("makespan_s"))  # (bwd null: forward-only)
    times = (fmt_or_dash(p["makespan_s"], t), fmt_or_dash(part("fwd"), t), fmt_or_dash(part("bwd"), t),
             fmt_or_dash(p["exposed_comm_s"], fmt_seconds))
    cross, peak = (fmt_or_dash(p["inter_node_bytes_per_gpu_max"], fmt_bytes),
                   fmt_or_dash(p.get("peak_memory_total_bytes"), fmt_bytes))
    if not wide:
        total, _, _, exposed = times
        return (label, plan_text(c), *((total, exposed) if narrow else times), cross, peak)
    return (label, c["algorithm"], c["layout"], knob_text(c["knobs"], c["algorithm"]), "sim" if sim else "bound",
            *times, fmt_or_dash(p["comm_bytes_per_gpu_max"], fmt_bytes), cross,
            fmt_or_dash(p["compute_to_comm"], lambda x: f"{x:.3g}"), peak)


def _print_notes(body: dict[str, Any], console: Console) -> None:
    """What is said under the table: documents, what keeps the pick unproven, the leads, why, written files, the
    counts, the job, the inference rule and the framework rows."""
    counts, job = body["counts"], body.get("job")
    if any("documents" in c for c in body["candidates"]):
        console.print(_doc_legend(body["candidates"]))
    for u in body.get("not_proven", []):
        best = fmt_seconds(body["candidates"][0]["predicted"]["makespan_s"])
        guess = (f"; its contended estimate (the simulator's sharing rules without its event loop) is "
                 f"{fmt_seconds(u['estimate_s'])}") if u.get("estimate_s") is not None else ""
        console.print(f"not proven best: #{u['rank']} ({u['algorithm']}) has a lower bound of "
                      f"{fmt_seconds(u['bound_s'])}, below #1's {best}, and was not simulated ({u['reason']})"
                      f"{guess}; time it alone:")
        for line in command_lines(u["simulate"], console.width):
            console.print(line, soft_wrap=True, markup=False, highlight=False)
    unproven = tuple(u["rank"] for u in body.get("not_proven", []))
    for line in (_lead_text(body["candidates"], body["n_ranks"], counts.get("prune_slack", 0.0), unproven),
                 _bounds_only_text(body), _vs_ring_text(body), *why_lines(body)):
        if line:
            console.print(line)
    for i, c in enumerate(body["candidates"], start=1):
        m = c.get("mapping_search")
        if m:
            console.print(f"#{i} placement search: {fmt_seconds(m['start_s'])} -> {fmt_seconds(m['best_s'])} "
                          f"({m['gain']:.1%}, {m['swaps']} swaps in {m['evals']} simulations, {m['wall_s']:.1f} s); "
                          f"rank -> device {m['device_of_rank']}")
        if c["schedule_path"]:
            console.print(f"#{i} written to {c['schedule_path']}")
    for r in body.get("rejected", []):
        if r.startswith("not written:"):
            console.print(r)
    skipped = ", ".join(f"{v} {k}" for k, v in counts["skipped"].items()) or "none"
    unsim = "".join(f", {v} not simulated: {k}" for k, v in counts.get("not_simulated", {}).items())
    console.print(f"{counts['enumerated']} enumerated, {counts['simulated']} simulated, {counts['pruned']} left at "
                  f"their closed-form bound (prune slack {counts['prune_slack']:.0%}{unsim}); skipped: {skipped}; "
                  f"searched in {body['wall_s']:.2f} s")
    if job:
        console.print(f"job TP {job['tp']} x CP {job['cp']} x DP {job['dp']} ({job['order']}, innermost first) on "
                      f"{job['topology']['devices']} GPUs: time = one CP group as planned (on {job['cp']} devices of "
                      f"one topology; job.alone_s in --json is it on its real GPUs); the best {job['ranked_as_job']} "
                      f"(each method's best among them) re-ranked by all {job['groups']} groups at once")
    if body.get("inference"):
        print_inference(body["inference"], console)
    if body.get("frameworks"):
        print_frameworks(body["frameworks"], console)


def command_lines(command: str, width: int) -> list[str]:
    """A shell command over lines of at most ``width`` columns, broken before its flags with ``\\`` continuations,
    so it pastes into a shell as it is (a flag and its value stay on one line)."""
    head, *flags = command.split(" --")
    lines, line = [], "  " + head
    for flag in ("--" + f for f in flags):
        if len(line) + 1 + len(flag) + 2 > width:
            lines.append(line + " \\")
            line = "    " + flag
        else:
            line += " " + flag
    return lines + [line]


def _doc_legend(candidates: list[dict[str, Any]]) -> str:
    count = next(c["documents"]["count"] for c in candidates if c.get("documents"))
    return (f"{count} documents: each runs as its own kernel segments; tile waste = the tiles the kernels compute "
            "(every segment rounded up to the kernel's tile) over the permitted pairs, forward")


def _doc_text(d: dict[str, Any] | None) -> str:
    if not d:
        return "-"
    waste = d.get("tile_waste")
    return f"{d['segments']:,}, " + ("-" if waste is None else f"{waste:.2f}x")


#: up to this many ranks a search builds every method's schedule whole, so --write N writes the N best (above, a
#: pick USP and the like is named with the `simulate … --out` that writes it: BuiltTiming.search_max_ranks)
WRITES_WHOLE_MAX_RANKS = 256


#: #2 within this fraction of #1's time (0.0% printed): the same time, said so — no lead, no "beats"
SAME_TIME = 5e-4


def _lead_text(candidates: list[dict[str, Any]], n_ranks: int, prune_slack: float = 0.0,
               unproven: tuple[int, ...] = ()) -> str | None:
    """How far #1 (simulated) leads #2 — at least that far when #2 was left at its closed-form lower bound; where
    that bound lies under #1's time (by less than ``prune_slack``: the search left it there), how far #2 could be
    ahead — and a near-tie warning under :data:`~meshplan.search.ranking.NEAR_TIE`: a margin smaller than the
    model's error does not say which is faster, so run both — here as CPU ranks up to this host's limit, else on
    the cluster. None without a simulated #1 and a #2, or where #2 is in ``unproven`` (the ranks the not-proven
    lines name)."""
    if len(candidates) < 2 or candidates[0]["model_level"] != "simulated":
        return None
    a, b = (c["predicted"].get("makespan_s") for c in candidates[:2])
    if a is None or b is None or a <= 0:          # a forward-only row of a fwd+bwd search has no total
        return None
    bound = candidates[1]["model_level"] != "simulated"
    gap = (b - a) / a
    if gap < 0 and (not bound or 2 in unproven):    # a bound far below the pick: said by the not-proven line
        return None
    if gap < 0:
        text = (f"#2's lower bound is {-gap:.1%} under #1's time: within the prune slack ({prune_slack * 100:g}%), so "
                f"it was not simulated and can beat #1 by at most that")
    elif gap < SAME_TIME and not bound:
        text = "#1 and #2 take the same time (predicted)"
    else:
        text = (f"#1 leads #2 by {'at least ' if bound else ''}{gap:.1%} (predicted"
                f"{'; #2 at its closed-form lower bound' if bound else ''})")
    if abs(gap) < NEAR_TIE:
        from meshplan.search.run_memory import cpu_max_ranks
        runs = "then meshplan run each" if n_ranks <= cpu_max_ranks() else \
            "then run each on the cluster under torchrun: docs/running.md"
        again = "both are written below" if candidates[1].get("schedule_path") else \
            "this search again with --write 2" if n_ranks <= WRITES_WHOLE_MAX_RANKS else \
            "this search again with --write 2 writes each or names the `meshplan simulate … --out` that does"
        text += (f"; {'proven only that far: ' if bound and gap >= 0 else ''}under {NEAR_TIE:.0%} that is a near-tie, "
                 f"closer than the model's error (docs/accuracy.md): run both ({again}, {runs}) to pick")
    return text


#: exposed communication under this fraction of the time: the plan is compute-bound
COMPUTE_BOUND = 0.1


def why_lines(body: dict[str, Any]) -> list[str]:
    """What decides the workload on this cluster, in words, from #1's predicted metrics (both simulated): compute-
    or communication-bound, the bytes it moves across nodes per GPU against Ring's, the memory headroom, and what
    makes up its lead over #2 (compute or exposed communication)."""
    cands = body["candidates"]
    if not cands or (cands[0].get("predicted") or {}).get("makespan_s") is None:    # none, or forward-only
        return []
    one = cands[0]["predicted"]
    t, exposed = one["makespan_s"], one["exposed_comm_s"] or 0.0
    lines = []
    if cands[0]["model_level"] == "simulated":
        why, ts = "why", fmt_seconds(t)
    else:                 # nothing simulated: #1 by its bound, whose parts say the same things at least
        why, ts = "why (by the closed forms: nothing was simulated)", f"≥{fmt_seconds(t)}"
    if exposed < COMPUTE_BOUND * t:
        head = (f"{why}: compute-bound — #1's communication hides behind its kernels ({fmt_seconds(exposed)} of "
                f"{ts} exposed)")
    elif exposed < 0.5 * t:
        head = (f"{why}: mostly compute — {fmt_seconds(exposed)} of #1's {ts} is communication its "
                "kernels cannot hide")
    else:
        head = (f"{why}: communication-bound — {fmt_seconds(exposed)} of #1's {ts} is communication its "
                "kernels cannot hide")
    ref = body.get("reference")
    cross = one.get("inter_node_bytes_per_gpu_max")
    if ref is not None and ref != cands[0] and cross is not None:
        theirs = ref["predicted"].get("inter_node_bytes_per_gpu_max")
        if theirs:
            head += f"; it moves {fmt_bytes(cross)} across nodes per GPU, Ring {fmt_bytes(theirs)}"
    memory = (body["topology"].get("memory_bytes") or 0)
    peak = one.get("peak_memory_total_bytes")
    if memory and peak:
        head += f"; memory {fmt_bytes(peak)} of {fmt_bytes(memory)} per GPU"
    lines.append(head)
    if len(cands) > 1 and cands[1]["model_level"] == "simulated":
        two = cands[1]["predicted"]
        d_compute = (two.get("compute_s") or 0.0) - (one.get("compute_s") or 0.0)
        d_comm = (two["exposed_comm_s"] or 0.0) - exposed
        gap = two["makespan_s"] - t
        if gap >= SAME_TIME * t:                    # equal times: nothing beats anything
            what = "exposed communication" if d_comm >= d_compute else "compute on the critical rank"
            lines.append(f"#1 beats #2 ({plan_text(cands[1])}) mostly by {what}: compute "
                         f"{fmt_seconds(one.get('compute_s') or 0.0)} vs {fmt_seconds(two.get('compute_s') or 0.0)}, "
                         f"exposed communication {fmt_seconds(exposed)} vs {fmt_seconds(two['exposed_comm_s'] or 0.0)}")
    return lines


def _bounds_only_text(body: dict[str, Any]) -> str | None:
    """Where nothing in the table was simulated (above the sizes a search builds schedules at): that every row is
    a lower bound and #1 has the least, which proves nothing about which is fastest. None otherwise."""
    cands = body["candidates"]
    if not cands or any(c["model_level"] == "simulated" for c in cands):
        return None
    return ("nothing was simulated (the counts below say why): every row is a closed-form lower bound (≥), ranked "
            "by it — #1 has the least, not proven the fastest; `meshplan simulate --algo` with a row's knobs times it "
            "alone")


def _vs_ring_text(body: dict[str, Any]) -> str | None:
    """The pick's lead over Ring's best setting (the ``ring`` row, or its rank in the table) — "to within 3%" where
    another Ring setting was left at a lower bound under its time (:func:`~meshplan.search.ranking.reference_slack`);
    where Ring is not simulated, over every Ring setting (the row holds the least of their lower bounds)."""
    ref, cands = body.get("reference"), body["candidates"]
    if ref is None or not cands or cands[0] == ref or (cands[0].get("predicted") or {}).get("makespan_s") is None:
        return None
    a, b = cands[0]["predicted"]["makespan_s"], ref["predicted"]["makespan_s"]
    sim = ref["model_level"] == "simulated"
    where = f"#{cands.index(ref) + 1}" if ref in cands[:10] else "the ring row"
    if cands[0]["model_level"] != "simulated":      # two lower bounds: their ratio claims nothing about either time
        return (f"Ring's settings: the least of their lower bounds is {fmt_seconds(b)} ({where}: {plan_text(ref)}), "
                f"{b / a:.2f}x #1's" if a > 0 else None)
    if not sim:             # Ring not simulated here (above 256 ranks): its settings' least bound, a claim on all
        return (f"#1 is at least {b / a:.2f}x as fast as any Ring setting ({where}: {plan_text(ref)}, the least of "
                f"their lower bounds, {fmt_seconds(b)})")
    close = any(c["algorithm"] == "ring" and c["model_level"] != "simulated" and c["bound_s"] < b for c in cands)
    within = f" to within {reference_slack(body['counts'].get('prune_slack', 0.0)) * 100:g}%" if close else ""
    return (f"#1 is {b / a:.2f}x as fast as Ring's best setting{within} ({where}: {plan_text(ref)}, {fmt_seconds(b)} "
            "simulated)")


def print_inference(inf: dict[str, Any], console: Console) -> None:
    """Meta's pass-KV / pass-Q rule beside the simulated best of each (search with --prefix-len)."""
    rule, sim = inf["rule"], inf["simulated"]
    times = ", ".join(f"{k} {fmt_seconds(v['time_s'])}" for k, v in sim.items())
    verdict = ("agrees" if inf["agree"] else f"disagrees (its pick is {inf['rule_regret_pct']:.1f}% slower)") \
        if inf["agree"] is not None else "cannot be compared (one method only)"
    console.print(f"inference, {inf['prefix_len']} cached + {inf['new_tokens']} new tokens: Meta's rule picks "
                  f"{rule['choice']} ({rule['reason']}); simulated: {times}; the rule {verdict}")


def print_frameworks(frameworks: list[dict[str, Any]], console: Console) -> None:
    """Each framework's best setting, its predicted time and its ratio to the search's best plan."""
    timed = any(f["settings"] is not None for f in frameworks)
    table = Table(title="the best setting each framework offers (simulated; its settings below)" if timed else
                  "what each framework offers (no setting timed at this size)", title_justify="left")
    for col, just in (("framework", "left"), ("plan", "left"), ("time", "right"), ("vs best", "right")):
        table.add_column(col, justify=just, overflow="fold", no_wrap=col in ("time", "vs best"))
    for f in frameworks:
        if f["settings"] is None:
            waiting = len(f.get("not_evaluated", []))      # settings it can run, left untimed at this size
            table.add_row(f["framework"], f"not evaluated at this size: {waiting} setting{'s' * (waiting > 1)} it "
                          "can run (--json lists them)" if waiting else f"not expressible: {f['reason']}", "-", "-")
            continue
        table.add_row(f["framework"], plan_text(f), fmt_seconds(f["time_s"]),
                      fmt_or_dash(f["vs_best"], lambda x: f"{x:.2f}x"))
    console.print(table)
    for f in frameworks:                   # whole, one per line, so each copies as it is
        if f["settings"] is not None:
            console.print(f"{f['framework']}:")
            for line in _setting_lines(f["cli"]):
                console.print(f"  {line}", overflow="fold")
    for f in frameworks:
        if f["expresses_best"]:
            console.print(f"the best plan in {f['framework']}: {f['expresses_best']}")
    left = sum(len(f.get("not_evaluated", [])) for f in frameworks)
    if left:
        console.print(f"{left} framework settings were not evaluated at this size (--json lists them, each with "
                      "why and the simulate command that times it)")
    faster = [f for f in frameworks if f["settings"] is not None and f["vs_best"] is not None and f["vs_best"] < 1]
    lossy = [f for f in faster if (f.get("knobs") or {}).get("dkv_dtype") not in (None, "fp32")]
    for f in lossy:
        console.print(f"vs best < 1 for {f['framework']}: its plan sends dK/dV in {f['knobs']['dkv_dtype']} (lossy); "
                      "the search keeps fp32 gradients on the wire unless given --dkv-dtype bf16")
    if any(f not in lossy for f in faster):
        console.print("vs best < 1: that setting's plan is outside what search enumerates (knobs it keeps at their "
                      "defaults); pin them with the knob flags to rank it")


def _setting_lines(cli: str) -> list[str]:
    """A framework's settings one per line, whole: command-line flags (``--name value ...``) or ``key=value``
    pairs, so a reader copies each without a line break inside it."""
    if cli.lstrip().startswith("--"):
        return ["--" + part.strip() for part in cli.strip().split("--") if part.strip()]
    return cli.split()


def _order_text(s: dict[str, Any]) -> str:
    """The order kept, and the solver's status and gap in its own model."""
    if s["status"] == "not_run":
        return f"{s['kept']} (not run: {s['reason']})" if s.get("reason") else f"{s['kept']} (not run)"
    gap = f", gap {s['gap']:.1%}" if s["gap"] is not None else ""
    return f"{s['kept']} ({s['status']}{gap}, {s['solve_s']:.1f} s)"


def _workload_text(w: dict[str, Any]) -> str:
    from meshplan.core.units import fmt_count
    return (f"{w.get('model') or 'custom'} B={w['batch']} S={fmt_count(w['seq_len'])} H={w['n_heads']} "
            f"Hkv={w['n_kv_heads']} D={w['head_dim']} {w['dtype']} {w['mask']} {w['layout']} {w['passes']}")


