"""Where each document of a pack goes: whole on one rank, or split across a subgroup sized to it.

The plan space of ``doc-place`` (issue 25; docs/algorithms.md, "doc-place"). A packed batch holds documents of
very different lengths. A short document kept whole on one rank needs no communication at all; a long one is
split only as far as it must be, across a subgroup of consecutive ranks (inside a node when it fits there), where
a ring (or Ulysses inside the node) runs over it alone.

**Work.** A causal document of L tokens costs the tiles a tiled kernel computes for it,
``tile_count(L, L, 0, tq, tk) · tq · tk`` element pairs (:func:`~meshplan.model.doc_segments.tile_count`: L(L+1)/2
with 1×1 tiles, plus the partial tiles' waste with real ones).

**Balance.** Longest Processing Time first (R. L. Graham, "Bounds on multiprocessing timing anomalies", SIAM J.
Appl. Math. 17(2), 1969): documents in decreasing work, each to the rank with the least work so far. Without
other limits its makespan is at most (4/3 − 1/(3m)) × the optimum, and like every greedy list schedule at most
the mean work plus the largest document's. The rest of the layer (projections, MLP, activations) costs by tokens,
so a rank also takes at most ``token_cap`` × the mean tokens per rank (1.25 by default): a document goes to the
least-loaded rank that has room, and where none has, to the one with the fewest tokens (the placement then says
so in ``cap_ok``; the planner refuses or flags it).

**Split.** A document whose work exceeds the mean work per rank, or whose tokens exceed the token cap, is split
over g ranks, the smallest g with work/g ≤ the mean work and tokens/g ≤ the cap (any g, not only powers of two;
rounded up to a size that runs head-parallel where ``group_unit`` asks). Split documents are placed first,
largest first, each on the g consecutive ranks with the least work between them (within one node when
g ≤ ranks per node; node-aligned groups of whole nodes beyond) that share no rank with another group — or, when
no such window is left, over the whole of the least-loaded existing group of at least g ranks; each member takes
an equal share of its work and tokens (zigzag inside the group balances a causal document's work).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from meshplan.model.doc_segments import tile_count

DEFAULT_TOKEN_CAP = 1.25


@dataclass(frozen=True)
class DocPlacement:
    """A placement of ``n_docs`` documents on ``n_ranks`` ranks.

    Attributes:
        owner: [n_docs] int64, the rank holding a whole document; −1 for a split one.
        groups: split documents: document index → the ranks (consecutive, ascending) sharing it.
        rank_work: [n_ranks] float64, element pairs per rank (tile-quantised; a split document's share is its
            work / g).
        rank_tokens: [n_ranks] float64, tokens per rank (slots, padding included; a share is tokens / g).
        token_cap: the most tokens a rank may take (``token_cap`` × mean).
        cap_ok: every rank within ``token_cap``.
    """

    owner: np.ndarray
    groups: dict[int, tuple[int, ...]]
    rank_work: np.ndarray
    rank_tokens: np.ndarray
    token_cap: float
    cap_ok: bool

    @property
    def imbalance(self) -> float:
        """Largest work per rank over the mean (1.0 = perfect balance)."""
        mean = self.rank_work.mean()
        return float(self.rank_work.max() / mean) if mean > 0 else 1.0

    @property
    def doc_ranks(self) -> tuple[tuple[int, int], ...]:
        """Per document (first rank, group size): what the workload carries (``Workload.doc_ranks``)."""
        out = [(int(r), 1) for r in self.owner]
        for d, ranks in self.groups.items():
            out[d] = (ranks[0], len(ranks))
        return tuple(out)


def document_work(lengths, tile: tuple[int, int] = (1, 1)) -> np.ndarray:
    """[n_docs] element pairs a tiled kernel computes for causal documents of ``lengths`` tokens (float64).

    ``tile`` = (rows, keys) of the kernel's tile; (1, 1) gives the exact pairs L(L+1)/2.
    """
    lens = np.asarray(lengths, dtype=np.int64)
    tq, tk = tile
    return tile_count(lens, lens, 0, tq, tk).astype(np.float64) * tq * tk


def place_documents(lengths, n_ranks: int, *, slots=None, tile: tuple[int, int] = (1, 1),
                    token_cap: float = DEFAULT_TOKEN_CAP, ranks_per_node: int | None = None,
                    group_unit: int = 1) -> DocPlacement:
    """Place documents on ranks by their work, within a token cap (module docstring).

    Args:
        lengths: real tokens per document (what attends), in pack order.
        n_ranks: ranks of the context-parallel group (≥ 1).
        slots: tokens each document occupies (its slot, padding included); default ``lengths``.
        tile: the kernel's tile (rows, keys), for the work of a document.
        token_cap: the most tokens per rank, as a multiple of the mean (≥ 1).
        ranks_per_node: ranks of one node (a split group stays inside one when it fits); default ``n_ranks``.
        group_unit: a split group's size is rounded up to a divisor of it (up to it) or a multiple of it (beyond),
            where that fits ``n_ranks``: the Ulysses degree the heads allow inside a node, so the group can run
            head-parallel (``doc-place``); 1 leaves the sizes as the work needs them.

    Returns:
        The placement; deterministic (ties go to the lower rank).

    Raises:
        ValueError: no documents, a negative length, a slot shorter than its document, ``n_ranks`` < 1,
            ``token_cap`` < 1, or ``ranks_per_node`` not dividing ``n_ranks``.
    """
    lens = np.asarray(lengths, dtype=np.int64)
    slot = lens if slots is None else np.asarray(slots, dtype=np.int64)
    per_node = n_ranks if ranks_per_node is None else ranks_per_node
    if lens.size == 0 or (lens < 0).any() or slot.shape != lens.shape or (slot < lens).any():
        raise ValueError("documents: need one length per document, ≥ 0, each within its slot")
    if n_ranks < 1 or token_cap < 1 or per_node < 1 or n_ranks % per_node:
        raise ValueError("n_ranks ≥ 1, token_cap ≥ 1 and ranks_per_node dividing n_ranks")
    work = document_work(lens, tile)
    mean_work, cap = work.sum() / n_ranks, token_cap * slot.sum() / n_ranks
    rank_work, rank_tokens = np.zeros(n_ranks), np.zeros(n_ranks)
    owner = np.full(lens.size, -1, dtype=np.int64)
    groups: dict[int, tuple[int, ...]] = {}
    size = _rounded(_group_sizes(work, slot, mean_work, cap, n_ranks), group_unit, n_ranks)
    in_group = np.zeros(n_ranks, dtype=bool)
    for d in sorted(np.flatnonzero(size > 1), key=lambda d: (-work[d], d)):
        ranks = _least_loaded_block(rank_work, int(size[d]), per_node, in_group, set(groups.values()))
        groups[int(d)] = ranks
        in_group[list(ranks)] = True
        rank_work[list(ranks)] += work[d] / len(ranks)
        rank_tokens[list(ranks)] += slot[d] / len(ranks)
    for d in sorted(np.flatnonzero(size == 1), key=lambda d: (-work[d], -slot[d], d)):
        room = rank_tokens + slot[d] <= cap * (1 + 1e-12)
        r = int(np.argmin(np.where(room, rank_work, np.inf))) if room.any() else int(np.argmin(rank_tokens))
        owner[d] = r
        rank_work[r] += work[d]
        rank_tokens[r] += slot[d]
    return DocPlacement(owner, groups, rank_work, rank_tokens, float(cap),
                        bool((rank_tokens <= cap * (1 + 1e-12)).all()))


def _group_sizes(work: np.ndarray, slot: np.ndarray, mean_work: float, cap: float, n_ranks: int) -> np.ndarray:
    """[n_docs] ranks per document: 1 for a whole one, else the smallest g with work/g ≤ the mean work and
    tokens/g ≤ the cap (at most ``n_ranks``)."""
    by_work = np.ceil(work / mean_work - 1e-9) if mean_work > 0 else np.ones_like(work)
    by_tokens = np.ceil(slot / cap - 1e-9) if cap > 0 else np.ones_like(work)
    return np.clip(np.maximum(by_work, by_tokens), 1, n_ranks).astype(np.int64)


def _rounded(size: np.ndarray, unit: int, n_ranks: int) -> np.ndarray:
    """Group sizes > 1 rounded up to the smallest divisor of ``unit`` that holds them, or beyond ``unit`` to a
    multiple of it; a size whose rounding passes ``n_ranks`` is kept."""
    if unit <= 1:
        return size
    divisors = np.array([d for d in range(1, unit + 1) if unit % d == 0])
    up = np.where(size <= unit, divisors[np.searchsorted(divisors, np.minimum(size, unit))], -(-size // unit) * unit)
    return np.where((size > 1) & (up <= n_ranks), up, size)


def _least_loaded_block(rank_work: np.ndarray, g: int, per_node: int, in_group: np.ndarray,
                        groups: set[tuple[int, ...]]) -> tuple[int, ...]:
    """Where a document split g ways goes: the g consecutive ranks with the least total work (ties: the lowest
    first rank), inside one node when g ≤ ranks per node, else starting at a node boundary (whole nodes, the last
    one in part) — among windows that share no rank with another document's group. Where none is left, the
    existing group of at least g ranks with the least work per rank (the document is split over all of it), and
    only where there is none, any window. Disjoint groups can run head-parallel (``doc-place``'s ``split``);
    overlapping ones only by direct fetch."""
    n = rank_work.size
    if g <= per_node:
        starts = [s for node in range(0, n, per_node) for s in range(node, node + per_node - g + 1)]
    else:
        starts = list(range(0, n - g + 1, per_node))
    window = np.convolve(rank_work, np.ones(g), mode="valid")
    shared = np.convolve(in_group, np.ones(g), mode="valid") > 0
    free = [s for s in starts if not shared[s] or tuple(range(s, s + g)) in groups]
    if free:
        best = min(free, key=lambda s: (window[s], s))
        return tuple(range(best, best + g))
    wider = [grp for grp in groups if len(grp) >= g]
    if wider:
        return min(wider, key=lambda grp: (rank_work[list(grp)].mean(), grp[0]))
    best = min(starts, key=lambda s: (window[s], s))
    return tuple(range(best, best + g))
