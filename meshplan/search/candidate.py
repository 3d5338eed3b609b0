"""One candidate end to end: plan, schedule, simulate (L1) or closed form (L0), and the contract's keys.

Every candidate reports Ring's CCR for its workload and topology
(:func:`meshplan.algorithms.ring.ring_ccr`, the CHARM+ paper's definition).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from meshplan import algorithms
from meshplan.algorithms.base import BuildCache, PassTiming, knob_arg
from meshplan.algorithms.ring import ring_ccr
from meshplan.core.errors import SkipCandidate, UserError
from meshplan.core.parallel import alongside as run_alongside
from meshplan.core.units import fmt_bytes
from meshplan.cost.block_classes import class_sums
from meshplan.cost.metrics import KEYS, PassMetrics, Prediction, combine, imbalance, predicted
from meshplan.cost.simulate import SimResult, simulate
from meshplan.model.matrix import AttnMatrix
from meshplan.model.topology import Topology
from meshplan.model.workload import Workload
from meshplan.plan.plan import Plan
from meshplan.plan.schedule import Schedule


@dataclass
class Candidate:
    """An (algorithm, workload, knobs) to evaluate on a topology with ``n_ranks`` ranks."""

    algorithm: str
    workload: Workload
    knobs: dict[str, Any]
    n_ranks: int
    plan: Plan | None = None
    timing: dict[str, PassTiming] | None = None
    schedule: Schedule | None = None
    sim: SimResult | None = None
    predicted: Prediction | None = None     # simulated (model_level "simulated") or the closed form's
    model_level: str = "closed-form"
    schedule_path: str | None = None
    forward_only: bool = False     # a forward-only method in a fwd+bwd search: ranked on its forward alone
    scheduler: dict[str, Any] | None = None   # search --scheduler: the contract's scheduler object
    mapping_search: dict[str, Any] | None = None   # search --map-search: what the placement search found
    job: dict[str, Any] | None = None     # search --tp/--dp: {alone_s, together_s} of the whole job
    documents: dict[str, Any] | None = None   # docs masks: what the documents cost it, kept when the schedule goes
    not_simulated: str | None = None   # why the search left it at its bound although the bound could beat the pick
    unproven_estimate_s: float | None = None   # such a candidate's contended estimate (ranking.estimate_unproven)

    @property
    def bound_s(self) -> float:
        """Closed-form lower bound of the total makespan."""
        return sum(t.bound_s for t in self.timing.values())

    @property
    def estimate_s(self) -> float:
        """Closed-form guess of the total makespan (orders the search; not a bound)."""
        return timing_estimate_s(self.timing)

    @property
    def makespan_s(self) -> float:
        """Best known total makespan: simulated, else the bound."""
        return self.predicted.rank_s if self.predicted is not None else self.bound_s


def timing_estimate_s(timing: dict[str, PassTiming]) -> float:
    """The total of a closed form's best guess per pass: its estimate where it has one, never below its bound."""
    return sum(max(t.estimate_s if t.estimate_s is not None else t.makespan_s, t.bound_s) for t in timing.values())


#: schedules of fewer ops run ``alongside`` in a thread: forking costs ~10 ms, more than it saves there
FORK_MIN_OPS = 50_000


def make_candidate(name: str, workload: Workload, topo: Topology, n_ranks: int, knobs: dict[str, Any],
                   matrix: AttnMatrix | None = None, builds: BuildCache | None = None,
                   keep_schedule: bool = False, alongside: Callable[[Schedule], Any] | None = None,
                   lazy: bool = False) -> Candidate:
    """Normalise knobs, check, plan, and compute the closed-form timing. ``builds``: the caller's cache of
    schedule builds shared between its plans (a search run's), attached to the plan. ``keep_schedule``: build the
    schedule first and keep it on the plan, so a closed form that needs it (and a later simulation) reuse that
    one build — for a caller about to simulate anyway (``plan_batch``). ``alongside``: with ``keep_schedule``, a
    function of the schedule (``plan_batch``: the verifier) run beside the closed form, in a forked process
    (:func:`meshplan.core.parallel.alongside`: both cores); its result is kept in ``plan.extra["alongside"]``
    (its exception re-raised here). ``lazy``: a method that starts a search's plans from its schedule-free bound
    at ``n_ranks`` (``BuiltTiming.lazy``) starts this one so too, its schedule built only when simulated.

    Raises:
        UserError: bad knob values or an impossible workload; SkipCandidate: the method cannot do this.
    """
    alg, plan, workload = plan_candidate(name, workload, topo, n_ranks, knobs, matrix, builds)
    if lazy and alg.lazy(n_ranks):
        plan.extra["lazy"], keep_schedule = True, False
    if keep_schedule:
        sched = alg.schedule(plan, topo)
    if keep_schedule and alongside is not None:
        plan.extra["alongside"], timing = run_alongside(lambda: alongside(sched), lambda: alg.timing(plan, topo),
                                                        fork=len(sched.ops) >= FORK_MIN_OPS)
    else:
        timing = alg.timing(plan, topo)
    return Candidate(name, workload, plan.knobs, n_ranks, plan=plan, timing=timing)


