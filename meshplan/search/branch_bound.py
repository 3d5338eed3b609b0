"""The search's branch and bound: candidates visited best estimate first, each bound tightened once something is
simulated, left at its closed form when the best so far prunes it, else simulated — two at a time up to
``pair_max_ranks`` ranks (the second in a forked process), one at a time above, each beside the next one's
refinement. :func:`meshplan.search.run_search` runs it beside Ring's reference simulations.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable

from meshplan import algorithms
from meshplan.algorithms.base import BuiltTiming
from meshplan.core.parallel import alongside, can_fork
from meshplan.model.topology import Topology
from meshplan.search.beside import simulate_both
from meshplan.search.candidate import (
    Candidate,
    closed_form_predicted,
    forget_built,
    keep_variant,
    label,
    over_memory,
    reduces,
    refine_bound,
    short_label,
    simulate_candidate,
    simulate_unkept,
    simulate_variants,
)

#: what a candidate over the memory limit is counted as, by whether the limit was given (--memory-limit)
OVER_LIMIT = {True: "over --memory-limit", False: "over the device's memory"}


@dataclass
class BranchAndBound:
    """The search loop's state over candidates visited best estimate first: the best simulated makespan so far
    and its candidate (the only one whose simulation is kept), what was left unsimulated and why, and the
    simulated totals over the memory limit."""

    topo: Topology
    n: int
    ccr: float | None
    memory_limit: float
    given: bool
    prune_slack: float
    skipped: Counter
    rejected: list[str]
    full_sim_max_ranks: int          # above: a schedule without node symmetry is left at its bound (one simulated)
    pair_max_ranks: int              # up to: two candidates simulated at a time
    best: float = float("inf")
    leader: Candidate | None = None
    unsimulated: Counter = field(default_factory=Counter)
    over: list[tuple[float, str]] = field(default_factory=list)
    refined: set[int] = field(default_factory=set)          # ids of the candidates whose bound is tightened
    symmetric: dict[int, bool] = field(default_factory=dict)   # id -> reduces(), found where it was refined
    by_quotient: set[int] = field(default_factory=set)   # ids of candidates simulated on their representatives alone
    ahead: set[int] = field(default_factory=set)         # ids simulated beside the one before (not visited again)
    #: called with each new leader once it leads (after the visit that simulated it: a pair's both recorded), and
    #: before the first simulation with its candidate (:meth:`_tell_likely`)
    on_leader: Callable[[Candidate], None] | None = None
    _told: Candidate | None = None                       # the leader on_leader was last called with

    def beaten(self, c: Candidate) -> bool:
        """Its lower bound exceeds (1 − prune_slack) x the best simulated makespan."""
        return c.bound_s > self.best * (1 - self.prune_slack) * (1 + 1e-12)

    def visit_all(self, cands: list[Candidate], progress: Callable[[int, int, str], None] | None = None) -> None:
        """Visit the candidates in order: tighten each bound, leave it at its closed form or simulate it. Up to
        ``pair_max_ranks`` ranks, two at a time: each candidate to simulate is simulated together with the
        next one that the best so far does not prune (:func:`~meshplan.search.beside.simulate_both`: both
        cores where fork is offered, else one after the other — the same answer), and both are recorded in
        order. So the second may be simulated where visiting one by one would have left it at a bound the
        first's time beats: one more simulated row, never one fewer, and a pick at least as fast. Above, one at a
        time, each beside the refinement of the next (:meth:`_visit_beside_refinement`) — or, one simulated on its
        representatives alone, beside the next such one (:meth:`_quotient_pair`)."""
        pairs = self.n <= self.pair_max_ranks      # in pairs where fork is not offered too: the same answer everywhere
        k = 0
        while k < len(cands):
            self._tell_leader()
            c = cands[k]
            if progress:
                progress(k, len(cands), short_label(c))
            k += 1
            if id(c) in self.ahead:                    # simulated beside the one before
                continue
            if not pairs:
                self._visit_beside_refinement(c, cands[k:])
                continue
            if not self._to_simulate(c):
                continue
            if id(c) in self.by_quotient:              # its representatives alone: not in a pair
                if self._simulate(c):
                    self.record(c)
                continue
            partner = None
            while pairs and k < len(cands):
                d = cands[k]
                if progress:
                    progress(k, len(cands), short_label(d))
                k += 1
                if self._to_simulate(d):
                    partner = d
                    break
            if self.leader is None:
                self._tell_likely(c)
            if partner is None and self.leader is not None and algorithms.get(c.algorithm).quotient_builds:
                simulate_unkept(c, self.topo, self.ccr)        # a rival of the leader: its representatives alone
            elif partner is None:
                simulate_candidate(c, self.topo, self.ccr)
            else:
                simulate_both(c, partner, self.topo, self.ccr, keep_below=self.best)
            self.record(c)
            if partner is not None:
                self.record(partner)
        self._tell_leader()

    def _tell_likely(self, c: Candidate) -> None:
        """Before the first simulation (no leader yet), call :attr:`on_leader` with its candidate — the best estimate,
        the likely pick — as soon as its schedule is built (the simulation then takes the same build): its write
        starts half a second sooner, stopped if another leads. Only where the method keeps its build on the plan
        (:class:`~meshplan.algorithms.base.BuiltTiming`: the simulation takes the same one) and has one variant
        (else the simulation picks among several schedules)."""
        alg = algorithms.get(c.algorithm)
        if self.on_leader is None or c is self._told or not isinstance(alg, BuiltTiming) or \
                type(alg).variants is not algorithms.Algorithm.variants:
            return
        c.schedule = alg.schedule(c.plan, self.topo)
        self._told = c
        self.on_leader(c)

    def _tell_leader(self) -> None:
        """Call :attr:`on_leader` with the leader if it has not been told of it yet."""
        if self.on_leader is not None and self.leader is not None and self.leader is not self._told:
            self._told = self.leader
            self.on_leader(self.leader)

    def _visit_beside_refinement(self, c: Candidate, upcoming: list[Candidate]) -> None:
        """Visit ``c`` (tighten, simulate or leave it) while a forked process tightens the bound of the next
        candidate that ``c``'s likely time would not prune (:meth:`_refine_next`) and, above
        ``full_sim_max_ranks`` ranks, finds whether its schedule has node symmetry while it is built: above
        ``pair_max_ranks`` ranks the search runs one thing at a time and a Mesh refinement builds a 0.75M-op
        schedule (~2–3 s at 1024 ranks), so the other core takes it. Where fork is not offered, the two run in turn:
        the same answer."""
        if self._quotient_pair(c, upcoming):
            return
        d = None if self.beaten(c) else self._refine_next(c, upcoming)      # c beaten: no work here to pair with
        if d is None:
            if self._to_simulate(c) and self._simulate(c):
                self.record(c)
            return

        def refine_there() -> tuple[Any, bool | None]:
            tighter = algorithms.get(d.algorithm).refine(d.plan, self.topo)
            return tighter, (reduces(d, self.topo) if self.n > self.full_sim_max_ranks else None)   # its build at hand

        def here() -> bool:
            return self._to_simulate(c) and self._simulate(c)

        if can_fork():
            (tighter, symmetric), simulated = alongside(refine_there, here)
        else:                          # in turn: a thread would share the build cache and the plans' with this one
            (tighter, symmetric), simulated = refine_there(), here()
        self.refined.add(id(d))
        if tighter is not None:
            d.timing = tighter
        if symmetric is not None:
            self.symmetric[id(d)] = symmetric
        if simulated:
            self.record(c)

    def _quotient_pair(self, c: Candidate, upcoming: list[Candidate]) -> bool:
        """Where ``c`` is to be simulated on its representatives alone (:meth:`_to_simulate`), and so is the next
        candidate that the best so far does not prune: simulate that one in a forked process meanwhile (both cores:
        a quotient build takes seconds at 1024 ranks, hundreds of MB), and record both in order — one more simulated
        row, never one fewer, and a pick at least as fast, as the pairs below ``pair_max_ranks``. False (nothing
        done) otherwise."""
        if self.beaten(c) or not can_fork() or not self._quotient_only(c):
            return False
        d = next((d for d in upcoming if not self.beaten(d)), None)
        if d is None or not self._quotient_only(d):
            return False
        if not self._to_simulate(c):                  # its refined bound is beaten: left at it
            return True

        def there():
            kept = simulate_variants(d, self.topo, self.ccr, quotient=True)
            return None if kept is None else (kept, d.predicted, d.sim)

        self.ahead.add(id(d))
        got, simulated = alongside(there, lambda: self._simulate(c))
        if simulated:
            self.record(c)
        if got is None:
            self._not_alike(d)
            return True
        kept, d.predicted, d.sim = got
        if kept:
            keep_variant(d, algorithms.get(d.algorithm).variants(d.plan, self.topo)[kept])
        d.model_level = "simulated"
        self.record(d)
        return True

    def _quotient_only(self, c: Candidate) -> bool:
        """Whether ``c`` is simulated on its representatives alone if at all (its method builds so, up to its
        ``quotient_search_max_ranks``, and not whole at this size)."""
        alg = algorithms.get(c.algorithm)
        return alg.search_may_build_quotient(self.n) and not alg.search_may_build(self.n)

    def _refine_next(self, c: Candidate, upcoming: list[Candidate]) -> Candidate | None:
        """The first of ``upcoming`` whose bound neither the best so far nor ``c``'s likely time (its estimate, at least
        its bound) prunes, if it is not refined yet, has a tighter form and its method builds at this size (a
        refinement may build the schedule); None otherwise."""
        likely = min(self.best, max(c.estimate_s, c.bound_s))
        for d in upcoming:
            if d.bound_s > likely * (1 - self.prune_slack) * (1 + 1e-12):
                continue
            alg = algorithms.get(d.algorithm)
            if id(d) in self.refined or not alg.refines(d.plan) or not alg.search_may_build(self.n):
                return None
            return d
        return None

    def _to_simulate(self, c: Candidate) -> bool:
        """Tighten ``c``'s bound (once something is simulated); False (``c`` left at its closed form) when the best
        so far prunes it or, above ``full_sim_max_ranks`` ranks, when its schedule has no node symmetry and a
        leader exists."""
        if self.best < float("inf") and not self.beaten(c) and id(c) not in self.refined:   # once a bound can prune
            refine_bound(c, self.topo)
            self.refined.add(id(c))
        if self.beaten(c):
            c.predicted = closed_form_predicted(c, self.ccr)
            forget_built(c)
            return False
        alg = algorithms.get(c.algorithm)
        if self._quotient_only(c):                 # its representatives' programs alone
            self.by_quotient.add(id(c))
            return True
        if not alg.search_may_build(self.n):       # not even the first: 17 GB and 90 s for USP at 2048 ranks
            c.predicted = closed_form_predicted(c, self.ccr)
            limit = alg.search_build_limit()
            c.not_simulated = f"its schedule is not built above {limit} ranks (seconds and GBs a plan)"
            self.unsimulated[f"schedule not built above {limit} ranks (simulate it alone)"] += 1
            return False
        if self.n > self.full_sim_max_ranks and self.leader is not None and not self._reduces(c):
            c.predicted = closed_form_predicted(c, self.ccr)
            c.not_simulated = f"no node symmetry above {self.full_sim_max_ranks} ranks: simulating it runs every rank"
            self.unsimulated[f"no node symmetry above {self.full_sim_max_ranks} ranks (simulate it alone)"] += 1
            forget_built(c)
            return False
        return True

    def _simulate(self, c: Candidate) -> bool:
        """Simulate ``c`` (on its representatives alone where :meth:`_to_simulate` said so); False, ``c`` left at
        its closed form, where its ranks could not be proved alike."""
        simulate_candidate(c, self.topo, self.ccr, quotient=id(c) in self.by_quotient)
        if c.model_level == "simulated":
            return True
        self._not_alike(c)
        return False

    def _not_alike(self, c: Candidate) -> None:
        """``c`` left at its closed form: its schedule is not built whole here and its ranks are not alike."""
        limit = algorithms.get(c.algorithm).search_build_limit()
        c.predicted = closed_form_predicted(c, self.ccr)
        c.not_simulated = f"its schedule is not built above {limit} ranks, and its ranks are not alike by node " \
                          "(each rank's program would be built)"
        self.unsimulated[f"schedule not built above {limit} ranks (simulate it alone)"] += 1

    def _reduces(self, c: Candidate) -> bool:
        """:func:`~meshplan.search.candidate.reduces`, or what the process that refined ``c`` found."""
        known = self.symmetric.get(id(c))
        return reduces(c, self.topo) if known is None else known

    def record(self, c: Candidate) -> None:
        """A simulated candidate: rejected when its simulated total is over the memory limit, else the leader if
        fastest so far (only the leader keeps its schedule)."""
        total = c.predicted.total.peak_memory_total_bytes
        if total > self.memory_limit:
            self.skipped[OVER_LIMIT[self.given]] += 1                 # the simulated total: wire images included
            self.rejected.append(over_memory(c, total, self.memory_limit, "simulated"))
            self.over.append((total, label(c)))
            c.predicted, c.model_level = None, "over-memory"
            forget_built(c)
            return
        if c.predicted.makespan_s < self.best:
            if self.leader is not None:
                forget_built(self.leader)
            self.best, self.leader = c.predicted.makespan_s, c
        else:
            forget_built(c)
