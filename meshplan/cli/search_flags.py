"""``search``'s own flags checked before anything runs: each refusal one line naming the flag (exit 2)."""

from __future__ import annotations


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