def plan_candidate(name: str, workload: Workload, topo: Topology, n_ranks: int, knobs: dict[str, Any],
                   matrix: AttnMatrix | None = None, builds: BuildCache | None = None):
    """(algorithm, plan, the candidate's workload): :func:`make_candidate` up to its closed form.

    Raises:
        UserError, SkipCandidate: as :func:`make_candidate`.
    """
    alg = algorithms.get(name)
    norm = alg.normalize(knobs)
    alg.check(workload, topo, n_ranks, norm)
    plan = alg.plan(workload, topo, n_ranks, norm, matrix)
    plan.check()
    if builds is not None:
        plan.extra["builds"] = builds
    return alg, plan, (plan.workload if alg.places_tokens else workload)


def refine_bound(c: Candidate, topo: Topology) -> float:
    """``c``'s bound after its method's tighter closed form (:meth:`~meshplan.algorithms.base.Algorithm.refine`:
    Mesh's and a lazy LoongTrain's built forms) where it has one; the caller asks only when the tighter bound could
    prune it (it may build the schedule: 2.4 s a 1024-rank Mesh)."""
    tighter = algorithms.get(c.algorithm).refine(c.plan, topo)
    if tighter is not None:
        c.timing = tighter
    return c.bound_s


def label(c: Candidate) -> str:
    """A candidate as the search's messages name it: algorithm, layout, knobs."""
    knobs = ",".join(f"{k}={v}" for k, v in c.knobs.items() if v is not None)
    return f"{c.algorithm} {c.workload.layout} {knobs}"


def short_label(c: Candidate) -> str:
    """A candidate as the table names it: algorithm, layout and the knobs that differ from the method's defaults,
    space-separated (``usp zigzag ulysses_degree=32 rank_order=ring-first``)."""
    return " ".join([c.algorithm, c.workload.layout, *(f"{k}={v}" for k, v in given_knobs(c))])


def given_knobs(c: Candidate) -> list[tuple[str, Any]]:
    """``c``'s knobs that differ from its method's defaults (and are not ``auto``), in order."""
    defaults = {k: kn.default for k, kn in algorithms.get(c.algorithm).knobs.items()}
    return [(k, v) for k, v in c.knobs.items() if v is not None and v != defaults.get(k) and v != "auto"]


def over_memory(c: Candidate, peak: float, limit: float, how: str) -> str:
    """Why ``c`` is refused: its ``how`` peak over the limit (bytes per GPU)."""
    return f"{label(c)}: peak memory {fmt_bytes(peak)} ({how}: buffers, workspace, runtime) > {fmt_bytes(limit)}"


def forget_built(c: Candidate) -> None:
    """Drop a candidate's schedule and timeline (large at 1024 ranks); its numbers stay. Rebuilt if written."""
    c.schedule, c.sim = None, None
    if c.plan is not None:
        c.plan.extra.pop("schedule", None)


def topology_arg(topo: Topology) -> str:
    """How a command line names ``topo``: its shipped name, else the path of its file."""
    from pathlib import Path
    shipped = Path(__file__).resolve().parents[1] / "topologies"
    path = Path(topo.source) if topo.source else None
    return topo.name if path is None or path.resolve().parent == shipped else str(path)


def simulate_command(cand: Candidate, topo: Topology) -> str:
    """The ``meshplan simulate`` command that times this candidate alone (every flag: method, knobs that differ
    from the defaults, ranks, topology, workload)."""
    knobs = [knob_arg(k, v) for k, v in given_knobs(cand)]
    return " ".join(["meshplan simulate --algo", cand.algorithm, f"--gpus {cand.n_ranks}",
                     f"--topo {topology_arg(topo)}", cand.workload.cli_flags(), *knobs])


