"""Search: enumerate algorithms x layouts x knobs, prune with closed-form bounds, simulate the survivors.

Pruning is bounded: a candidate is left at ``model_level: closed-form`` when its lower bound (the
uncontended recurrence, or the busiest link's bytes / capacity) exceeds (1 − ``prune_slack``) x the best
simulated makespan, so it cannot beat the pick by more than ``prune_slack`` (default 1%; 0 makes the
pick exactly the best of all candidates). Combinations a method cannot do are skipped and counted with
the reason. Above ``FULL_SIM_MAX_RANKS`` ranks a candidate whose schedule has no node symmetry is not
simulated once another has been (it stays at its bound, counted in ``counts.not_simulated``): the simulator
would run every rank's program, minutes at 1024 ranks. Above a method's ``search_max_ranks`` (256) a candidate timed
by its schedule-free bound (USP, Ulysses, LoongTrain, StarTrail, CHARM+) is never built, so never simulated (nor
written): its schedule alone takes GBs; ``meshplan simulate --algo`` times it (and ``--out`` writes it).

Modules, in pipeline order: this one (:func:`run_search`), :mod:`candidate` (one candidate: plan, closed form,
simulation), :mod:`closed_forms` (many candidates' closed forms on both cores), :mod:`branch_bound` (the search
loop: tighten, prune or simulate each candidate), :mod:`beside` (simulations in a forked process beside other work),
:mod:`ranking` (the table's order, Ring's reference row, what keeps the pick unproven), :mod:`pipeline` (the whole
search the CLI runs, as one call: a ``SearchRequest`` in, a ``SearchReport`` out), :mod:`framework_settings` and
:mod:`frameworks` (Megatron-LM/TE, yunchang and torchtitan settings), :mod:`improve`, :mod:`mapping` and :mod:`ilp`
(CP-SAT orders, placement search), :mod:`sensitivity`, :mod:`job_rerank` (ranking by a TP x CP x DP job's time),
:mod:`inference` (the KV-cache rule), :mod:`run_memory` (will a run fit this host), :mod:`write` (verify and write
the best schedules).
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from meshplan import algorithms
from meshplan.algorithms.base import SEARCH_BUILD_MAX_RANKS, BuildCache, BuiltTiming
from meshplan.algorithms.ring import ring_ccr
from meshplan.core.errors import SkipCandidate, UserError
from meshplan.core.units import fmt_bytes
from meshplan.cost.memory import estimated_peak_bytes
from meshplan.model.matrix import attn_matrix
from meshplan.model.topology import Topology
from meshplan.model.workload import LAYOUTS, Workload
from meshplan.search.beside import simulate_beside
from meshplan.search.branch_bound import OVER_LIMIT, BranchAndBound
from meshplan.search.candidate import (
    Candidate,
    closed_form_predicted,
    forget_built,
    label,
    over_memory,
    simulate_candidate,
)
from meshplan.search.closed_forms import make_candidates
from meshplan.search.ranking import not_proven, ranked, reference_simulations, ring_reference, ring_rows

PRUNE_SLACK = 0.01
#: Above this many ranks a schedule without node symmetry (every rank simulated, e.g. a causal contiguous Mesh:
#: 1024 ranks took 750 s) is left at its closed-form bound once another candidate has been simulated.
FULL_SIM_MAX_RANKS = 256
#: up to this many ranks the search simulates two candidates at a time (a forked process each second one)
PAIR_MAX_RANKS = 256
#: Above this many ranks, methods whose closed form builds the schedule are searched in zigzag only.
#: Knobs search varies by default (numerically neutral); others stay at their defaults unless given.
SEARCHED = {"ring": {"dkv_hops": ("n", "n-1")}, "pass-q": {"dq_hops": ("n", "n-1")}}
#: Algorithms whose knob space the algorithm enumerates itself (tiles x mappings).


@dataclass
class SearchResult:
    """Ranked candidates (best first) and how many each level saw."""

    workload: Workload
    topology: Topology
    n_ranks: int
    candidates: list[Candidate]
    counts: dict[str, Any]
    wall_s: float = 0.0
    ring_ccr: float | None = None
    rejected: list[str] = field(default_factory=list)
    layout_pinned: bool = False
    memory_limit: float | None = None      # bytes per GPU the plans were held to (default: the device's memory)
    reference: Candidate | None = None     # Ring's best setting, simulated where the search can (the reference row)


def enumerate_candidates(base: Workload, topo: Topology, n: int, algos: list[str] | None,
                         filters: dict[str, Any], layout_pinned: bool,
                         builds: BuildCache | None = None) -> tuple[list[Candidate], Counter]:
    """Every (algorithm, layout, knobs) the filters allow, with closed-form timing; skips counted. ``builds``: the
    run's cache of schedule builds, attached to every plan."""
    skipped: Counter = Counter()
    cands: list[Candidate] = []
    jobs: list[tuple] = []                  # (name, workload, knobs, matrix, forward only): timed together below
    zigzag_only: dict[int, Counter] = {}    # above the size: {method: layouts not searched}
    for name in algos or algorithms.NAMES:
        if name not in algorithms.NAMES:
            algorithms.get(name, "--algos")  # raises: unknown algorithm, with the valid names
        if name not in algorithms.REGISTRY:
            skipped["not implemented yet"] += 1
            continue
        alg = algorithms.REGISTRY[name]
        beyond = _named_beyond_builds(alg, n) if algos and name in algos else _beyond_limit(alg, base, topo, n)
        if beyond:
            skipped[beyond] += 1
            continue
        foreign = [k for k in filters if k not in alg.knobs]
        if foreign:
            skipped[f"{foreign[0]} does not apply"] += 1
            continue
        layouts = [base.layout] if layout_pinned or alg.places_tokens else list(LAYOUTS)
        # the balanced layout only, above the size where their bounds build schedules or nothing is built at all
        few = min(getattr(alg, "search_variants_max_ranks", SEARCH_BUILD_MAX_RANKS), SEARCH_BUILD_MAX_RANKS)
        if n > few and len(layouts) > 1:
            zigzag_only.setdefault(few, Counter())[name] += len(layouts) - 1
            layouts = ["zigzag"]
        seen: list = []                                              # matrices of the layouts kept so far
        for layout in layouts:
            w = base.with_(layout=layout)
            try:
                matrix = None if alg.places_tokens else attn_matrix(w, n)
            except UserError:
                skipped[f"sequence cannot be split by the {layout} layout"] += 1
                continue
            if matrix is not None and any(same_computation(matrix, m) for m in seen):
                skipped["layouts that are the same computation (every block alike)"] += 1
                continue
            if matrix is not None:
                seen.append(matrix)
            own_space = type(alg).knob_space is not algorithms.Algorithm.knob_space
            settings = alg.knob_space(w, topo, n, filters) if own_space else _knob_settings(name, filters, w)
            fwd_only = alg.forward_only and "bwd" in w.pass_list
            wc = w.with_(passes="fwd") if fwd_only else w
            jobs += [(name, wc, knobs, None if fwd_only else matrix, fwd_only) for knobs in settings]
    for few, names in zigzag_only.items():   # named: other methods' rows keep their layouts
        skipped[f"other layouts of {', '.join(names)} (only zigzag searched for them above {few} ranks)"] += \
            sum(names.values())
    made = make_candidates([j[:4] for j in jobs], topo, n, builds)
    for (*_, fwd_only), c in zip(jobs, made):
        if isinstance(c, SkipCandidate):
            skipped[c.reason] += 1
            continue
        c.forward_only = fwd_only
        cands.append(c)
    return cands, skipped


