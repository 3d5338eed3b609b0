"""``search``'s framework table: each framework's best setting (:mod:`meshplan.search.framework_settings`), timed by
the simulator.

Every setting a framework offers is mapped to its plan. A plan the search simulated keeps its time; any other is
planned (its closed-form bound) and simulated unless that bound is above the framework's best so far by more
than the search's prune slack — so a framework's best is exact up to that slack, as the search's pick is. Where
the search starts a method from its schedule-free bound (USP, Ulysses, LoongTrain from 128 ranks), so do these
plans: a schedule is built only to be simulated (LoongTrain's built form refines its bound first, as in the search).
The search's ``--algos``, ``--layout`` and knob filters apply to the frameworks' plans too.

Up to ``FULL_RANKS`` ranks every setting is evaluated so. Above (a schedule takes up to seconds to build and
simulate, and yunchang alone offers ~30 settings) a plan the search did not list, of a method whose bound
builds its schedule (USP, Ulysses), is evaluated only when the search listed a *sibling* — the same algorithm,
layout and knobs but for the backward's wire knobs (``dkv_dtype``, ``dkv_hops``: TransformerEngine's dK/dV in
the input dtype over N−1 hops) — and at most ``EXTRA_BUILT`` of them per framework, in the order of their
siblings' bounds; the others are listed as not evaluated, with the ``simulate`` command that times them.
Above ``FULL_SIM_MAX_RANKS`` ranks only the plans the search simulated are timed (one plan there takes up to a
minute and GBs to build and simulate); the others are listed as not evaluated.
"""

from __future__ import annotations

import copy
from dataclasses import asdict, dataclass, field
from typing import Any

from meshplan import algorithms
from meshplan.algorithms.base import BuiltTiming
from meshplan.core.errors import SkipCandidate, UserError
from meshplan.core.units import fmt_bytes
from meshplan.cost.memory import estimated_peak_bytes
from meshplan.search import FULL_SIM_MAX_RANKS, SearchResult
from meshplan.search.candidate import Candidate, make_candidate, refine_bound, simulate_unkept
from meshplan.search.framework_settings import BWD_KNOBS, FRAMEWORKS, Choice, NotExpressible, express

#: Every setting a framework offers is evaluated up to this many ranks.
FULL_RANKS = 16
#: Above FULL_RANKS ranks: plans outside the search's list whose bound builds a schedule, per framework, at most.
EXTRA_BUILT = 1


@dataclass
class FrameworkBest:
    """A framework's fastest setting for the search's workload (``settings`` None: none it can run here)."""

    framework: str
    settings: Any = None
    choice: Choice | None = None
    time_s: float | None = None
    in_search: bool = False                                          # its plan is among the search's candidates
    simulated: int = 0                                               # settings simulated here (not by search)
    refused: list[tuple[str, str]] = field(default_factory=list)      # (setting, why not)
    not_evaluated: list[tuple[str, str]] = field(default_factory=list)  # (setting, why and how to time it)
    expresses_best: str | None = None                                # search's best plan in this framework

    @property
    def reason(self) -> str | None:
        """Why there is no setting (the distinct reasons its settings were refused)."""
        if self.settings is not None:
            return None
        return "; ".join(dict.fromkeys(r for _, r in self.refused)) or "no setting evaluated at this size"


def framework_bests(result: SearchResult, algos: list[str] | None = None,
                    filters: dict[str, Any] | None = None) -> list[FrameworkBest]:
    """Each framework's best setting for ``result``'s workload and cluster (module docstring)."""
    if not result.candidates:
        return []
    w, n = result.workload, result.n_ranks
    listed: dict[tuple, Candidate] = {}
    for c in result.candidates:
        if not c.forward_only:
            listed.setdefault(Choice.of(c).key(w), c)
    times: dict[tuple, float] = {}                     # simulated here, shared by the frameworks
    best = Choice.of(result.candidates[0])
    out = []
    for fw in FRAMEWORKS:
        fb = FrameworkBest(fw.name)
        s, _ = express(fw, best, w, n)
        fb.expresses_best = s.cli() if s is not None else None
        entries = []
        for s in fw.offered(w, n):
            try:
                ch = fw.candidate(s, w)
            except NotExpressible as e:
                fb.refused.append((s.cli(), e.reason))
                continue
            why = _filtered(ch, result, algos, filters or {})
            if why:
                fb.refused.append((s.cli(), why))
            else:
                entries.append((s, ch))
        _evaluate(fb, entries, result, listed, times)
        out.append(fb)
    return out


def _filtered(ch: Choice, result: SearchResult, algos: list[str] | None, filters: dict[str, Any]) -> str | None:
    """Why the search's filters exclude a plan (None: they do not)."""
    if algos and ch.algorithm not in algos:
        return f"{ch.algorithm} excluded by --algos"
    if result.layout_pinned and ch.layout != result.workload.layout:
        return f"needs the {ch.layout} layout; --layout pins {result.workload.layout}"
    alg = algorithms.get(ch.algorithm)
    foreign = [k for k in filters if k not in alg.knobs]
    if foreign:
        return f"{ch.algorithm}: {foreign[0]} does not apply"
    pinned = alg.normalize({k: v for k, v in filters.items()})
    off = [k for k in filters if str(pinned[k]) != str(ch.knobs.get(k)) and pinned[k] != "auto"]
    return f"runs {off[0]}={ch.knobs.get(off[0])}, filtered to {pinned[off[0]]}" if off else None