def simulate_candidate(cand: Candidate, topo: Topology, ccr: float | None, quotient: bool = False) -> Candidate:
    """Build the schedule, simulate it and fill ``predicted`` (model level ``simulated``).

    When the algorithm offers variants (Mesh's fetch orders), each is simulated and the fastest is kept;
    ``knobs`` then name the one kept (e.g. ``order: "auto:kv-first"``). ``quotient``: as
    :func:`simulate_variants` (a candidate it cannot simulate so is left as it was).
    """
    simulate_variants(cand, topo, ccr, quotient)
    return cand


def simulate_variants(cand: Candidate, topo: Topology, ccr: float | None, quotient: bool = False) -> int | None:
    """:func:`simulate_candidate`; returns the index of the variant kept. ``quotient``: each variant built for its
    representative ranks alone (:meth:`~meshplan.algorithms.base.Algorithm.quotient_schedule`: 1/nodes of the ops,
    the others proved alike) — then the schedule is not kept (a search writes no schedule it did not build whole)
    and the timeline only as its summary; None, the candidate untouched, where a variant cannot be built so."""
    alg = algorithms.get(cand.algorithm)
    best = None
    variants = alg.variants(cand.plan, topo)
    for k, plan in enumerate(variants):
        sched = alg.quotient_schedule(plan, topo) if quotient else alg.schedule(plan, topo)
        if sched is None:
            return None
        sim = simulate(sched, topo)
        total = sum(sim.pass_makespan.values())
        if best is None or total < best[0]:
            best = (total, k, plan, sched, sim)
    _, kept, plan, cand.schedule, cand.sim = best
    keep_variant(cand, plan)
    cand.predicted, cand.model_level = predicted(cand.schedule, topo, cand.sim, ccr), "simulated"
    if cand.workload.mask.kind == "docs":             # while the schedule is at hand (a search drops it later)
        from meshplan.cost.doc_kernels import document_stats
        cand.documents = document_stats(cand.schedule, topo)
    if quotient:
        cand.schedule, cand.sim = None, summary_only(cand.sim)
    return kept


def simulate_unkept(cand: Candidate, topo: Topology, ccr: float | None) -> int:
    """:func:`simulate_candidate` of a candidate whose schedule is not kept (a rival the pick is measured against, a
    framework's setting): built for its representative ranks alone where its method builds so
    (:meth:`~meshplan.algorithms.base.Algorithm.quotient_schedule`: the same prediction from 1/nodes of the ops, the
    simulation and the metrics ~0.35 s less at 256 ranks), else whole. Either way no schedule is left on it (a
    search that writes it builds it again) and its timeline only as its summary. Returns the index of the variant
    kept (:func:`simulate_variants`)."""
    alg = algorithms.get(cand.algorithm)
    kept = simulate_variants(cand, topo, ccr, quotient=True) if alg.quotient_builds else None
    if kept is None:
        kept = simulate_variants(cand, topo, ccr)
    summary = summary_only(cand.sim)
    forget_built(cand)
    cand.sim = summary
    return kept


def summary_only(sim: SimResult | None) -> SimResult | None:
    """``sim`` without its per-op arrays (start, end, durations, representatives: what goes with its schedule), its
    summary kept (makespans, ranks simulated, events, wall): what comes back from a forked simulation whose schedule
    does not (a 0.5M-op timeline is ~20 MB through the pipe)."""
    if sim is None:
        return None
    empty = np.zeros(0)
    return replace(sim, start=empty, end=empty, durations=empty, rep_op=None)


def keep_variant(cand: Candidate, plan: Plan) -> None:
    """Record that ``cand``'s simulation kept the variant ``plan`` (its knobs name it: ``order: auto:kv-first``)."""
    if plan is not cand.plan:
        cand.plan = plan
        cand.knobs = plan.knobs | {"order": f"auto:{plan.knobs['order']}"}


def reduces(cand: Candidate, topo: Topology) -> bool:
    """Whether the simulator can simulate one node's ranks for this candidate (its schedule's programs are alike
    up to a node permutation, :mod:`meshplan.cost.symmetry`). Builds the first variant's schedule to find out."""
    from meshplan.cost.cost import CostModel
    from meshplan.cost.symmetry import DURATION_TOLERANCE, find_reduction

    alg = algorithms.get(cand.algorithm)
    sched = alg.schedule(alg.variants(cand.plan, topo)[0], topo)
    red = find_reduction(sched, topo, CostModel(topo).op_durations(sched), sched.match_transfers()[0],
                         DURATION_TOLERANCE)
    return red.n_reps < sched.n_ranks


def _noise_free(x: float, scale: float) -> float:
    """max(x, 0), with float round-off (below 1e-9 of ``scale``) reported as 0."""
    return x if x > 1e-9 * max(scale, 1e-30) else 0.0


