"""Each pass's deadlock, hazard and memory checks along its uncontended evaluation (part of the verifier,
:mod:`meshplan.plan.verify`), on one rank of each class of :func:`meshplan.plan.rank_classes.rank_classes` where
that proves the rest: the hazards checked there and the evaluation run there, each transfer's partner mapped into
the classes (:func:`meshplan.plan.rank_classes.class_partner`); the memory peaks sorted once per class. Where the
classes prove nothing (every rank its own, ranks of a class that pair or time differently, a deadlock, a hazard
found), every rank is checked and its ops named.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from meshplan.plan.dataflow import build_items, evaluate
from meshplan.plan.hazards import check_hazards
from meshplan.plan.peaks import peak_memories
from meshplan.plan.rank_classes import class_partner, rank_classes
from meshplan.plan.schedule import OP_KINDS, Schedule

#: violations of one kind listed (the rest counted): the verifier's
MAX_PER_KIND = 5


def passes_checked(sched: Schedule, partner: np.ndarray, dur: np.ndarray, tr: np.ndarray,
                   memory_bytes: float | None) -> list[tuple[list[tuple[str, list[str]]], float]]:
    """:func:`pass_checks` of every pass, on one rank of each class of :func:`rank_classes` where that proves the
    rest — for a schedule whose structure, tensors and transfers hold (each rank's references are its own)."""
    view = class_view(sched, partner, dur, tr)
    return [pass_checks(sched, phase, partner, dur, tr, memory_bytes,
                        lambda items, phase=phase: _hazards(sched, phase, partner, view.classes, items), view)
            for phase in sched.passes]


@dataclass
class ClassView:
    """A schedule's rank classes as the pass checks use them, made once for every pass: ``classes`` [n_ranks]
    (:func:`rank_classes`), ``reps`` the representatives, ``partner`` [n_ops] their transfers' partners within the
    representatives (:func:`class_partner`; None where that is not proved, or every rank is its own class), and
    ``rep_op`` [n_ops] the op at each op's place in its representative."""

    classes: np.ndarray
    reps: np.ndarray
    partner: np.ndarray | None
    rep_op: np.ndarray


def class_view(sched: Schedule, partner: np.ndarray, dur: np.ndarray, tr: np.ndarray) -> ClassView:
    """The :class:`ClassView` of a schedule whose references are each rank's own, for op times ``dur``, ``tr``."""
    classes = rank_classes(sched)
    reps = np.unique(classes)
    o = sched.ops
    q_partner = class_partner(sched, classes, partner, dur, tr) if len(reps) < sched.n_ranks else None
    return ClassView(classes, reps, q_partner,
                     sched.rank_ptr[classes[o.rank]] + np.arange(len(o)) - sched.rank_ptr[o.rank])


def pass_checks(sched: Schedule, phase: int, partner: np.ndarray, dur: np.ndarray, tr: np.ndarray,
                memory_bytes: float | None, hazards, view: ClassView | None = None
                ) -> tuple[list[tuple[str, list[str]]], float]:
    """One pass's deadlock, hazard and memory checks along its uncontended evaluation: ([(kind, violations)] in the
    order found, its peak buffer bytes on the busiest rank). ``hazards``: a function of the pass's items (None where
    they were not built) that finds its hazard violations. ``view``: the rank classes, to evaluate on one rank of
    each (:func:`_class_times`)."""
    times = _class_times(sched, phase, dur, tr, view)
    if times is None:                              # not provable from the classes, or not a valid pass: every rank
        items = build_items(sched, phase, partner)
        adds = [("deadlock", [f"op {int(items.members[items.member_ptr[i]])}: depends on another op of its own "
                              f"batch (a cycle)" for i in items.self_dep])]
        ev = evaluate(items, dur, tr)
        if not ev.complete:
            return adds + [("deadlock", _stuck(sched, items, ev))], 0.0
        (start, end), rep_op = _op_times(len(sched.ops), items, ev, np.arange(len(sched.ops))), None
    else:
        items, (start, end, rep_op), adds = None, times, [("deadlock", [])]
    adds.append(("hazard", hazards(items)))
    peak = peak_memories(sched, phase, start, end, rep_op=rep_op)[0]     # rep_op: one sort per class, as exact
    if memory_bytes is not None and peak.max(initial=0) > memory_bytes:
        r = int(peak.argmax())
        adds.append(("memory", [f"rank {r} needs {peak[r] / 1e9:.3g} GB of buffers in {('fwd', 'bwd')[phase]}, "
                                f"more than the device's {memory_bytes / 1e9:.3g} GB"]))
    return adds, float(peak.max(initial=0))


def _class_times(sched: Schedule, phase: int, dur: np.ndarray, tr: np.ndarray,
                 view: ClassView | None) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
    """([n_ops] start, end, the op at each op's place in its representative rank) of the pass's ops along its
    uncontended evaluation, evaluated on one rank of each class (``view``; :func:`class_partner`: 896,000 ops of a
    1024-rank Mesh schedule evaluated as 875), or None where that does not prove them — ranks of a class that pair
    or take time differently, no fewer ranks, or a pass that is not deadlock-free (evaluated on every rank then,
    its ops named)."""
    if view is None or view.partner is None:
        return None
    items = build_items(sched, phase, view.partner, ranks=view.reps)
    ev = evaluate(items, dur, tr)
    if len(items.self_dep) or not ev.complete:
        return None
    return (*_op_times(len(sched.ops), items, ev, view.rep_op), view.rep_op)


def _op_times(n: int, items, ev, source: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """([n] start, end) of each op of the pass of ``items``, as the evaluation ``ev`` times op ``source[op]`` (its
    representative's at its place, or itself); NaN for the ops of other passes."""
    item = items.item_of_op[source]
    mine = np.flatnonzero(item >= 0)
    start, end = np.full(n, np.nan), np.full(n, np.nan)
    start[mine], end[mine] = ev.start[item[mine]], ev.end[item[mine]]
    return start, end


def _hazards(sched: Schedule, phase: int, partner: np.ndarray, classes: np.ndarray, items=None) -> list[str]:
    """:func:`check_hazards` of one pass on one rank of each class of :func:`rank_classes` and on the last rank —
    whose last item the check reads for an op outside the pass, as on every rank: the same verdict as on every rank
    (a 1024-rank Mesh schedule: 1.2 → 0.02 CPU-s for both passes). Where it finds any violation, on every rank
    (``items``: the pass's, built here if None): the full list, each rank's ops named."""
    reps = np.union1d(classes, [sched.n_ranks - 1])
    if len(reps) < sched.n_ranks and not check_hazards(sched, build_items(sched, phase, partner, ranks=reps)):
        return []
    return check_hazards(sched, build_items(sched, phase, partner) if items is None else items)


def _stuck(s: Schedule, items, ev) -> list[str]:
    never = np.flatnonzero(~np.isfinite(ev.end))
    lines = []
    for i in never[:MAX_PER_KIND]:
        op = int(items.members[items.member_ptr[i]])
        lines.append(f"deadlock: op {op} ({OP_KINDS[s.ops.kind[op]]}) on rank {s.ops.rank[op]} stream "
                     f"{s.streams.names[s.ops.stream[op]]!r} never completes")
    return lines + ([f"... {len(never)} items never complete"] if len(never) > MAX_PER_KIND else [])
