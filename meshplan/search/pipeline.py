"""The search ``meshplan search`` runs, as one library call: :func:`run_pipeline` takes a :class:`SearchRequest`
and returns a :class:`SearchReport`; the CLI parses flags into the request and prints the report.

The steps, in order: enumerate, prune and simulate the candidates (:func:`meshplan.search.run_search`); the
frameworks' settings (:mod:`meshplan.search.frameworks`); the rank -> GPU placement search
(``map_search``); CP-SAT stream orders (``scheduler``); the sensitivity study; the re-rank by the whole job's
time (``job``); the inference rules; verifying and writing the best schedules — in a forked process beside the
frameworks' settings when no step after the search changes the ranking (both cores); with ``write`` 1, the branch
and bound's leader as soon as it leads, while the search goes on (:class:`~meshplan.search.write.EarlyWrite`).
``progress(done, total, label)`` is called as the steps go (``total`` None: a step without a count).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from meshplan.algorithms.base import SEARCH_BUILD_MAX_RANKS
from meshplan.core import host
from meshplan.core.errors import UserError
from meshplan.core.heap import keep_large_arrays, release_freed_memory
from meshplan.core.parallel import alongside, can_fork
from meshplan.model.topology import Topology
from meshplan.model.workload import Workload
from meshplan.plan.job import JobShape
from meshplan.search import PRUNE_SLACK, SearchResult, run_search, search_json
from meshplan.search.frameworks import FrameworkBest, framework_bests, frameworks_json
from meshplan.search.inference import rule_report
from meshplan.search.ranking import estimate_unproven
from meshplan.search.run_memory import check_search_fits
from meshplan.search.write import EarlyWrite, apply_written, write_best, written_best

Progress = Callable[[int, "int | None", str], None]


@dataclass(frozen=True)
class Sensitivity:
    """``search --sensitivity``: perturb the topology's parameters by ``percent`` % (``samples`` draws, the
    ``top`` candidates, ``seed``) and pick by ``pick`` (:mod:`meshplan.search.sensitivity`)."""

    percent: float
    samples: int = 20
    top: int = 5
    seed: int = 0
    pick: str = "nominal"


@dataclass(frozen=True)
class JobRerank:
    """``search --tp/--dp``: re-rank the best plans by the whole job's time on ``topology`` (the job's GPUs)."""

    shape: JobShape
    topology: Topology


@dataclass(frozen=True)
class SearchRequest:
    """Everything a search needs. ``gpus``: the CP group size; ``algos`` None: every method; ``filters``: knob
    values to hold fixed; ``layout_pinned``: search only ``workload.layout``; ``memory_limit_bytes`` None: the
    device's memory; ``write``: schedules to verify and write to ``out_dir`` (0: none); ``top``: how many the job
    re-rank considers (with ``write``); ``map_search``: placement-search simulations per written candidate (0:
    off); ``scheduler``: greedy | ilp | auto, with the CP-SAT limits."""

    workload: Workload
    topology: Topology
    gpus: int
    algos: tuple[str, ...] | None = None
    filters: dict[str, Any] = field(default_factory=dict)
    layout_pinned: bool = False
    memory_limit_bytes: float | None = None
    prune_slack: float = PRUNE_SLACK
    write: int = 0
    out_dir: str = "schedules"
    top: int = 10
    map_search: int = 0
    scheduler: str = "greedy"
    ilp_time_limit_s: float = 10.0
    ilp_workers: int = 0
    sensitivity: Sensitivity | None = None
    job: JobRerank | None = None


@dataclass(frozen=True)
class SearchReport:
    """What a search found: ``result`` (the ranked candidates, best first, each with its typed prediction), the
    frameworks' best settings, and the optional steps' reports (None when the step did not run)."""

    request: SearchRequest
    result: SearchResult
    frameworks: list[FrameworkBest]
    sensitivity: dict[str, Any] | None = None
    job: dict[str, Any] | None = None
    group_best_s: float | None = None
    inference: dict[str, Any] | None = None

    @property
    def best(self):
        """The pick (a :class:`~meshplan.search.candidate.Candidate`), or None when nothing could run."""
        return self.result.candidates[0] if self.result.candidates else None

    def json(self) -> dict[str, Any]:
        """The contract's ``search --json`` body, as a dict (``json.dumps`` it to print)."""
        body = search_json(self.result, self.request.scheduler)
        # the frameworks' plans are timed as one CP group: compare them with the best group time (not a job time)
        best_s = self.group_best_s if self.job is not None else body["candidates"][0]["predicted"].get("makespan_s")
        body["frameworks"] = frameworks_json(self.frameworks, best_s)
        body |= {k: v for k, v in (("inference", self.inference), ("job", self.job),
                                   ("sensitivity", self.sensitivity)) if v is not None}
        return body


def _writes_now(req: SearchRequest) -> bool:
    """Whether the best schedules can be written right after the search: no later step re-ranks or replaces
    them (mapping search, CP-SAT, a job re-rank), and none needs their schedules in this process (sensitivity,
    a documents mask's costs of written candidates left at a bound)."""
    return (not req.map_search and req.scheduler == "greedy" and req.sensitivity is None and req.job is None
            and req.workload.mask.kind != "docs")