def _evaluate(fb: FrameworkBest, entries: list, result: SearchResult, listed: dict, times: dict) -> None:
    """Time the entries (simulated where needed, pruned by bounds); keep the fastest in ``fb``."""
    w, topo, n = result.workload, result.topology, result.n_ranks
    slack = result.counts.get("prune_slack", 0.0)
    best_t, pending = float("inf"), []
    for s, ch in entries:
        k = ch.key(w)
        c = listed.get(k)
        t = times.get(k, c.predicted.makespan_s if c is not None and c.model_level == "simulated" else None)
        if t is not None:
            if t < best_t:
                best_t = _keep(fb, s, ch, t, k in listed)
        else:
            pending.append((s, ch, k, c))
    staged, built = [], 0
    for s, ch, k, c in sorted(pending, key=lambda e: _order(e, listed)):
        limit = min(FULL_SIM_MAX_RANKS, algorithms.get(ch.algorithm).search_build_limit())
        if n > limit:                          # a schedule takes up to a minute and GBs to build and simulate
            fb.not_evaluated.append((s.cli(), f"not simulated above {limit} ranks unless the search "
                                     f"simulated it; time it: {_simulate_command(ch, result)}"))
            continue
        if c is None and n > FULL_RANKS and isinstance(algorithms.get(ch.algorithm), BuiltTiming):
            if listed.get(_sibling(k)) is None or built >= EXTRA_BUILT:
                fb.not_evaluated.append((s.cli(), f"not evaluated above {FULL_RANKS} ranks (search does "
                                         f"not list it); time it: {_simulate_command(ch, result)}"))
                continue
            built += 1
        try:    # a method whose closed form builds its schedule keeps it for the simulation; from the search's
            cand = copy.copy(c) if c is not None else make_candidate(        # lazy size, its schedule-free bound
                ch.algorithm, w.with_(layout=ch.layout), topo, n, ch.knobs,
                keep_schedule=isinstance(algorithms.get(ch.algorithm), BuiltTiming), lazy=True)
        except (SkipCandidate, UserError) as e:
            fb.refused.append((s.cli(), getattr(e, "detail", "") or str(e)))
            continue
        if _too_big(fb, s, estimated_peak_bytes(cand.timing), result.memory_limit):
            if c is None:
                _forget(cand)
            continue
        staged.append((cand.bound_s, s, ch, k, cand, c is None))
    for bound, s, ch, k, cand, made in sorted(staged, key=lambda e: e[0]):
        if k not in times and bound <= best_t * (1 - slack) * (1 + 1e-12) < float("inf"):
            bound = refine_bound(cand, topo)                       # as the search: once a bound can prune
        if bound > best_t * (1 - slack) * (1 + 1e-12):
            if made:
                _forget(cand)
            continue
        if k not in times:
            simulate_unkept(cand, topo, result.ring_ccr)          # its schedule not kept: none left on its plan
            fb.simulated += 1
            if _too_big(fb, s, cand.predicted.total.peak_memory_total_bytes, result.memory_limit):
                continue
            times[k] = cand.predicted.makespan_s
        if times[k] < best_t:
            best_t = _keep(fb, s, ch, times[k], k in listed)


def _forget(cand: Candidate) -> None:
    """Drop the schedule a candidate's plan holds (its numbers stay)."""
    if cand.plan is not None:
        cand.plan.extra.pop("schedule", None)


def _too_big(fb: FrameworkBest, s, peak: float, limit: float | None) -> bool:
    """Whether a setting's memory-model peak exceeds the search's limit (then it is refused, with the numbers)."""
    if limit is None or peak <= limit:
        return False
    fb.refused.append((s.cli(), f"needs {fmt_bytes(peak)} per GPU by the memory model, more than {fmt_bytes(limit)}"))
    return True


def _keep(fb: FrameworkBest, s, ch: Choice, t: float, in_search: bool) -> float:
    fb.settings, fb.choice, fb.time_s, fb.in_search = s, ch, t, in_search
    return t


def _sibling(key: tuple) -> tuple:
    """A plan key with the backward's wire knobs at the search's defaults (what search lists)."""
    alg, layout, knobs = key
    defaults = {k: kn.default for k, kn in algorithms.get(alg).knobs.items()}
    return alg, layout, tuple((k, str(defaults[k]) if k in BWD_KNOBS else v) for k, v in knobs)


def _order(entry, listed: dict) -> float:
    """Pending plans: listed ones by their bound, others by their sibling's (unknown last)."""
    _, ch, k, c = entry
    sib = c or listed.get(_sibling(k))
    return sib.bound_s if sib is not None else float("inf")


def _simulate_command(ch: Choice, result: SearchResult) -> str:
    """The complete ``meshplan simulate`` command that times a plan on the search's workload and cluster."""
    from meshplan.search.candidate import simulate_command
    cand = Candidate(ch.algorithm, result.workload.with_(layout=ch.layout), ch.knobs, result.n_ranks)
    return simulate_command(cand, result.topology)


def frameworks_json(bests: list[FrameworkBest], best_s: float | None) -> list[dict[str, Any]]:
    """The ``frameworks`` key of ``search --json``: one object per framework."""
    out = []
    for fb in bests:
        body: dict[str, Any] = {"framework": fb.framework}
        if fb.settings is not None:
            settings = {k: list(v) if isinstance(v, tuple) else v for k, v in asdict(fb.settings).items()}
            body |= {"settings": settings, "cli": fb.settings.cli(), "algorithm": fb.choice.algorithm,
                     "layout": fb.choice.layout, "knobs": fb.choice.knobs, "time_s": fb.time_s,
                     "vs_best": fb.time_s / best_s if best_s else None, "in_search": fb.in_search}
        else:
            body |= {"settings": None, "reason": fb.reason}
        body |= {"expresses_best": fb.expresses_best, "simulated": fb.simulated,
                 "not_expressible": [{"cli": cli, "reason": why} for cli, why in fb.refused],
                 "not_evaluated": [{"cli": cli, "reason": why} for cli, why in fb.not_evaluated]}
        out.append(body)
    return out
