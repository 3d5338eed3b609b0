"""Symmetry reduction: ranks whose programs are equal up to a node permutation are simulated once.

Candidate symmetries are rank permutations: those the algorithm declares (``Schedule.symmetries``, e.g.
Mesh's grid translations, USP's ring turns and moves), else the shift by one node (r -> r + G mod N). A candidate
σ is accepted when

* it moves whole nodes: every rank of a node lands on one node, at the same local device index (all nodes
  are alike and the network is non-blocking, so any node permutation is an automorphism of the topology);
* it preserves every program: rank σ(g) runs rank g's ops, position by position, with equal kinds,
  streams, steps, bytes, dtypes and durations (bit-equal), peers mapped by σ, deps at the same positions — or on
  the same P2P batch (its members start and end together: one item of the simulation) —, and transfers matched to
  the σ-image of the same partners.

If the accepted permutations generate orbits holding exactly one rank of every node, the max-min
trajectory is invariant under them, so simulating node 0's ranks (the representatives), with each flow's
load counted on the node-0 copy of every link it crosses, gives exactly the full simulation
(``tests/cost/test_simulate.py`` checks it against the full simulation on up to 64 ranks).

Approximate reduction: when durations differ inside orbits by at most ``DURATION_TOLERANCE`` (relative;
striped layouts, whose blocks differ by c pairs in c², are the case), the quotient is simulated with each
orbit's largest duration — exact for that slightly slower schedule, so the prediction errs on the slow
side by at most about the tolerance. ``Reduction.exact`` says which it was.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from meshplan.model.topology import Topology
from meshplan.plan.dataflow import batch_joins
from meshplan.plan.quotient import moves_whole_nodes, orbit_reps
from meshplan.plan.schedule import Schedule


@dataclass(frozen=True)
class Reduction:
    """``reps``: the representative ranks (sorted); ``rep_op[op]``: the representative's op at the same position."""

    reps: np.ndarray
    rep_op: np.ndarray
    exact: bool = True
    durations: np.ndarray | None = None   # orbit-max durations when the reduction is approximate

    @property
    def n_reps(self) -> int:
        """Number of representative ranks."""
        return len(self.reps)


def identity(sched: Schedule) -> Reduction:
    """No reduction: every rank is its own representative."""
    return Reduction(np.arange(sched.n_ranks), np.arange(len(sched.ops)))


DURATION_TOLERANCE = 1e-2


def find_reduction(sched: Schedule, topo: Topology, durations: np.ndarray, partner: np.ndarray,
                   tolerance: float = DURATION_TOLERANCE) -> Reduction:
    """The largest reduction the candidate symmetries allow (identity when none holds)."""
    n, g = sched.n_ranks, topo.gpus_per_node
    if not topo.node_symmetric or topo.n_devices != n:
        return identity(sched)
    gens = list(getattr(sched, "symmetries", None) or [])
    if not gens and n % g == 0:
        gens = [(np.arange(n) + g) % n]
    gens = [s for s in gens if moves_whole_nodes(s, sched.device_of_rank, topo.gpus_per_node, topo.n_nodes)
            and _preserves_programs(sched, s, durations, partner, tolerance)]
    if not gens:
        return identity(sched)
    rep_of = _orbit_reps(sched, topo, gens)
    if rep_of is None:
        return identity(sched)
    o = sched.ops
    rank = o.rank.astype(np.int64)
    local = np.arange(len(o)) - sched.rank_ptr[rank]
    rep_op = sched.rank_ptr[rep_of[rank]] + local
    worst = np.zeros(len(o))
    np.maximum.at(worst, rep_op, durations)
    exact = bool(np.array_equal(worst[rep_op], durations))
    return Reduction(np.unique(rep_of), rep_op, exact, None if exact else worst)


def _preserves_programs(sched: Schedule, sigma: np.ndarray, durations: np.ndarray, partner: np.ndarray,
                        tolerance: float = 0.0) -> bool:
    counts = np.diff(sched.rank_ptr)
    if not np.array_equal(counts[sigma], counts):
        return False
    o = sched.ops
    rank = o.rank.astype(np.int64)
    local = np.arange(len(o)) - sched.rank_ptr[rank]
    img = sched.rank_ptr[sigma[rank]] + local                       # σ-image of every op
    fields = (o.kind, o.stream, o.phase, o.step, o.size_bytes, o.dtype, o.combine)
    if not all(np.array_equal(f[img], f) for f in fields):
        return False
    if not np.allclose(durations[img], durations, rtol=tolerance, atol=0.0):
        return False
    comm = o.peer >= 0
    if not np.array_equal(o.peer[img][comm], sigma[o.peer[comm]]):
        return False
    has = partner >= 0
    p = partner[has]
    p_img = sched.rank_ptr[sigma[o.rank[p]]] + (p - sched.rank_ptr[o.rank[p]])
    if not np.array_equal(partner[img[has]], p_img):
        return False
    if not np.array_equal(np.diff(o.dep_ptr)[img], np.diff(o.dep_ptr)):
        return False
    owner = np.repeat(np.arange(len(o)), np.diff(o.dep_ptr))
    pos = np.arange(len(o.deps)) - o.dep_ptr[owner]
    dep_img = o.deps[o.dep_ptr[img[owner]] + pos]
    if np.array_equal(dep_img, img[o.deps]):
        return True
    head = batch_heads(sched)             # a dep on another member of the same P2P batch: the same item
    return bool(np.array_equal(head[dep_img], head[img[o.deps]]))


def batch_heads(sched: Schedule) -> np.ndarray:
    """[n_ops] the first op of each op's P2P batch (itself for an op alone): the items of
    :func:`meshplan.plan.dataflow.build_items` (:func:`~meshplan.plan.dataflow.batch_joins`) — a batch's members
    start and end together, so a dependency on any member is a dependency on the batch."""
    o = sched.ops
    order = np.lexsort((np.arange(len(o)), o.phase, o.stream, o.rank))
    _, joins = batch_joins(o, order)
    start = np.flatnonzero(~joins)
    head = np.empty(len(o), dtype=np.int64)
    head[order] = order[start[np.cumsum(~joins) - 1]]
    return head


def _orbit_reps(sched: Schedule, topo: Topology, gens: list[np.ndarray]) -> np.ndarray | None:
    """rep_of[rank] = its orbit's member on node 0, if every orbit holds one rank of every node
    (:func:`meshplan.plan.quotient.orbit_reps` with a single node orbit)."""
    orbits = orbit_reps(sched.n_ranks, sched.device_of_rank, topo.gpus_per_node, topo.n_nodes, gens)
    if orbits is None or (orbits[1] != 0).any():
        return None
    return orbits[0]


def link_orbit_rep(topo: Topology, links: np.ndarray, node_rep: np.ndarray | None = None) -> np.ndarray:
    """The node-0 copy of each link (links are numbered node by node, ``links_per_node`` each) — or, with
    ``node_rep`` ([nodes]: each node's orbit's first node, a quotient's), the copy on its node's representative."""
    links = np.asarray(links)
    if node_rep is None:
        return links % topo.links_per_node
    per = topo.links_per_node
    return node_rep[links // per] * per + links % per
