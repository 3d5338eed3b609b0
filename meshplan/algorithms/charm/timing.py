"""Schedule-free closed form of the CHARM+ family (``merge``, ``rmplus``, ``charm``; :mod:`.build`): a lower bound
from the plan alone, taken above ``search_max_ranks`` ranks (:mod:`meshplan.algorithms.free_timing`).

The transfers, per pass (one chunk, every head; domains of p ranks, m domains, ``role`` from :func:`.lists.roles`):
each KV-peer pair swaps KV once (backward: the partial dK/dV returns in ``dkv_dtype``); each Q-peer pair swaps every
one of the m Q slots (the rank's own and the m − 1 foreign ones; backward the Q side) and returns the partial
output (``partial_dtype``; backward partial dQ in ``dq_dtype``) of each slot whose chunk has a permitted pair with
the computing rank's KV chunk; across domains each rank sends its Q to its counterpart in each of the m − 1 other
domains, which returns the slot's accumulated partial. The kernels: every block the plan gives the rank, at the
kernel table's envelope for the largest op the lowering forms (a level's Q-peer slots against one KV chunk, or the
pipeline's slots against a level's KV-peer chunks), a launch per op, and the folds of the partials returned to it.
The memory estimate is 0.7-1.0 of the built schedule's peak (merge's forward up to 2x: it counts every fetched KV
as held to the end). The chain is the kernels alone; across many
nodes the busiest link (a node's network aggregate: the foreign Q and its partials, or merge's all-pairs KV)
decides. The kernels, folds and combines are counted at their least (an op's combine as one accumulator's): the
bound is 5-15% under the built schedule's uncontended form at 8-32 ranks.
"""

from __future__ import annotations

import numpy as np

from meshplan.algorithms.base import PassTiming
from meshplan.algorithms.charm.lists import KV, Q, levels, roles
from meshplan.algorithms.free_timing import Transfers, op_overhead_s, owner_compute, pass_timing
from meshplan.cost.cost import CostModel
from meshplan.model.topology import Topology
from meshplan.plan.plan import Plan
from meshplan.plan.schedule import tensor_bytes


def charm_timing(plan: Plan, topo: Topology, mechanism: str) -> dict[str, PassTiming]:
    """PassTiming per pass of a merge / rmplus / charm plan without its schedule; every makespan a lower bound of
    the simulated one (``estimate_s`` None)."""
    n, w, k = plan.n_ranks, plan.workload, plan.knobs
    p = plan.extra["domain_size"]
    m = n // p
    x = np.arange(n)
    d, local = x // p, x % p
    role = roles(p, mechanism)
    permitted = plan.matrix.permitted
    kv_src, kv_dst, q_src, q_dst = [], [], [], []
    for j in range(1, p):
        peer = d * p + (local ^ j)
        sel = role[local, j] == KV
        kv_src.append(x[sel])
        kv_dst.append(peer[sel])
        sel = role[local, j] == Q
        q_src.append(x[sel])
        q_dst.append(peer[sel])
    kv_pairs = Transfers(plan, topo, _cat(kv_src), _cat(kv_dst))
    q_pairs = Transfers(plan, topo, _cat(q_src), _cat(q_dst))
    # a Q-peer returns slot s's partial when the slot's chunk (the peer's own chunk, or its counterpart's in domain
    # d_peer + s) has a permitted pair with the computing rank's KV chunk
    back_src, back_dst = [], []
    for s in range(m):
        chunk = ((q_pairs.src // p + s) % m) * p + q_pairs.src % p       # slot s's chunk, sent by the peer
        live = permitted[chunk, q_pairs.dst]
        back_src.append(q_pairs.dst[live])
        back_dst.append(q_pairs.src[live])
    returns = Transfers(plan, topo, _cat(back_src), _cat(back_dst))
    shifts = range(1, m)
    foreign = Transfers(plan, topo, _cat([x for _ in shifts]), _cat([((d - s) % m) * p + local for s in shifts]))
    home = Transfers(plan, topo, foreign.dst, foreign.src)
    mat = plan.matrix
    size = lambda kind, dtype=w.dtype: float(tensor_bytes(w, kind, mat.chunk_tokens(kind), w.n_heads, dtype))  # noqa: E731
    kv = size("kv")
    span = _largest_op(role, levels(p), 2 if m > 1 and k.get("query_order") == "fused" else 1)
    out = {}
    for pass_ in w.pass_list:
        fwd = pass_ == "fwd"
        q = size("q" if fwd else "qside")
        part = size("out", k.get("partial_dtype") or w.dtype) if fwd else size("dq", k.get("dq_dtype", "fp32"))
        moved = [(kv_pairs, kv, 1), (q_pairs, q, m), (returns, part, 1), (foreign, q, 1), (home, part, 1)]
        if not fwd:
            moved.append((Transfers(plan, topo, kv_pairs.dst, kv_pairs.src), size("dkv", k.get("dkv_dtype", "fp32")),
                          1))
        acc = size("out" if fwd else "dq", "fp32")
        compute = _compute(plan, topo, pass_, span, acc, part, returns.into(1.0) + home.into(1.0))
        if not fwd:                      # each fetched KV's partial dK/dV, added at home
            dkv_wire = size("dkv", k.get("dkv_dtype", "fp32"))
            compute = compute + kv_pairs.into(1.0) * float(CostModel(topo).merge_time_s(2 * size("dkv", "fp32")
                                                                                         + dkv_wire))
        p_kv = float(np.bincount(kv_pairs.dst, minlength=n).max(initial=0))
        # the foreign Qs are all posted at the start and wait for no kernel: each may land, with its accumulator;
        # the own Q's partials coming home from the other domains are folded only at the pass's end
        buffers = q + kv + acc + p_kv * kv + span[0] * (q + acc) + (m - 1) * (q + acc + part) \
            + (0.0 if fwd else (1 + p_kv) * size("dkv", "fp32"))
        out[pass_] = pass_timing(plan, topo, pass_, compute, compute, moved, buffers, 2 * max(span[0] * q, kv))
    return out


def _compute(plan: Plan, topo: Topology, pass_: str, span: tuple[int, int], acc: float, part: float,
             folds: np.ndarray) -> np.ndarray:
    """[n] each rank's kernels (its blocks at the envelope of an op of ``span``, a launch and at least one
    accumulator's combine per op) and its folds: every returned partial (``folds`` per rank) merged or added into
    its fp32 accumulator, 2 · ``acc`` + ``part`` bytes touched at the merge rate."""
    cost = CostModel(topo)
    kernels, ops = owner_compute(plan, topo, pass_, span)
    return kernels + ops * op_overhead_s(topo, plan, pass_, acc) + folds * float(cost.merge_time_s(2 * acc + part))


def _cat(parts: list[np.ndarray]) -> np.ndarray:
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)


def _largest_op(role: np.ndarray, lv: list[list[int]], slots: int) -> tuple[int, int]:
    """(Q chunks, KV chunks) of the largest op the lowering forms: a level's Q-peers' slots against the rank's own
    KV chunk, or the pipeline's ``slots`` own Q chunks against a level's KV-peer chunks."""
    q_most = max((int((role[:, offs] == Q).sum(axis=1).max()) for offs in lv), default=0)
    kv_most = max((int((role[:, offs] == KV).sum(axis=1).max()) for offs in lv), default=0)
    return max(q_most * slots, slots, 1), max(kv_most, 1)
