"""Symmetry reduction: ranks whose programs are equal up to a shift by whole nodes are simulated once.

Shift σ: rank r -> r + G mod N (G ranks per node). σ is a symmetry of (schedule, topology, costs) when
every node is alike (:attr:`Topology.node_symmetric`), the mapping commutes with σ (device(r + G) =
device(r) + G), and every rank runs the same program as its representative r mod G: same op kinds,
streams, steps, bytes, dtypes and durations (bit-equal), peers at the same offsets, deps at the same
local positions, and transfers matched to ops at the same local positions. Then the (unique) max-min
trajectory is σ-invariant, so simulating the representatives 0..G−1, with each flow's load counted on
the node-0 copy of every link it crosses, gives exactly the full simulation
(``tests/test_simulate.py`` checks it against the full simulation on up to 64 ranks).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from meshplan.schedule import Schedule
from meshplan.topology import Topology


@dataclass(frozen=True)
class Reduction:
    """Representatives 0..n_reps−1; ``rep_op[op]`` is the representative's op at the same position."""

    n_reps: int
    rep_op: np.ndarray


def identity(sched: Schedule) -> Reduction:
    """No reduction: every rank is its own representative."""
    return Reduction(sched.n_ranks, np.arange(len(sched.ops)))


def find_reduction(sched: Schedule, topo: Topology, durations: np.ndarray, partner: np.ndarray) -> Reduction:
    """The node-shift reduction if it is a symmetry of everything that times the schedule, else identity."""
    n, g = sched.n_ranks, topo.gpus_per_node
    if not topo.node_symmetric or n % g or n <= g or topo.n_devices != n:
        return identity(sched)
    dev = sched.device_of_rank
    if not np.array_equal(dev[(np.arange(n) + g) % n], (dev + g) % n):
        return identity(sched)
    counts = np.diff(sched.rank_ptr)
    if not np.array_equal(counts, counts[np.arange(n) % g]):
        return identity(sched)
    o = sched.ops
    rank = o.rank.astype(np.int64)
    local = np.arange(len(o)) - sched.rank_ptr[rank]
    rep = sched.rank_ptr[rank % g] + local
    same = lambda a: np.array_equal(a, a[rep])  # noqa: E731
    fields = (o.kind, o.stream, o.phase, o.step, o.size_bytes, o.dtype, o.combine, durations)
    if not all(same(f) for f in fields):
        return identity(sched)
    comm = o.peer >= 0
    if not same(np.where(comm, (o.peer - rank) % n, -1)):
        return identity(sched)
    p_rank = o.rank[np.maximum(partner, 0)].astype(np.int64)
    p_local = np.where(partner >= 0, partner - sched.rank_ptr[p_rank], -1)
    if not (same(np.where(partner >= 0, (p_rank - rank) % n, -1)) and same(p_local)):
        return identity(sched)
    if not np.array_equal(np.diff(o.dep_ptr), np.diff(o.dep_ptr)[rep]):
        return identity(sched)
    dep_owner = np.repeat(np.arange(len(o)), np.diff(o.dep_ptr))
    dep_local = o.deps - sched.rank_ptr[rank[dep_owner]]
    rep_deps = o.deps[o.dep_ptr[rep[dep_owner]] + (np.arange(len(o.deps)) - o.dep_ptr[dep_owner])]
    if not np.array_equal(dep_local, rep_deps - sched.rank_ptr[rank[dep_owner] % g]):
        return identity(sched)
    return Reduction(g, rep)


def link_orbit_rep(topo: Topology, links: np.ndarray) -> np.ndarray:
    """The node-0 copy of each link (links are numbered node by node, ``links_per_node`` each)."""
    return np.asarray(links) % topo.links_per_node