def _named_beyond_builds(alg, n: int) -> str | None:
    """Why a method named in --algos is not enumerated at ``n`` ranks: its closed form builds the schedule (TASP,
    doc-place), which a search does not above ``SEARCH_BUILD_MAX_RANKS``; None otherwise."""
    if n <= SEARCH_BUILD_MAX_RANKS or not isinstance(alg, BuiltTiming) or not alg.builds_to_time(n):
        return None
    return (f"its closed form builds the schedule, which a search does not above {SEARCH_BUILD_MAX_RANKS} ranks "
            f"(meshplan simulate --algo {alg.name} with this workload's flags times it alone)")


def _beyond_limit(alg, base: Workload, topo: Topology, n: int) -> str | None:
    """Why the search does not enumerate ``alg`` at ``n`` ranks unless named in --algos: its closed form builds a
    schedule and ``n`` is above its ``search_max_ranks`` (a method that cannot run there at all says why instead,
    TASP's N ≤ 20); None when it is enumerated."""
    limit = getattr(alg, "search_max_ranks", None)
    if limit is None or n <= limit or not alg.builds_to_time(n):
        return None
    try:
        alg.check(base.with_(passes="fwd") if alg.forward_only else base, topo, n, alg.normalize({}))
    except SkipCandidate as skip:
        return skip.reason
    except UserError:
        pass
    return f"not enumerated above {limit} ranks (name it in --algos: {alg.name})"


