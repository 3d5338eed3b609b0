"""What every algorithm module provides, and the knob plumbing they share.

An algorithm decides *who computes what, who sends what to whom, and in what order* (plan + schedule);
the shared builder (:class:`~meshplan.plan.build.ScheduleBuilder`) does the plumbing. Each algorithm also
gives a closed-form (L0) timing: an uncontended per-step alpha-beta recurrence, which is a lower bound
on the simulated makespan because contention and overlap only slow ops down.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from meshplan.core.errors import UserError
from meshplan.cost.bounds import PassTiming, schedule_timing
from meshplan.model.matrix import AttnMatrix
from meshplan.model.topology import Topology
from meshplan.model.workload import Workload
from meshplan.plan.build import ScheduleBuilder
from meshplan.plan.plan import Plan
from meshplan.plan.schedule import DTYPES, Schedule

#: Knobs with their own CLI flag; every other knob is ``--knob name=value``.
#: A search builds no schedule above this many ranks, whatever the method (neither to tighten a bound nor to
#: simulate, whole or on its representatives): one Mesh build at 4096 ranks and 1M tokens took over a minute and 10 GB
#: before it was simulated, a 2048-rank search that simulated one Mesh plan 150 s and 7 GB. There the search ranks by
#: closed forms alone and says so (2048 GPUs: 20 s, 2.2 GB); ``meshplan simulate --algo`` times a plan at any size.
SEARCH_BUILD_MAX_RANKS = 1024

KNOB_FLAGS = {"tile": "--tile", "mapping": "--mapping", "partial_dtype": "--partial-dtype",
              "dkv_dtype": "--dkv-dtype", "ulysses_degree": "--ulysses-degree", "inner_ring": "--inner-ring",
              "team_size": "--team-size", "domains": "--domains"}


def positive_int_or_auto(raw: str) -> str | int:
    """Parse a knob that is ``auto`` or a positive integer (ValueError otherwise)."""
    if raw == "auto":
        return raw
    value = int(raw)
    if value < 1:
        raise ValueError(raw)
    return value


def knob_flag(name: str) -> str:
    """The CLI spelling of a knob."""
    return KNOB_FLAGS.get(name, f"--knob {name}")


def knob_arg(name: str, value) -> str:
    """A knob and its value as command-line words: ``--tile 8x32``, or ``--knob dkv_hops=n-1``."""
    flag = knob_flag(name)
    return f"{flag}={value}" if flag.startswith("--knob") else f"{flag} {value}"


@dataclass(frozen=True)
class Knob:
    """One knob: its choices (or a parser), its default and what it means."""

    name: str
    default: Any
    choices: tuple[Any, ...] | None = None
    help: str = ""
    parse: Callable[[str], Any] | None = None

    def value(self, raw: Any, algorithm: str) -> Any:
        """Parse and check a user value."""
        v = raw
        if self.parse is not None and isinstance(raw, str):
            try:
                v = self.parse(raw)
            except ValueError:
                raise UserError(knob_flag(self.name), f"cannot read {raw!r}", self.help) from None
        if self.choices is not None and v not in self.choices:
            raise UserError(knob_flag(self.name), f"{algorithm} does not take {raw!r}",
                            f"use one of {', '.join(map(str, self.choices))}")
        return v


DTYPE_KNOB = lambda name, default, help_: Knob(name, default, DTYPES, help_)  # noqa: E731


class BuildCache:
    """Recent schedule builds shared by plans that build the same ops (Mesh plans that differ only in their
    mapping), keyed by what determines the ops. Owned by whoever plans many candidates (a search run creates one,
    attaches it to its plans as ``plan.extra["builds"]`` and clears it when done); a plan without one builds alone.
    Holds at most ``size`` builds and, past the newest, at most ``max_ops`` ops (a 1024-rank Mesh build is 0.9M
    ops, ~400 MB)."""

    def __init__(self, size: int = 4, max_ops: int = 1_000_000) -> None:
        self.size, self.max_ops, self._built = size, max_ops, {}

    def get(self, key: tuple, build: Callable[[], Schedule]) -> Schedule:
        """The build under ``key``, made by ``build()`` on a miss (the oldest dropped past ``size`` or
        ``max_ops``)."""
        sched = self._built.get(key)
        if sched is None:
            sched = self._built[key] = build()
            while len(self._built) > 1 and (len(self._built) > self.size or
                                            sum(len(s.ops) for s in self._built.values()) > self.max_ops):
                self._built.pop(next(iter(self._built)))
        return sched

    def clear(self) -> None:
        """Drop every build."""
        self._built.clear()


class Algorithm:
    """Base class: subclasses set ``name``, ``knobs`` and implement plan/schedule/timing."""

    name: str = ""
    knobs: dict[str, Knob] = {}
    forward_only: bool = False
    summary: str = ""
    #: the method plans its own token layout (doc-place): search plans it once, not once per --layout, and its
    #: candidate carries the planned workload
    places_tokens: bool = False

    def normalize(self, given: dict[str, Any]) -> dict[str, Any]:
        """Defaults filled in and values checked; a knob this algorithm does not take is refused."""
        out = {}
        for key, raw in given.items():
            if key not in self.knobs:
                takes = ", ".join(knob_flag(k) for k in self.knobs) or "no knobs"
                raise UserError(knob_flag(key), f"{self.name} does not take this knob", f"{self.name} takes {takes}")
            out[key] = self.knobs[key].value(raw, self.name)
        return {k: out.get(k, kn.default) for k, kn in self.knobs.items()}

    def check(self, workload: Workload, topo: Topology, n_ranks: int, knobs: dict[str, Any]) -> None:
        """Raise SkipCandidate/UserError when this (workload, N, knobs) cannot run. Default: anything goes."""
        if workload.passes != "fwd" and self.forward_only:
            from meshplan.core.errors import SkipCandidate
            raise SkipCandidate("forward only", f"{self.name} has no backward pass: add --pass fwd to time its forward")

    def knob_space(self, workload: Workload, topo: Topology, n_ranks: int,
                   filters: dict[str, Any]) -> list[dict[str, Any]]:
        """Knob settings search enumerates (``filters`` pins knobs the user gave)."""
        return [self.normalize(filters)]

    def device_map(self, topo: Topology, n_ranks: int, knobs: dict[str, Any]) -> np.ndarray:
        """rank -> device. ``auto``/``identity``: rank r on device r (locality order)."""
        return np.arange(n_ranks)

    def plan(self, workload: Workload, topo: Topology, n_ranks: int, knobs: dict[str, Any],
             matrix: AttnMatrix | None = None) -> Plan:
        """Who computes which block and where chunks live."""
        raise NotImplementedError

    def schedule(self, plan: Plan, topo: Topology) -> Schedule:
        """Lower a plan to ops."""
        raise NotImplementedError

    def timing(self, plan: Plan, topo: Topology) -> dict[str, PassTiming]:
        """Closed-form timing per pass (``fwd``/``bwd`` as the workload asks); cheap, no schedule needed."""
        raise NotImplementedError

    def variants(self, plan: Plan, topo: Topology) -> list[Plan]:
        """Alternative plans the simulator should judge (the best is kept); default: just this one."""
        return [plan]

    def refine(self, plan: Plan, topo: Topology) -> dict[str, PassTiming] | None:
        """A tighter closed form, if the algorithm has one (may build the schedule); None otherwise."""
        return None

    def refines(self, plan: Plan) -> bool:
        """Whether :meth:`refine` has a tighter closed form for this plan (False: it returns None)."""
        return False

    def search_build_limit(self) -> int:
        """Ranks above which a search never builds this method's schedule (:data:`SEARCH_BUILD_MAX_RANKS`)."""
        return SEARCH_BUILD_MAX_RANKS

    def search_may_build(self, n_ranks: int) -> bool:
        """Whether a search may build this method's schedule at ``n_ranks`` ranks to simulate or estimate it."""
        return n_ranks <= self.search_build_limit()

    def lazy(self, n_ranks: int) -> bool:
        """Whether a search starts this method's plans at ``n_ranks`` ranks from a schedule-free bound and builds a
        schedule only to simulate (:class:`BuiltTiming`); False: its closed form needs no schedule anyway."""
        return False

    #: the method's builds may be quotient builds (:mod:`meshplan.plan.quotient`: every builder call goes through
    #: ``new_builder`` and no build is shared between plans); each one checks its symmetries as it goes
    quotient_builds = False
    #: a search tries a quotient build up to this many ranks (its calls still run for every rank: USP degree 32 at
    #: 1024 ranks 4-8 s and ~1 GB, about 16x that at 4096); ``simulate`` at any size
    quotient_search_max_ranks = 1024

    def search_may_build_quotient(self, n_ranks: int) -> bool:
        """Whether a search may try a quotient build of this method at ``n_ranks`` ranks (up to its
        ``quotient_search_max_ranks`` and :data:`SEARCH_BUILD_MAX_RANKS`)."""
        return self.quotient_builds and n_ranks <= min(self.quotient_search_max_ranks, SEARCH_BUILD_MAX_RANKS)

    def symmetries(self, plan: Plan, topo: Topology) -> list[list[np.ndarray]]:
        """Sets of rank permutations the plan's schedule may repeat under, the most reducing first (a quotient build
        tries each until one is proved); default the shift by one node."""
        n, g = plan.n_ranks, topo.gpus_per_node
        return [[(np.arange(n) + g) % n]] if n % g == 0 and n > g else []

    def quotient_schedule(self, plan: Plan, topo: Topology) -> Schedule | None:
        """The plan's schedule built for its representative ranks only (one node of each node orbit), the others
        proved to repeat them (:mod:`meshplan.plan.quotient`: for a simulation, 1/orbit of the ops), under the first
        of :meth:`symmetries` that holds; None where the method, the workload, the topology or every set of
        permutations fails (build it whole then)."""
        from meshplan.plan.quotient import NotSymmetric, QuotientCheck, orbit_reps, quotient_workload

        n = plan.n_ranks
        if not (self.quotient_builds and quotient_workload(plan.workload) and topo.node_symmetric
                and topo.n_devices == n):
            return None
        from meshplan.cost.cost import CostModel

        for gens in self.symmetries(plan, topo):
            orbits = orbit_reps(n, plan.device_of_rank, topo.gpus_per_node, topo.n_nodes, gens)
            if orbits is None:
                continue
            plan.extra["quotient"] = QuotientCheck(n, gens, *orbits, np.asarray(plan.device_of_rank) //
                                                   topo.gpus_per_node, CostModel(topo).durations_of, plan.workload,
                                                   plan.matrix.n)
            try:
                return self.build(plan, topo)
            except NotSymmetric:
                continue
            finally:
                plan.extra.pop("quotient", None)
        return None


