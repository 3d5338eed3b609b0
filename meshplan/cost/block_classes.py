"""Per-rank kernel time of a plan's blocks by block class, without an N x N array per kernel growth.

A block's kernel time is launch + FLOPs / (peak · efficiency)
(:meth:`~meshplan.cost.cost.CostModel.matrix_block_times`), and its efficiency depends on the block only through its
class — its participating rows, its columns, whether it needs a mask (:func:`~meshplan.cost.cost.shape_classes`: a
handful of classes under the usual masks). FLOPs are pairs x a constant per pass. So every per-rank sum of block
times, at any kernel growth and in either pass, is Σ_k rate_k · P[r, k], with P[r, k] the permitted pairs of rank r's
blocks of class k and rate_k the seconds a pair of class k takes; and a rank's cheapest block is
min_k rate_k · fewest[r, k]. P and fewest are counted once per owner array (one pass over the N² blocks) and shared
by every plan holding that array (Mesh's mappings of one tile), every growth and both passes: a sum then costs
microseconds instead of N x N float arrays (three of 134 MB at 4096 ranks).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import numpy as np

from meshplan.cost.cost import CostModel, shape_classes
from meshplan.cost.doc_kernels import priced_by_cover
from meshplan.model.matrix import AttnMatrix

#: owner arrays whose class sums are kept per matrix (the newest; each is [n_ranks, K] floats)
KEPT = 256
#: more (rank, class) cells than this: no class sums (callers sum the N x N block times)
MAX_CELLS = 1 << 24


@dataclass(frozen=True)
class ClassSums:
    """A plan's permitted blocks counted per (rank, class).

    Attributes:
        pairs: [n_ranks, K] permitted query-key pairs of rank r's blocks of class k.
        fewest: [n_ranks, K] the fewest pairs of one such block (inf where rank r has none of class k).
        blocks: [n_ranks] permitted blocks of each rank.
    """

    pairs: np.ndarray
    fewest: np.ndarray
    blocks: np.ndarray


def class_sums(m: AttnMatrix, owner: np.ndarray, n_ranks: int) -> ClassSums | None:
    """The class sums of ``owner`` ([N, N] rank of each block, −1 where none) over ``m``'s permitted blocks, kept
    on the matrix for the last :data:`KEPT` owner arrays (by identity, held weakly: plans sharing an array share its
    sums); None where there are more than :data:`MAX_CELLS` (rank, class) cells or a permitted block has no owner."""
    cache = m.__dict__.setdefault("_class_sums", {})
    got = cache.get(id(owner))
    if got is not None and got[0]() is owner:
        return got[1]
    where, code, pairs, k = _permitted(m)
    if n_ranks * k > MAX_CELLS or owner.shape != m.pairs.shape:
        return None
    who = owner.ravel()[where].astype(np.int64)
    if len(who) and who.min() < 0:
        return None
    key = who * k + code
    fewest = np.full(n_ranks * k, np.inf)
    np.minimum.at(fewest, key, pairs)
    sums = ClassSums(np.bincount(key, weights=pairs, minlength=n_ranks * k).reshape(n_ranks, k),
                     fewest.reshape(n_ranks, k), np.bincount(who, minlength=n_ranks))
    cache[id(owner)] = (weakref.ref(owner), sums)
    while len(cache) > KEPT:
        cache.pop(next(iter(cache)))
    return sums


def _permitted(m: AttnMatrix) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
    """(flat indices of the permitted blocks, their classes, their pairs as floats, the number of classes K), kept
    on the matrix."""
    got = m.__dict__.get("_permitted_classes")
    if got is None:
        vq, vk, code = shape_classes(m)
        where = np.flatnonzero(m.permitted)
        got = m.__dict__["_permitted_classes"] = (where, code.ravel()[where], m.pairs.ravel()[where].astype(np.float64),
                                                  2 * len(vq) * len(vk))
    return got


def pair_seconds(cost: CostModel, m: AttnMatrix, pass_: str, kernel_chunks: tuple[int, int],
                 envelope: bool) -> np.ndarray:
    """[K] seconds one permitted pair of each class takes in ``pass_`` (all query heads; the launch left out), its
    efficiency as :meth:`~meshplan.cost.cost.CostModel.class_efficiency` gives it."""
    return m.flops_per_pair(pass_) / (cost.topo.peak_flops(m.workload.dtype)
                                      * cost.class_efficiency(m, pass_, kernel_chunks, envelope))


def rank_kernel_s(cost: CostModel, m: AttnMatrix, owner: np.ndarray, n_ranks: int, pass_: str,
                  kernel_chunks: tuple[int, int]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """([n_ranks] Σ of each rank's block kernel terms, [n_ranks] its cheapest block's (0 where it has none),
    [n_ranks] its permitted blocks) at the kernel table's monotone envelope for ops of up to ``kernel_chunks``
    chunks, launches left out: the sums of ``matrix_block_times(m, pass_, kernel_chunks, envelope=True) − launch``
    over the blocks ``owner`` gives each rank — by :func:`class_sums`, or where there are none by those N x N
    times."""
    sums = class_sums(m, owner, n_ranks)
    if sums is None:
        blocks = cost.matrix_block_times(m, pass_, kernel_chunks, envelope=True) - cost.kernel.launch_s
        sel = m.permitted & (owner >= 0)
        cheapest = np.full(n_ranks, np.inf)
        np.minimum.at(cheapest, owner[sel], blocks[sel])
        return (np.bincount(owner[sel], weights=blocks[sel], minlength=n_ranks),
                np.where(np.isfinite(cheapest), cheapest, 0.0), np.bincount(owner[sel], minlength=n_ranks))
    rate = pair_seconds(cost, m, pass_, kernel_chunks, envelope=True)
    cheapest = (sums.fewest * rate[None, :]).min(axis=1, initial=np.inf)
    return sums.pairs @ rate, np.where(np.isfinite(cheapest), cheapest, 0.0), sums.blocks


def mean_block_s(cost: CostModel, m: AttnMatrix, pass_: str, kernel_chunks: tuple[int, int]) -> float:
    """The mean of ``matrix_block_times(m, pass_, kernel_chunks)`` over the permitted blocks (launch included; 0
    where none is), from the pairs per class — but for blocks priced one by one (a ``docs`` mask's blocks alone,
    by their document segments: :mod:`meshplan.cost.doc_kernels`), whose times are averaged."""
    if kernel_chunks == (1, 1) and priced_by_cover(m.workload, cost.kernel.spec):
        return float(cost.matrix_block_times(m, pass_)[m.permitted].mean()) if m.permitted.any() else 0.0
    got = m.__dict__.get("_class_pairs")
    if got is None:
        _, code, pairs_of, k = _permitted(m)
        got = m.__dict__["_class_pairs"] = np.bincount(code, weights=pairs_of, minlength=k), len(code)
    pairs, count = got
    if not count:
        return 0.0
    return cost.kernel.launch_s + float(pairs @ pair_seconds(cost, m, pass_, kernel_chunks, envelope=False)) / count