def same_computation(a, b) -> bool:
    """Whether two attention matrices of one workload under different layouts are the same computation: every
    block has the same pairs, the same participating rows and keys and the same mask need (a full mask without
    padding: each layout only renames the tokens), so every plan costs the same on both."""
    return (a.n == b.n and np.array_equal(a.pairs, b.pairs) and np.array_equal(a.s_q, b.s_q)
            and np.array_equal(a.s_kv, b.s_kv) and np.array_equal(a.elementwise, b.elementwise)
            and np.array_equal(a.chunks.tokens, b.chunks.tokens)
            and np.array_equal(a.chunks.q_tokens, b.chunks.q_tokens)
            and a.workload.mask.kind == b.workload.mask.kind == "full")


def _knob_settings(name: str, filters: dict[str, Any], w: Workload) -> list[dict[str, Any]]:
    settings = [dict(filters)]
    for knob, values in SEARCHED.get(name, {}).items():
        if knob not in filters and "bwd" in w.pass_list:      # the searched knobs are the backward's
            settings = [s | {knob: v} for s in settings for v in values]
    return settings


def run_search(base: Workload, topo: Topology, n: int, *, algos: list[str] | None = None,
               filters: dict[str, Any] | None = None, layout_pinned: bool = False,
               memory_limit: float | None = None, prune_slack: float = PRUNE_SLACK,
               progress: Callable[[int, int, str], None] | None = None,
               on_leader: Callable[[Candidate], None] | None = None) -> SearchResult:
    """Enumerate, prune and simulate; returns the candidates best first (simulated, then closed-form). Every plan
    must fit ``memory_limit`` bytes per GPU (default: the device's memory) by the memory model
    (:mod:`meshplan.cost.memory`): its estimate before simulation, its simulated total after.
    ``on_leader(candidate)``, when given, is called each time the branch and bound has a new best simulated candidate
    (:attr:`BranchAndBound.on_leader`): the pipeline starts writing it then, while the search goes on.

    Raises:
        UserError: no plan fits.
    """
    t0 = time.perf_counter()
    given = memory_limit is not None
    memory_limit = memory_limit if given else topo.memory_bytes
    builds = BuildCache()           # this run's shared builds: dropped when it ends
    cands, skipped = enumerate_candidates(base, topo, n, algos, filters or {}, layout_pinned, builds)
    ccr_w = base if layout_pinned else base.with_(layout="zigzag")
    ccr = ring_ccr(ccr_w, topo, n)
    rejected: list[str] = []
    fwd_only = [c for c in cands if c.forward_only]       # listed after the others with bwd: null, never the pick
    cands = [c for c in cands if not c.forward_only]
    if fwd_only and not cands:
        raise _forward_only_error(fwd_only, algos)
    cands = _within_memory(cands, topo, memory_limit, given, skipped, rejected)
    fwd_only = _within_memory(fwd_only, topo, memory_limit, given, skipped, rejected, refuse=False)
    cands.sort(key=lambda c: (c.estimate_s, c.bound_s))   # likely winners first: pruning bites early
    bnb = BranchAndBound(topo, n, ccr, memory_limit, given, prune_slack, skipped, rejected, FULL_SIM_MAX_RANKS,
                         PAIR_MAX_RANKS, on_leader=on_leader)
    # Ring's settings for the reference row, simulated in another process beside the branch and bound (both cores)
    ring_max = min(FULL_SIM_MAX_RANKS, SEARCH_BUILD_MAX_RANKS)         # above: Ring's bounds stand
    pool = ring_rows(cands) if n <= ring_max else []
    _, beside = simulate_beside(pool, lambda sim: reference_simulations(
        cands, n, prune_slack, ring_max, lambda todo: sim(todo[0])), topo, ccr, lambda: bnb.visit_all(cands, progress))
    for c in beside:
        bnb.record(c)                                            # as the search records what it simulates
    reference = ring_reference(cands, topo, n, ccr, prune_slack, ring_max)
    builds.clear()
    cands = [c for c in cands if c.model_level != "over-memory"]
    _rank_forward_only(fwd_only, topo, ccr, bnb.unsimulated)
    if bnb.over and not cands:                 # a forward-only method left alone does not time a fwd+bwd step
        peak, label = min(bnb.over)
        raise _no_fit(memory_limit, given, f"{fmt_bytes(peak)} ({label}, simulated)")
    n_sim = sum(c.model_level == "simulated" for c in cands + fwd_only)
    counts = {"enumerated": len(cands) + len(fwd_only) + skipped[OVER_LIMIT[given]],
              "pruned": len(cands) + len(fwd_only) - n_sim, "simulated": n_sim, "skipped": dict(skipped),
              "not_simulated": dict(bnb.unsimulated), "prune_slack": prune_slack}
    return SearchResult(base, topo, n, ranked(cands + fwd_only), counts, time.perf_counter() - t0, ccr, rejected,
                        layout_pinned, memory_limit, reference)


