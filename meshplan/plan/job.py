"""Context parallelism inside a job: tensor (TP) and data (DP) parallel groups around the CP groups.

A job of ``tp × cp × dp`` ranks numbers its ranks by a rank order, innermost dimension first (Megatron-LM's
``RankGenerator``: order ``tp-cp-ep-dp-pp``, TP innermost, so a CP group's ranks are TP apart); the global rank
is the device it runs on (devices numbered node by node). TP splits the heads before CP sees them (Megatron:
``num_attention_heads`` and ``num_query_groups`` divided by the TP size), so each CP group runs the attention of
``H / tp`` query and ``Hkv / tp`` KV heads over ``cp`` ranks; all ``tp · dp`` CP groups run at once and share
the NICs and links of the job's GPUs.

:func:`job_schedule` lays copies of one CP group's schedule onto every group's devices (rank ``g·cp + r`` of the
job is rank r of group g; the group's schedule was planned on ``cp`` devices, whose k-th device becomes the
group's k-th GPU), so the simulator times them together.

Shapes: ``cp_groups()`` is [tp·dp, cp] global ranks, row g one CP group in CP-rank order.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np

from meshplan.core.errors import UserError
from meshplan.model.workload import Workload
from meshplan.plan.schedule import OpTable, Schedule, TensorTable

DIMS = ("tp", "cp", "dp")
#: every order of the three dimensions, innermost first ("tp-cp-dp": Megatron-LM's default, TP innermost)
ORDERS = tuple("-".join(p) for p in itertools.permutations(DIMS))
DEFAULT_ORDER = "tp-cp-dp"


@dataclass(frozen=True)
class JobShape:
    """``tp × cp × dp`` ranks numbered by ``order`` (innermost dimension first)."""

    tp: int = 1
    cp: int = 1
    dp: int = 1
    order: str = DEFAULT_ORDER

    def __post_init__(self) -> None:
        for name in DIMS:
            if getattr(self, name) < 1:
                raise UserError(f"--{name}", f"{getattr(self, name)} is not a group size", "give 1 or more")
        if self.order not in ORDERS:
            raise UserError("--rank-order", f"unknown rank order {self.order!r}",
                            f"use one of {', '.join(ORDERS)} (innermost first)")

    @property
    def world(self) -> int:
        """Ranks (GPUs) in the job."""
        return self.tp * self.cp * self.dp

    def cp_groups(self) -> np.ndarray:
        """[tp·dp, cp] global ranks of each CP group (rows ordered by (dp, tp) index, columns by CP rank)."""
        sizes = {d: getattr(self, d) for d in DIMS}
        dims = self.order.split("-")
        stride, s = {}, 1
        for d in dims:                       # innermost first: the first dimension varies fastest
            stride[d] = s
            s *= sizes[d]
        t, c, d = np.meshgrid(np.arange(self.tp), np.arange(self.cp), np.arange(self.dp), indexing="ij")
        rank = t * stride["tp"] + c * stride["cp"] + d * stride["dp"]           # [tp, cp, dp]
        return rank.transpose(2, 0, 1).reshape(self.dp * self.tp, self.cp)

    def cp_workload(self, workload: Workload) -> Workload:
        """The attention one CP group runs: heads and KV heads divided by the TP size.

        Raises:
            UserError: TP does not divide the query or the KV heads.
        """
        if self.tp == 1:
            return workload
        for n, flag in ((workload.n_heads, "heads"), (workload.n_kv_heads, "KV heads")):
            if n % self.tp:
                raise UserError("--tp", f"TP {self.tp} does not divide the {n} {flag}",
                                f"give a TP size that divides both the {workload.n_heads} heads and the "
                                f"{workload.n_kv_heads} KV heads")
        return workload.with_(n_heads=workload.n_heads // self.tp, n_kv_heads=workload.n_kv_heads // self.tp)

    def to_dict(self) -> dict:
        """JSON-ready."""
        return {"tp": self.tp, "cp": self.cp, "dp": self.dp, "order": self.order, "world": self.world}


def job_schedule(sched: Schedule, groups: np.ndarray) -> Schedule:
    """Copies of the CP group schedule ``sched`` (its ranks on devices 0 … cp − 1) on every row of ``groups``
    ([n_groups, cp] device ids): job rank g·cp + r runs rank r's program on device groups[g, device_of_rank[r]].

    Raises:
        ValueError: ``groups`` has another width than the schedule's rank count, or a device twice.
    """
    groups = np.asarray(groups, dtype=np.int64)
    n, k = sched.n_ranks, len(groups)
    if groups.ndim != 2 or groups.shape[1] != n:
        raise ValueError(f"groups must be [n_groups, {n}] device ids")
    if len(np.unique(groups)) != groups.size:
        raise ValueError("a device appears in two groups")
    o, t = sched.ops, sched.tensors
    # fields holding ids, and the id space each indexes (ranks, ops, tensors): shifted per copy; the rest tiled
    ops = _tile(o, k, {"rank": n, "peer": n, "deps": len(o), "tensor": len(t), "inputs": len(t), "outputs": len(t)})
    tens = _tile(t, k, {"rank": n, "alloc_op": len(o), "free_after": len(o)})
    device = groups[np.repeat(np.arange(k), n), np.tile(sched.device_of_rank, k)]
    return Schedule(sched.algorithm, dict(sched.knobs), sched.workload, n * k, sched.n_chunks, device,
                    sched.topology, sched.streams, OpTable(**ops), TensorTable(**tens), [])


def _tile(table, k: int, shift: dict[str, int]) -> dict:
    """Fields of ``k`` copies of a struct-of-arrays table: copy c adds c × ``shift[name]`` to the ids of a shifted
    field (−1, "none", stays −1); CSR pointers continue across copies; other fields repeat."""
    out = {}
    for name in type(table).__dataclass_fields__:
        v = getattr(table, name)
        copy = np.arange(k)[:, None]
        if name.endswith("_ptr"):
            out[name] = np.r_[0, (v[1:][None, :] + v[-1] * copy).ravel()].astype(v.dtype)
        elif name in shift:
            tiled = np.tile(v, k)
            out[name] = np.where(tiled >= 0, (v[None, :] + shift[name] * copy).ravel(), -1).astype(v.dtype)
        else:
            out[name] = np.tile(v, k)
    return out
