"""Plan: who computes which block, where each chunk lives, and which device runs each rank.

Integer arrays only; an algorithm's ``plan()`` makes one and its ``schedule()`` lowers it to ops.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from meshplan.core.errors import UserError
from meshplan.model.matrix import AttnMatrix


def shared_owner(matrix: AttnMatrix, key: tuple, make) -> np.ndarray:
    """The read-only int32 [N, N] owner array under ``key`` for ``matrix``: ``make()`` (any integer dtype) with −1 on
    the blocks the mask does not permit, made once and kept on the matrix — plans with the same owners (Ring's
    settings, Mesh's mappings of one tile, USP's of one grid) share one array (N² x 4 bytes: 67 MB at 4096 ranks) and
    what is counted from it (:func:`~meshplan.cost.block_classes.class_sums`)."""
    owners = matrix.__dict__.setdefault("_shared_owners", {})
    if key not in owners:
        owner = np.asarray(make()).astype(np.int32)
        owner[~matrix.permitted] = -1
        owner.flags.writeable = False
        owners[key] = owner
    return owners[key]


@dataclass(frozen=True)
class Plan:
    """A split of the attention matrix over ``n_ranks`` ranks.

    Attributes:
        owner: [Nq, Nkv] rank computing each block (−1 where the mask permits no pair).
        q_home, kv_home: [N] rank holding each query / KV chunk at the start.
        device_of_rank: [n_ranks] device id (in the topology) of each rank.
        knobs: the algorithm's knobs, normalised (every knob present with its value).
    """

    algorithm: str
    knobs: dict[str, Any]
    matrix: AttnMatrix
    n_ranks: int
    owner: np.ndarray
    q_home: np.ndarray
    kv_home: np.ndarray
    device_of_rank: np.ndarray
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        # rank ids fit in int32: half the memory of an [N, N] owner array (8 MB at 1024 ranks, a search holds ~100)
        if self.owner.dtype == np.int64 and self.n_ranks < 2**31:
            object.__setattr__(self, "owner", self.owner.astype(np.int32))

    @property
    def workload(self):
        """The workload the matrix describes."""
        return self.matrix.workload

    def check(self) -> None:
        """Every permitted block has exactly one owner in range; homes and devices valid.

        Raises:
            UserError: the plan is inconsistent (a bug in an algorithm, reported as such).
        """
        n, m = self.n_ranks, self.matrix
        if self.owner.shape != m.pairs.shape:
            raise UserError("plan.owner", f"shape {self.owner.shape}, expected {m.pairs.shape}")
        bad = m.permitted & ((self.owner < 0) | (self.owner >= n))
        if bad.any():
            i, j = np.argwhere(bad)[0]
            raise UserError("plan.owner", f"block ({i}, {j}) is permitted but has no owner in 0..{n - 1}")
        for name, arr in (("q_home", self.q_home), ("kv_home", self.kv_home)):
            if arr.min() < 0 or arr.max() >= n:
                raise UserError(f"plan.{name}", f"homes must be ranks 0..{n - 1}")
        if len(np.unique(self.device_of_rank)) != n:
            raise UserError("plan.device_of_rank", "two ranks share a device")
