"""Schedule-free closed form of StarTrail (:mod:`meshplan.algorithms.startrail`): a lower bound from the plan alone,
taken above ``search_max_ranks`` ranks (:mod:`meshplan.algorithms.free_timing`).

Teams of C ranks, M = N/C teams, sub-rings of L = M/C ranks. The transfers, per pass (c tokens a chunk, every head):
the team all-gather (each member's Q — backward its Q side — and KV to the C − 1 others), the initial fetch (member
t > 0 gets team T + t's C KV chunks from member t of that team), L − 1 sub-ring hops of C KV chunks from the rank
of team T + C (backward also L hops of the C partial dK/dV, and each member's C dK/dV sums sent to the owners of its
initial team's chunks), and the reduce-scatter of the team's partial outputs (backward: partial dQ) to the C − 1
others. The chain on rank r: the gather (and the fetch, after the sender's own gather), then its kernels back to
back — every block it owns at the envelope of a C × C op, a launch per op, each op's combine into the C fp32
accumulators, backward the added dK/dV partials — or its KV hops in sequence, whichever ends later; then a team
member's partial reaching it after that member's last kernel.
"""

from __future__ import annotations

import numpy as np

from meshplan.algorithms.base import PassTiming
from meshplan.algorithms.free_timing import Transfers, op_overhead_s, owner_compute, pass_timing
from meshplan.cost.cost import CostModel
from meshplan.model.topology import Topology
from meshplan.plan.plan import Plan
from meshplan.plan.schedule import tensor_bytes


def startrail_timing(plan: Plan, topo: Topology) -> dict[str, PassTiming]:
    """PassTiming per pass of a StarTrail plan without its schedule; every makespan a lower bound of the simulated
    one (``estimate_s`` None)."""
    C, M, n, w, k = plan.extra["C"], plan.extra["M"], plan.n_ranks, plan.workload, plan.knobs
    L = M // C
    r = np.arange(n)
    T, t = r // C, r % C
    members = [(r, T * C + (t + d) % C) for d in range(1, C)]
    team = Transfers(plan, topo, np.concatenate([s for s, _ in members]) if members else r[:0],
                     np.concatenate([x for _, x in members]) if members else r[:0])
    need = t > 0
    fetch = Transfers(plan, topo, (((T + t) % M) * C + t)[need], r[need])
    ring = Transfers(plan, topo, ((T + C) % M) * C + t, r)
    m = plan.matrix
    size = lambda kind, dtype=w.dtype: float(tensor_bytes(w, kind, m.chunk_tokens(kind), w.n_heads, dtype))  # noqa: E731
    kv = size("kv")
    out = {}
    for pass_ in w.pass_list:
        fwd = pass_ == "fwd"
        q = size("q" if fwd else "qside")
        part = size("out", k["partial_dtype"] or w.dtype) if fwd else size("dq", k["dq_dtype"])
        compute = _compute(plan, topo, pass_, C, L)
        moved = [(team, q + kv, 1), (fetch, C * kv, 1), (ring, C * kv, L - 1), (team, part, 1)]
        if not fwd:
            dkv = size("dkv", k["dkv_dtype"])
            home = [(r, ((T + t) % M) * C + c) for c in range(C)]
            src = np.concatenate([s for s, d in home])
            dst = np.concatenate([d for s, d in home])
            away = src != dst
            moved += [(ring, C * dkv, L if L > 1 else 0), (Transfers(plan, topo, src[away], dst[away]), dkv, 1)]
        gathered = team.slowest_in(max(q, kv))
        first = np.maximum(gathered, gathered.min() + fetch.slowest_in(kv))   # a fetch leaves after its sender's gather
        own = np.maximum(first + compute, ring.slowest_in(kv) * (L - 1))       # when the rank's last kernel can end
        team_min = np.full(M, np.inf)
        np.minimum.at(team_min, T, own)
        chain = np.maximum(own, team_min[T] + team.slowest_in(part))           # a member's partial lands after it
        buffers = (1 + C) * (q + kv) + 3 * C * kv + C * size("out" if fwd else "dq", "fp32") \
            + (0.0 if fwd else C * size("dkv", "fp32"))
        out[pass_] = pass_timing(plan, topo, pass_, compute, chain, moved, buffers,
                                 max(2 * (C - 1) * (q + kv), 2 * C * kv), op_chunks=C)
    return out


def _compute(plan: Plan, topo: Topology, pass_: str, C: int, L: int) -> np.ndarray:
    """[n] each rank's kernels: its blocks at the envelope of a C × C op, a launch per op, each op's combine into
    the C fp32 accumulators (the team's query chunks), backward the (L − 1)·C dK/dV partials the sub-ring brings."""
    w, m = plan.workload, plan.matrix
    cost = CostModel(topo)
    kernels, ops = owner_compute(plan, topo, pass_, (C, C))
    acc = C * tensor_bytes(w, "out" if pass_ == "fwd" else "dq", m.chunk_tokens("q"), w.n_heads, "fp32")
    total = kernels + ops * op_overhead_s(topo, plan, pass_, acc)
    if pass_ == "bwd" and L > 1:
        part = tensor_bytes(w, "dkv", m.chunk_tokens("kv"), w.n_heads, "fp32")
        wire = tensor_bytes(w, "dkv", m.chunk_tokens("kv"), w.n_heads, plan.knobs["dkv_dtype"])
        total = total + (L - 1) * C * float(cost.merge_time_s(2 * part + wire))
    return total