def _forward_only_error(fwd_only: list[Candidate], algos: list[str] | None) -> UserError:
    """A fwd+bwd search where only forward-only methods can run (named in --algos, or the others skipped): none of
    them times a training step."""
    names = ", ".join(dict.fromkeys(c.algorithm for c in fwd_only))
    return UserError("--algos" if algos else "--pass",
                     f"{names} has no backward pass, and this search times forward and backward",
                     "add --pass fwd to rank the forward alone" + (", or name a method with a backward in --algos"
                                                                    if algos else ""))


def _within_memory(cands: list[Candidate], topo: Topology, limit: float, given: bool, skipped: Counter,
                   rejected: list[str], refuse: bool = True) -> list[Candidate]:
    """The candidates whose memory-model peak before simulation (:func:`~meshplan.cost.memory.estimated_peak_bytes`)
    fits ``limit`` bytes per GPU (``given``: from --memory-limit, else the device's); the others counted and listed.

    Raises:
        UserError: ``refuse`` and none fits (naming the smallest and what it needs).
    """
    keep, smallest = [], None
    for c in cands:
        peak = estimated_peak_bytes(c.timing)
        if peak > limit:
            skipped[OVER_LIMIT[given]] += 1
            rejected.append(over_memory(c, peak, limit, "estimated"))
            smallest = min(smallest or (peak, c), (peak, c), key=lambda x: x[0])
        else:
            keep.append(c)
    if refuse and cands and not keep:
        peak, c = smallest
        raise _no_fit(limit, given, f"{fmt_bytes(peak)} ({label(c)})")
    return keep


def _no_fit(limit: float, given: bool, smallest: str) -> UserError:
    if given:
        return UserError("--memory-limit", f"no plan fits in {fmt_bytes(limit)} per GPU",
                         f"the smallest needs {smallest}; raise the limit or add GPUs")
    return UserError("--gpus", f"no plan fits in the device's {fmt_bytes(limit)}",
                     f"the smallest needs {smallest}; add GPUs, or shorten --seq-len or --batch")


def _rank_forward_only(cands: list[Candidate], topo: Topology, ccr: float | None, unsimulated: Counter) -> None:
    """Simulate forward-only candidates of a fwd+bwd search on their forward (at their bound above the size a search
    builds them at); ``bwd`` and totals null."""
    for c in cands:
        alg = algorithms.get(c.algorithm)
        if alg.search_may_build(c.n_ranks):
            simulate_candidate(c, topo, ccr)
        else:
            c.predicted = closed_form_predicted(c, ccr)
            c.not_simulated = f"its schedule is not built above {alg.search_build_limit()} ranks"
            unsimulated[f"schedule not built above {alg.search_build_limit()} ranks (simulate it alone)"] += 1
        c.predicted = c.predicted.forward_only()
        forget_built(c)
    cands.sort(key=lambda c: c.predicted.rank_s)


def _documents(c: Candidate, topo: Topology) -> dict[str, Any] | None:
    """A simulated candidate's document costs (:func:`meshplan.cost.doc_kernels.document_stats`, kept by
    :func:`~meshplan.search.candidate.simulate_candidate`); None at a bound."""
    if c.documents is not None or c.schedule is None:
        return c.documents
    from meshplan.cost.doc_kernels import document_stats

    return document_stats(c.schedule, topo)


def search_json(result: SearchResult, scheduler: str) -> dict[str, Any]:
    """The contract's ``--json`` body of ``search``."""
    from meshplan.search.candidate import result_json
    from meshplan.search.improve import not_run

    topo = result.topology
    cands = []
    for c in result.candidates:
        body = result_json(c)
        body.pop("workload")
        cands.append(body | {"layout": c.workload.layout, "bound_s": c.bound_s,
                             "scheduler": c.scheduler or not_run(scheduler), "mapping_search": c.mapping_search,
                             "schedule_path": c.schedule_path} | ({"job": c.job} if c.job else {})
                     | ({"documents": _documents(c, topo)} if c.workload.mask.kind == "docs" else {}))
    layout = result.workload.layout if result.layout_pinned else "any"
    return {"workload": result.workload.to_dict() | {"layout": layout},
            "topology": {"name": topo.name, "hash": topo.content_hash, "devices": topo.n_devices,
                         "source": topo.source, "memory_bytes": result.memory_limit},
            "n_ranks": result.n_ranks, "wall_s": result.wall_s, "ring_ccr": result.ring_ccr,
            "counts": result.counts,
            "rejected": result.rejected, "candidates": cands,
            "reference": (cands[result.candidates.index(result.reference)] if result.reference is not None
                          else None),
            "not_proven": not_proven(result)}