def closed_form_predicted(cand: Candidate, ccr: float | None, estimate: bool = False) -> Prediction:
    """The prediction of the closed form: makespan = the lower bound (model level ``closed-form``), or with
    ``estimate`` the closed form's estimate where it has one (never below the bound)."""

    parts = {}
    for name, t in cand.timing.items():
        comm = t.comm_s
        by_rank = _plan_flops_by_rank(cand, name)
        span = max(t.estimate_s, t.bound_s) if estimate and t.estimate_s is not None else t.bound_s
        parts[name] = PassMetrics(
            makespan_s=span, compute_s=t.compute_s,
            exposed_comm_s=_noise_free(span - t.compute_s, span),
            comm_busy_s=comm, comm_bytes_per_gpu_max=t.recv_bytes_max,
            inter_node_bytes_per_gpu_max=t.inter_node_bytes_max,
            compute_to_comm=t.compute_s / comm if comm else None,
            bytes_per_flop=t.recv_bytes_total / t.flops_total if t.flops_total else None,
            peak_memory_bytes=t.peak_memory_bytes,
            peak_memory_total_bytes=t.peak_memory_bytes if t.peak_memory_total_bytes is None
            else t.peak_memory_total_bytes,
            work_imbalance=None if by_rank is None else imbalance(by_rank),
            recv_bytes_by_rank=np.array([t.recv_bytes_max]), cross_bytes_by_rank=np.array([t.inter_node_bytes_max]),
            recv_bytes=t.recv_bytes_total, flops=t.flops_total,
            flops_by_rank=np.zeros(cand.n_ranks) if by_rank is None else by_rank)
    return combine(parts, ccr)


def _plan_flops_by_rank(cand: Candidate, pass_: str) -> np.ndarray | None:
    """FLOPs each rank computes by the plan's block owners (None where blocks are split by heads, e.g. Ulysses)."""
    plan = cand.plan
    if plan is None:
        return None
    m, owner = plan.matrix, plan.owner
    sums = class_sums(m, owner, cand.n_ranks)
    if sums is not None:                          # counted once per owner array (Mesh's mappings share one)
        return sums.pairs.sum(axis=1) * m.flops_per_pair(pass_)
    ok = m.permitted
    if owner.shape != ok.shape or (owner[ok] < 0).any():
        return None
    return np.bincount(owner[ok], weights=m.flops(pass_)[ok], minlength=cand.n_ranks)


def predict(name: str, workload: Workload, topo: Topology, n_ranks: int, knobs: dict[str, Any],
            keep_schedule: bool = True, on_whole: Callable[[], None] | None = None) -> Candidate:
    """Plan, schedule and simulate one algorithm (what ``meshplan simulate --algo`` does). Without
    ``keep_schedule`` (nothing to write or trace), a method whose schedule a search does not build whole at this
    size is simulated on its representative ranks alone where they are proved alike (:func:`simulate_variants`'s
    ``quotient``: seconds instead of a minute and GBs at 1024 ranks), else built whole. ``on_whole`` is called
    before such a plan is built whole after all (its ranks not alike).

    Raises:
        UserError: bad knobs, or the method cannot run this workload on ``n_ranks`` ranks (search skips such
            combinations; asked for by name, it is an error).
    """
    try:
        cand = make_candidate(name, workload, topo, n_ranks, knobs)
    except SkipCandidate as skip:
        raise UserError("--algo", f"{name} cannot run this on {n_ranks} ranks: {skip.detail or skip.reason}",
                        "see meshplan search for the methods that can") from None
    ccr, alg = ring_ccr(workload, topo, n_ranks), algorithms.get(name)
    if not keep_schedule and alg.quotient_builds and not alg.search_may_build(n_ranks):
        if simulate_variants(cand, topo, ccr, quotient=True) is not None:
            return cand
        if on_whole is not None:
            on_whole()
    return simulate_candidate(cand, topo, ccr)


def result_json(cand: Candidate) -> dict[str, Any]:
    """The ``--json`` body of ``simulate`` for a candidate."""
    pred = cand.predicted.json() if cand.predicted is not None else {}
    body = {"algorithm": cand.algorithm, "knobs": cand.knobs, "workload": cand.workload.to_dict(),
            "pass": cand.workload.passes, "model_level": cand.model_level, "predicted": pred}
    if cand.sim is not None:
        body["simulation"] = cand.sim.json()
    return body


__all__ = ["KEYS", "Candidate", "make_candidate", "simulate_candidate", "closed_form_predicted",
           "predict", "result_json"]
