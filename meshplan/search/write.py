"""Verify and write the search's best schedules (``search --write K``): the last step of the search pipeline.

Each schedule is verified in a forked process while it is encoded to a staging file (``.unverified-NAME`` in the
output directory), and renamed to its name only once verified: a file never stands under its name unverified,
and a refused one leaves nothing. :func:`written_best` leaves the search result as it was, so the pipeline can run
it in a forked process beside the frameworks' settings and record its outcome with :func:`apply_written`;
:class:`EarlyWrite` stages the branch and bound's leader as soon as it leads, while the search goes on.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from meshplan import algorithms
from meshplan.core.errors import UserError
from meshplan.core.parallel import alongside
from meshplan.plan.verify import verify
from meshplan.search.candidate import label, over_memory, short_label, simulate_command

if TYPE_CHECKING:
    from meshplan.model.topology import Topology
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
    paths: dict[int, str] = {}
    rejected: list[str] = []
    for rank, c in enumerate(result.candidates[:k], start=1):
        if c.forward_only:                    # listed for its forward; its schedule is no training step
            rejected.append(f"not written: #{rank} {short_label(c)}: it has no backward pass (this search times "
                            "forward and backward; search --pass fwd writes it)")
            continue
        _record(stage_schedule(rank, c, result.topology, result.memory_limit, out_dir), rank - 1, paths, rejected)
    return paths, rejected


def _record(got: Staged, index: int, paths: dict[int, str], rejected: list[str]) -> None:
    """A staged schedule renamed into place (its path under ``index``), or its message."""
    if got.message is not None:
        rejected.append(got.message)
    if got.staged is not None:
        paths[index] = got.commit()


class EarlyWrite:
    """The pick verified and encoded while the search goes on: :meth:`lead` is :func:`~meshplan.search.run_search`'s
    ``on_leader``. The candidate the branch and bound simulates first (as soon as its schedule is built) and each new
    leader whose schedule is at hand is staged at once in a forked process
    (:func:`meshplan.core.parallel.start_beside`, in a process group of its own, at the lowest CPU priority: the
    search and the frameworks' table, which the run waits for first, take the cores they want and the staging the
    cycles they leave — the main job 4.6 → 3.9 s, where the staging at equal priority took a third of both cores
    from the branch and bound); a staging overtaken by a faster
    leader is stopped and its file removed. The staged schedule is committed as #1 only if it is the search's pick
    (:meth:`collect`: Ring's reference settings or a later candidate may still beat it); else it is stopped, its
    staging file removed, and the pick written as usual. ``--write 1`` only (later rows may still move)."""

    def __init__(self, topo: Topology, out_dir: str) -> None:
        self.topo, self.out_dir = topo, out_dir
        self.leader = self.job = self.staged = None

    def lead(self, leader) -> None:
        """Stage ``leader`` (the branch and bound's best so far, or before its first simulation the candidate it
        simulates first) in a forked process, stopping the staging of the one it overtook; nothing where its schedule
        was not kept (simulated in another process: written as usual if it is the pick). Its memory is not checked
        here: a candidate the search's simulation finds over the limit never leads, so is never the pick."""
        if leader is None or leader is self.leader or leader.schedule is None:
            return
        self.discard()
        from meshplan.core.heap import release_freed_memory
        from meshplan.core.parallel import start_beside

        release_freed_memory()                              # the search's freed pages: not into the fork
        self.leader, self.staged = leader, _paths(1, leader, self.out_dir)[1]
        self.job = start_beside(lambda: stage_schedule(1, leader, self.topo, None, self.out_dir), own_group=True,
                                background=True)

    def discard(self) -> None:
        """Stop the staging process (if any: it and the verifier it forked) and remove what it staged, whatever
        became of it (interrupted: the caller's way out calls this): not to be written."""
        if self.job is None:
            return
        job, self.job, self.leader = self.job, None, None
        try:
            job.stop()
        finally:
            self.staged.unlink(missing_ok=True)

    def is_pick(self, result: SearchResult) -> bool:
        """Whether the staged schedule is ``result``'s pick (its #1)."""
        return self.job is not None and bool(result.candidates) and result.candidates[0] is self.leader

    def collect(self, result: SearchResult) -> tuple[dict[int, str], list[str]] | None:
        """#1 written (as :func:`written_best` gives it) when the staged schedule is ``result``'s pick; None (nothing
        written, the staging file removed) when nothing was staged or the pick is another.

        Raises:
            RuntimeError: the staged schedule failed verification (an internal error).
        """
        if not self.is_pick(result):
            self.discard()
            return None
        got = self.job.result()         # interrupted here, run_pipeline's discard() still removes the staging file
        self.job = None
        paths: dict[int, str] = {}
        rejected: list[str] = []
        _record(got, 0, paths, rejected)
        return paths, rejected


@dataclass
class Staged:
    """A schedule verified and encoded to its staging file ``staged``, to be renamed to ``target`` (:meth:`commit`),
    or removed (:meth:`drop`); ``message``: why it was not written (for ``SearchResult.rejected``; no file then)."""

    target: Path | None = None
    staged: Path | None = None
    message: str | None = None

    def commit(self) -> str:
        """Rename the verified file to its name; its path."""
        os.replace(self.staged, self.target)
        return str(self.target)

    def drop(self) -> None:
        """Remove the staging file (a schedule no longer to be written)."""
        if self.staged is not None:
            self.staged.unlink(missing_ok=True)


def stage_schedule(rank: int, c, topo: Topology, memory_limit: float | None, out_dir: str) -> Staged:
    """Verify candidate ``c``'s schedule (built here if it has none) while it is encoded to a staging file
    (``.unverified-NAME`` in ``out_dir``, the verification in a forked process: both cores), to be written as the
    table's #``rank``. Nothing is staged (only a message) for a schedule a search does not build at its size, or one
    over ``memory_limit``.

    Raises:
        RuntimeError: the schedule fails verification (an internal error); its staging file is removed.
    """
    from meshplan.cost.bounds import schedule_timing
    from meshplan.plan.json.io import write_schedule

    alg = algorithms.get(c.algorithm)
    if c.schedule is None and not alg.search_may_build(c.n_ranks):      # GBs: as the search, not built here
        alone = Path(out_dir) / f"{_stem(rank, c)}-{c.n_ranks}gpus.json.gz"    # not a smaller search's pick's name
        return Staged(message=f"not written: #{rank} {short_label(c)}: a search does not build its schedule above "
                              f"{alg.search_build_limit()} ranks; write it alone: {simulate_command(c, topo)} "
                              f"--out {alone}")
    if c.schedule is None:
        c.schedule = alg.schedule(c.plan, topo)
    if c.model_level != "simulated" and memory_limit is not None:    # its estimate fitted: check it
        peak = max(t.peak_memory_total_bytes for t in schedule_timing(c.schedule, topo).values())
        if peak > memory_limit:
            return Staged(message=f"not written: {over_memory(c, peak, memory_limit, 'its schedule')}")
    target, staged = _paths(rank, c, out_dir)
    # verified in a forked process while it is encoded to a staging file (both cores), renamed into place once
    # verified (commit): the file never stands under its name unverified
    try:
        report, _ = alongside(lambda s=c.schedule: verify(s, topo.memory_bytes),
                              lambda s=c.schedule, to=staged: write_schedule(s, to),
                              fork=len(c.schedule.ops) >= FORK_WRITE_MIN_OPS)
    except UserError as err:                  # cannot write there: named by the file the user asked for
        staged.unlink(missing_ok=True)
        raise UserError(str(target), err.problem, err.fix) from None
    except BaseException:
        staged.unlink(missing_ok=True)
        raise
    if not report.ok:
        staged.unlink(missing_ok=True)
    if report.over_memory_only:    # a --memory-limit above it
        return Staged(message=f"not written: {label(c)}: {report.violations[0]}")
    if not report.ok:
        raise RuntimeError(f"internal error: the {c.algorithm} schedule fails verification: {report.violations[0]}")
    return Staged(target, staged)


def _paths(rank: int, c, out_dir: str) -> tuple[Path, Path]:
    """(the file candidate ``c``'s built schedule is written to as #``rank``, its staging file: the same suffix)."""
    target = Path(out_dir) / (_stem(rank, c) + (".json.gz" if len(c.schedule.ops) > GZIP_MIN_OPS else ".json"))
    return target, target.with_name(f".unverified-{target.name}")


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
