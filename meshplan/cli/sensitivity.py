"""``search --sensitivity P``'s flags and table (:mod:`meshplan.search.sensitivity` does the work).

Only typer is imported at the top, so ``meshplan --help`` stays fast.
"""

from __future__ import annotations

from typing import Annotated, Any, Optional

import typer

PANEL = "Robustness (perturbed bandwidths, latencies, kernel efficiencies)"

Sensitivity = Annotated[Optional[float], typer.Option(
    "--sensitivity", rich_help_panel=PANEL, metavar="P",
    help="re-simulate the best plans with bandwidths (per link class), latencies (per link class) and kernel "
         "efficiencies (per pass) each scaled by a factor uniform in [1 - P/100, 1 + P/100]; 0 <= P < 100")]
Samples = Annotated[Optional[int], typer.Option("--sensitivity-samples", rich_help_panel=PANEL,
                                                help="perturbed samples drawn [default: 20]")]
Top = Annotated[Optional[int], typer.Option("--sensitivity-top", rich_help_panel=PANEL,
                                            help="best candidates judged (those left at their bound are simulated) "
                                                 "[default: 5]")]
Seed = Annotated[Optional[int], typer.Option("--sensitivity-seed", rich_help_panel=PANEL,
                                             help="seed of the samples (the same seed, the same samples) [default: 0]")]
Pick = Annotated[str, typer.Option(
    "--pick", rich_help_panel=PANEL,
    help="nominal: rank by the nominal prediction | robust: put first the judged plan with the smallest "
         "worst-case regret over the samples (ties: the smaller nominal time), the rest in nominal order")]


def print_sensitivity(body: dict[str, Any], console) -> None:
    """The ``sensitivity`` table of a search, if it has one."""
    from rich.table import Table

    from meshplan.core.units import fmt_seconds
    from meshplan.show.tables import knob_text

    s = body.get("sensitivity")
    if not s:
        return
    table = Table(title=f"sensitivity: ±{s['percent']:g}% on {', '.join(s['perturbed'])}, {s['samples']} samples "
                        f"(seed {s['seed']})", title_justify="left")
    for col, just in (("#", "right"), ("plan", "left"), ("nominal", "right"), ("best in", "right"),
                      ("regret mean", "right"), ("regret worst", "right"), ("p95", "right")):
        table.add_column(col, justify=just)
    for k, c in enumerate(s["candidates"]):
        mark = " (picked)" if s["pick"] == "robust" and k == s["picked"] else ""
        plan = f"{c['algorithm']} {c['layout']} {knob_text(c['knobs'], c['algorithm'])}".strip()
        table.add_row(str(c["rank"]), plan + mark, fmt_seconds(c["nominal_s"]), f"{c['best_fraction']:.0%}",
                      f"{c['regret_mean_pct']:.2f}%", f"{c['regret_worst_pct']:.2f}%", fmt_seconds(c["p95_s"]))
    console.print(table)
    console.print("# is the nominal rank; regret = time / the fastest of these in the same sample - 1"
                  + ("; --pick robust: the picked plan is #1 above" if s["pick"] == "robust" else ""))
