"""Verify and write the search's best schedules (``search --write K``): the last step of the search pipeline.

Each schedule is verified in a forked process while it is encoded to a staging file (``.unverified-NAME`` in the
output directory), and renamed to its name only once verified: a file never stands under its name unverified,
and a refused one leaves nothing. :func:`written_best` leaves the search result as it was, so the pipeline can run
it in a forked process beside the frameworks' settings and record its outcome with :func:`apply_written`.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import TYPE_CHECKING

from meshplan import algorithms
from meshplan.core.parallel import alongside
from meshplan.plan.verify import verify
from meshplan.search.candidate import label, over_memory, simulate_command

if TYPE_CHECKING:
    from meshplan.search import SearchResult

#: a schedule of this many ops is verified in a forked process while it is encoded (smaller: one after the other)
FORK_WRITE_MIN_OPS = 50_000
#: a schedule of more ops is written gzip-compressed (.json.gz)
GZIP_MIN_OPS = 50_000


def write_best(result: SearchResult, k: int, out_dir: str) -> None:
    """Verify and write the ``k`` best schedules (``.json``, or ``.json.gz`` past 50k ops): each written
    candidate's ``schedule_path`` set, each refused one in ``result.rejected``."""
    apply_written(result, written_best(result, k, out_dir))


def written_best(result: SearchResult, k: int, out_dir: str) -> tuple[dict[int, str], list[str]]:
    """:func:`write_best`'s work, ``result`` left as it was (but for schedules built): ({index in
    ``result.candidates``: path written}, messages for ``result.rejected``) — so it can run in a forked process.

    Raises:
        RuntimeError: a schedule fails verification (an internal error).
    """
    from meshplan.cost.bounds import schedule_timing
    from meshplan.plan.json.io import write_schedule

    topo = result.topology
    paths: dict[int, str] = {}
    rejected: list[str] = []
    for rank, c in enumerate(result.candidates[:k], start=1):
        alg = algorithms.get(c.algorithm)
        if c.schedule is None and not alg.search_may_build(c.n_ranks):      # GBs: as the search, not built here
            rejected.append(f"not written: #{rank} {label(c)}: a search does not build its schedule above "
                            f"{alg.search_max_ranks} ranks; write it alone: {simulate_command(c, topo)} "
                            f"--out {Path(out_dir) / _stem(rank, c)}.json.gz")
            continue
        if c.schedule is None:
            c.schedule = alg.schedule(c.plan, topo)
        if c.model_level != "simulated" and result.memory_limit is not None:    # its estimate fitted: check it
            peak = max(t.peak_memory_total_bytes for t in schedule_timing(c.schedule, topo).values())
            if peak > result.memory_limit:
                rejected.append(f"not written: {over_memory(c, peak, result.memory_limit, 'its schedule')}")
                continue
        target = Path(out_dir) / (_stem(rank, c) + (".json.gz" if len(c.schedule.ops) > GZIP_MIN_OPS else ".json"))
        staged = target.with_name(f".unverified-{target.name}")          # the same suffix: gzip or not
        # verified in a forked process while it is encoded to a staging file (both cores), renamed into place
        # once verified: the file never stands under its name unverified
        try:
            report, _ = alongside(lambda s=c.schedule: verify(s, topo.memory_bytes),
                                  lambda s=c.schedule, to=staged: write_schedule(s, to),
                                  fork=len(c.schedule.ops) >= FORK_WRITE_MIN_OPS)
        except BaseException:
            staged.unlink(missing_ok=True)
            raise
        if not report.ok:
            staged.unlink(missing_ok=True)
        if report.over_memory_only:    # a --memory-limit above it
            rejected.append(f"not written: {label(c)}: {report.violations[0]}")
            continue
        if not report.ok:
            raise RuntimeError(f"internal error: the {c.algorithm} schedule fails verification: {report.violations[0]}")
        os.replace(staged, target)
        paths[rank - 1] = str(target)
    return paths, rejected


def _stem(rank: int, c) -> str:
    """A written schedule's file name without its suffix: rank, method, layout, the knobs not at their default."""
    defaults = {k: kn.default for k, kn in algorithms.get(c.algorithm).knobs.items()}
    knobs = "-".join(re.sub(r"[^A-Za-z0-9.]", "", str(v).replace("auto:", "")) for k, v in c.knobs.items()
                     if v is not None and v != "auto" and v != defaults.get(k))
    layout = "" if c.workload.layout == c.algorithm else f"-{c.workload.layout}"     # doc-place: its own
    name = f"{rank:02d}-{c.algorithm}{layout}" + (f"-{knobs}" if knobs else "")
    if c.scheduler and c.scheduler.get("kept") == "ilp":
        name += "-cpsat"          # stream orders from CP-SAT, not the algorithm's own (its order knob)
    return name


def apply_written(result: SearchResult, written: tuple[dict[int, str], list[str]]) -> None:
    """Record :func:`written_best`'s outcome on ``result``."""
    paths, rejected = written
    for i, path in paths.items():
        result.candidates[i].schedule_path = path
    result.rejected.extend(rejected)