def run_pipeline(request: SearchRequest, progress: Progress | None = None) -> SearchReport:
    """Run every step of the request (module docstring) and report.

    Raises:
        UserError: no plan fits the memory limit; the search's block arrays would not fit this host
            (:func:`~meshplan.search.run_memory.check_search_fits`); bad request values the steps check (CP-SAT,
            sensitivity).
    """
    say = progress or (lambda done, total, label: None)
    req = request
    check_search_fits(req.gpus, req.algos, host.available_memory_bytes())     # before anything is planned
    if req.gpus > SEARCH_BUILD_MAX_RANKS:
        _nothing_simulated_suits(req)
        keep_large_arrays()      # N x N temporaries of 134 MB: pages reused, not faulted in anew (4096: 100 → 77 s)
    early = req.write > 0 and _writes_now(req) and can_fork()
    pick = EarlyWrite(req.topology, req.out_dir) if early and req.write == 1 else None
    out = Path(req.out_dir)
    made = [d for d in (out, *out.parents) if not d.exists()] if req.write else []    # deepest first
    try:
        return _steps(req, say, early, pick)
    except BaseException:                     # an error, or Ctrl-C: an early-staged pick is not left behind ...
        if pick is not None:
            pick.discard()
        for d in made:                        # ... nor the directories made for it, where they are left empty
            try:
                d.rmdir()
            except OSError:
                break
        raise


def _nothing_simulated_suits(req: SearchRequest) -> None:
    """Above the size a search builds schedules at, refuse the steps that simulate the best plans (the sensitivity
    study, the job re-rank): they would build each whole there, minutes and GBs a plan.

    Raises:
        UserError: ``--sensitivity`` or ``--tp``/``--dp`` given.
    """
    for given, flag in ((req.sensitivity, "--sensitivity"), (req.job, "--tp")):
        if given is not None:
            raise UserError(flag, f"simulates the best plans, and a search builds none above {SEARCH_BUILD_MAX_RANKS} "
                            "GPUs (minutes and GBs each there)",
                            f"leave it out, or plan a CP group of at most {SEARCH_BUILD_MAX_RANKS} GPUs")


def no_candidate_error(result: SearchResult, algos) -> UserError:
    """Why a search has no candidate: the sequence's own error where the zigzag (or pinned) layout cannot split it
    (it names ``--seq-len`` and the padding), else the reasons every method was skipped for."""
    from meshplan.model.matrix import attn_matrix

    w = result.workload if result.layout_pinned else result.workload.with_(layout="zigzag")
    try:
        attn_matrix(w, result.n_ranks)
    except UserError as err:
        return err
    why = ", ".join(f"{v} {k}" for k, v in result.counts["skipped"].items()) or "none enumerated"
    return UserError("--algos" if algos else "--gpus", f"no candidate can run this workload (skipped: {why})",
                     "change the filters or the number of GPUs")


def _steps(req: SearchRequest, say: Progress, early: bool, pick: EarlyWrite | None) -> SearchReport:
    """:func:`run_pipeline`'s steps, ``early``: the write beside the frameworks, ``pick``: staged beside the search."""
    result = run_search(req.workload, req.topology, req.gpus, algos=list(req.algos) if req.algos else None,
                        filters=req.filters, layout_pinned=req.layout_pinned, memory_limit=req.memory_limit_bytes,
                        prune_slack=req.prune_slack, progress=say,
                        on_leader=pick.lead if pick is not None else None)
    if not result.candidates:
        if pick is not None:
            pick.discard()
        return SearchReport(req, result, [])
    say(0, None, "the frameworks' settings" + (f"; verifying and writing {req.write} schedule(s)" if early else ""))
    def bests_of():
        bests = framework_bests(result, list(req.algos) if req.algos else None, req.filters)
        estimate_unproven(result)          # what an unproven pick's rivals would likely take (seconds each)
        return bests

    written = None
    if pick is not None and pick.is_pick(result):           # staged beside Ring's reference: the frameworks now
        bests = bests_of()
        written = pick.collect(result)
    elif early:                                             # the write beside the frameworks: both cores
        if pick is not None:
            pick.discard()                                  # staged, but not the pick
        release_freed_memory()                              # the search's freed pages: not into the forks
        written, bests = alongside(lambda: written_best(result, req.write, req.out_dir), bests_of)
    else:
        bests = bests_of()
    if req.map_search:
        from meshplan.search.improve import improve_mapping
        improve_mapping(result, req.map_search, write=req.write, progress=say)
    if req.scheduler != "greedy":
        from meshplan.search.improve import improve
        improve(result, req.scheduler, time_limit_s=req.ilp_time_limit_s, workers=req.ilp_workers,
                write=req.write, memory_limit=req.memory_limit_bytes, progress=say)
    sens = None
    if req.sensitivity is not None:
        from meshplan.search.sensitivity import run_sensitivity
        s = req.sensitivity
        sens = run_sensitivity(result, s.percent, samples=s.samples, top=s.top, seed=s.seed, pick=s.pick,
                               progress=say)
    job_body = group_best_s = None
    if req.job is not None:
        from meshplan.search.job_rerank import best_group_s, rerank_for_job
        group_best_s = best_group_s(result)          # before the job re-ranks the candidates
        job_body = rerank_for_job(result, req.job.shape, req.job.topology, max(req.top, req.write), progress=say)
    inference = rule_report(result)
    if written is not None:
        apply_written(result, written)
    elif req.write > 0:
        say(0, None, f"verifying and writing {req.write} schedule(s)")
        write_best(result, req.write, req.out_dir)
    return SearchReport(req, result, bests, sens, job_body, group_best_s, inference)