class BuiltTiming(Algorithm):
    """Algorithms whose closed form is the built schedule's (:func:`~meshplan.cost.bounds.schedule_timing`).

    ``schedule`` builds once per plan (``plan.extra["schedule"]``); ``timing`` builds a throw-away copy, so
    a search holding many candidates holds none of their schedules. Building costs about 20 s and 3 GB at
    1024 ranks, so search enumerates these methods up to ``search_max_ranks`` ranks (``simulate --algo``
    takes any N) — above it, those with a schedule-free bound (``schedule_free``) too, by that bound.
    """

    search_max_ranks = 256
    #: the method has a closed form that needs no schedule (:meth:`schedule_free_timing`): taken above
    #: ``search_max_ranks`` ranks, where search then enumerates it too and simulates it only while nothing else is
    schedule_free = False
    #: above this many ranks search enumerates one variant of each (the zigzag layout, the default knobs that
    #: only reorder a schedule): each bound builds a schedule of up to seconds
    search_variants_max_ranks = 64
    #: the closed form also carries the contended estimate (``estimate_s``, :mod:`meshplan.cost.estimate`): for
    #: methods planned where simulating costs too much (``plan_batch``)
    contended_estimate = False
    #: in a search, from this many ranks a method with ``schedule_free`` starts from that bound (a plan marked
    #: ``extra["lazy"]``): its schedule is built only for a candidate the bound does not prune, to simulate it (the
    #: bound is within 0.1% of the built form's there, so a refinement would prune nothing more). None: never
    lazy_from: int | None = 128
    #: the schedule-free bound is looser than the built form: a lazy plan the bound does not prune is refined by its
    #: built form (:meth:`refine`) before the search decides to simulate it
    lazy_refines = False

    def build(self, plan: Plan, topo: Topology) -> Schedule:
        """Lower a plan to ops (the subclass's work)."""
        raise NotImplementedError

    def schedule(self, plan: Plan, topo: Topology) -> Schedule:
        """The plan's schedule, built on first use."""
        sched = plan.extra.get("schedule")
        if sched is None:
            sched = plan.extra["schedule"] = self.build(plan, topo)
        return sched

    def schedule_free_timing(self, plan: Plan, topo: Topology) -> dict[str, PassTiming]:
        """A lower bound per pass from the plan alone (methods with ``schedule_free``)."""
        raise NotImplementedError

    def builds_to_time(self, n_ranks: int) -> bool:
        """Whether :meth:`timing` builds the schedule at ``n_ranks`` ranks (no schedule-free form taken there)."""
        return not (self.schedule_free and n_ranks > self.search_max_ranks)

    def search_build_limit(self) -> int:
        """``search_max_ranks`` where the closed form is schedule-free (seconds and GBs a plan), at most
        :data:`SEARCH_BUILD_MAX_RANKS`."""
        return min(self.search_max_ranks, SEARCH_BUILD_MAX_RANKS) if self.schedule_free else SEARCH_BUILD_MAX_RANKS

    def lazy(self, n_ranks: int) -> bool:
        """Whether a search starts this method's candidates at ``n_ranks`` ranks from the schedule-free bound."""
        return self.schedule_free and self.lazy_from is not None and n_ranks >= self.lazy_from

    def refines(self, plan: Plan) -> bool:
        """A lazy plan of a method whose schedule-free bound is looser (``lazy_refines``), at a size a search may
        build (above ``search_max_ranks`` the refinement would build the schedule the search never builds there)."""
        return bool(self.lazy_refines and plan.extra.get("lazy") and self.search_may_build(plan.n_ranks))

    def refine(self, plan: Plan, topo: Topology) -> dict[str, PassTiming] | None:
        """A lazy plan's built closed form where the schedule-free bound is looser (``lazy_refines``; the schedule is
        kept on the plan for the simulation); None otherwise."""
        if not self.refines(plan):
            return None
        return schedule_timing(self.schedule(plan, topo), topo, contended=self.contended_estimate)

    def timing(self, plan: Plan, topo: Topology) -> dict[str, PassTiming]:
        """The built schedule's closed form (uncontended evaluation, busiest link; the contended estimate where
        ``contended_estimate``); without a schedule built, above ``search_max_ranks`` ranks or for a plan marked
        ``lazy``, the schedule-free bound where the method has one."""
        cached = plan.extra.get("schedule")
        free = not self.builds_to_time(plan.n_ranks) or (self.schedule_free and plan.extra.get("lazy"))
        if cached is None and free:
            return self.schedule_free_timing(plan, topo)
        return schedule_timing(cached if cached is not None else self.build(plan, topo), topo,
                               contended=self.contended_estimate)


def new_builder(alg: Algorithm, plan: Plan, topo: Topology) -> ScheduleBuilder:
    """A builder for ``plan`` with its topology recorded."""
    return ScheduleBuilder(plan.workload, plan.matrix, plan.n_ranks, algorithm=alg.name, knobs=plan.knobs,
                           device_of_rank=plan.device_of_rank, quotient=plan.extra.get("quotient"))


def topology_record(topo: Topology) -> dict:
    """What a schedule records about the topology it was planned for."""
    return {"name": topo.name, "hash": topo.content_hash, "devices": topo.n_devices}


def last_compute_op(steps: list[np.ndarray], n: int) -> np.ndarray:
    """[n] each rank's last compute op over the ring's steps."""
    last = np.full(n, -1)
    for ops in steps:
        last = np.where(ops >= 0, ops, last)
    return last
