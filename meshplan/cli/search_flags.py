"""``search``'s own flags: their options (typer ``Annotated`` types, as :mod:`meshplan.cli.options` holds the
shared ones), and their checks before anything runs — each refusal one line naming the flag (exit 2)."""

from __future__ import annotations

from typing import Annotated, Optional

import typer

Algos = Annotated[Optional[str], typer.Option("--algos", help="comma-separated algorithm names")]
Top = Annotated[int, typer.Option("--top", help="rows shown")]
Wide = Annotated[bool, typer.Option("--wide", help="every column (algorithm, layout and knobs apart, bytes, "
                                    "compute/communication)")]
Write = Annotated[int, typer.Option("--write", help="best schedules written (0: none)")]
Out = Annotated[str, typer.Option("--out", help="directory for written schedules")]
Scheduler = Annotated[str, typer.Option("--scheduler", help="greedy | ilp (CP-SAT stream orders for the best "
                                        "candidates, re-simulated) | auto (CP-SAT where greedy is more than 3% "
                                        "above the bound)")]
IlpTimeLimit = Annotated[float, typer.Option("--ilp-time-limit-s", help="CP-SAT time limit per candidate, seconds")]
IlpWorkers = Annotated[int, typer.Option("--ilp-workers", help="CP-SAT workers (0: one per core)")]
MapSearch = Annotated[int, typer.Option("--map-search", help="rank -> GPU placement search: simulations per written "
                                        "candidate (0: off)")]
MemoryLimit = Annotated[Optional[str], typer.Option("--memory-limit", help="bytes per GPU the memory model must fit "
                                                    "(80GiB, 64GB, ...; default: the device's memory)")]
PruneSlack = Annotated[float, typer.Option("--prune-slack", help="prune within this fraction of the best (0: exact)")]


def memory_limit_bytes(text: str | None) -> float | None:
    """``--memory-limit`` in bytes (None: not given); a bare number under 1 MB is refused as a missing unit."""
    from meshplan.core.errors import UserError
    from meshplan.core.units import parse_bytes

    if not text:
        return None
    limit = parse_bytes(text, "--memory-limit")
    if limit < 1e6:
        raise UserError("--memory-limit", f"{text} is {limit:g} bytes, less than 1 MB per GPU",
                        f"give a unit: --memory-limit {text}GB or {text}GiB")
    return limit


def check_search_flags(gpus, scheduler, ilp_time_limit_s, ilp_workers, write, top, map_search, prune_slack,
                       out) -> None:
    """``search``'s own flags, before anything runs (UserError: one line naming the flag); ``out`` must be a
    directory this process can write into when schedules are written."""
    from meshplan.core.errors import UserError
    from meshplan.core.fileio import check_writable

    if gpus is None:
        raise UserError("--gpus", "search needs a GPU count", "give --gpus N")
    if scheduler not in ("greedy", "ilp", "auto"):
        raise UserError("--scheduler", f"unknown scheduler {scheduler!r}", "use greedy, ilp or auto")
    if not 0 < ilp_time_limit_s <= 86400:
        raise UserError("--ilp-time-limit-s", f"{ilp_time_limit_s} is not a time limit",
                        "give seconds, more than 0 and at most 86400 (e.g. 10)")
    if not 0 <= ilp_workers <= 256:
        raise UserError("--ilp-workers", f"{ilp_workers} workers", "give 0 (one per core) to 256")
    if write < 0:
        raise UserError("--write", f"{write} is negative", "give a count of 0 or more")
    if top < 1:
        raise UserError("--top", f"{top} rows", "give 1 or more (the text under the table speaks of #1)")
    if map_search < 0:
        raise UserError("--map-search", f"{map_search} is negative", "give a number of simulations (0: off)")
    if map_search and gpus > 64:
        raise UserError("--map-search", f"placement search is for up to 64 ranks, not {gpus}", "drop --map-search")
    if not 0 <= prune_slack < 1:
        raise UserError("--prune-slack", f"{prune_slack} is outside [0, 1)", "give a fraction such as 0.01")
    if write > 0:
        check_writable(out, "--out", directory=True)
