"""Inference with a KV cache: Meta's pass-KV / pass-Q rule beside the simulator's choice.

Meta, "Context Parallelism for Scalable Million-Token Inference" (arXiv 2411.01783), §3: with P cached
tokens and T new ones on N ranks, choose **pass-KV** (``ring``) when its KV transfer hides behind the
attention compute of a ring step, else compare the bytes each step moves — Q (T·H query rows) against KV
(2·(T + P)·Hkv rows), i.e. pass-KV when T / (T + P) ≥ 2·Hkv / H — and choose **pass-Q** otherwise
(docs/algorithms.md). Here both sides of the first test are evaluated with meshplan's own numbers (the topology's
kernel efficiency table and the slowest ring hop's alpha and bandwidth), so the rule and the simulator
disagree only where the rule's simplifications do (pass-Q's final all-to-all of partial outputs, the causal
imbalance of a step, contention).

Shapes: per ring step, one block of T/N queries × (T + P)/N keys per rank (averages over the ranks; a
decode step's single token is a fraction of a token per rank on average).
"""

from __future__ import annotations

import dataclasses
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from meshplan.core.units import DTYPE_BYTES
from meshplan.cost.cost import CostModel
from meshplan.model.matrix import attn_matrix
from meshplan.model.topology import Topology
from meshplan.model.workload import Workload

RING, PASS_Q = "ring", "pass-q"


@dataclass(frozen=True)
class RuleAnswer:
    """Meta's rule on one workload: its choice and the numbers behind it (seconds and bytes per ring step)."""

    choice: str
    compute_step_s: float
    kv_step_s: float
    q_bytes: float
    kv_bytes: float
    miss_rate: float           # T / (T + P)
    threshold: float           # 2·Hkv / H
    reason: str

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready."""
        return asdict(self)


def meta_rule(w: Workload, topo: Topology, n: int) -> RuleAnswer:
    """Meta's pass-KV vs pass-Q rule for ``w`` on ``n`` ranks of ``topo`` (see the module docstring)."""
    beta = DTYPE_BYTES[w.dtype]
    T, S = w.n_queries, w.seq_len
    q_bytes = w.batch * T / n * w.n_heads * w.head_dim * beta
    kv_bytes = 2.0 * w.batch * S / n * w.n_kv_heads * w.head_dim * beta
    m = attn_matrix(w, n)
    flops_step = float(m.flops("fwd").sum()) / (n * n)
    cost = CostModel(topo)
    s_q, s_kv = max(T / n, 1.0), S / n
    compute = float(cost.block_time_s(flops_step, np.array(s_q), np.array(s_kv), True, "fwd", w.dtype,
                                      w.head_dim))
    src = np.arange(n)                       # the ring on devices 0..N-1 in order (Ring's identity placement)
    lat, bw = topo.pair_stats(src, (src + 1) % n)
    kv_step = float(np.max(lat + kv_bytes / bw)) if n > 1 else 0.0
    miss, threshold = T / S, 2.0 * w.n_kv_heads / w.n_heads
    if kv_step <= compute:
        choice, reason = RING, (f"KV transfer ({kv_step * 1e6:.3g} us a step) hides behind compute "
                                f"({compute * 1e6:.3g} us)")
    elif miss >= threshold:
        choice, reason = RING, f"KV exposed, but KV bytes <= Q bytes (T/(T+P) = {miss:.3g} >= 2Hkv/H = {threshold:.3g})"
    else:
        choice, reason = PASS_Q, (f"KV exposed ({kv_step * 1e6:.3g} us vs {compute * 1e6:.3g} us compute) and "
                                  f"Q is smaller (T/(T+P) = {miss:.3g} < 2Hkv/H = {threshold:.3g})")
    return RuleAnswer(choice, compute, kv_step, q_bytes, kv_bytes, miss, threshold, reason)


def rule_report(result) -> dict[str, Any] | None:
    """``search``'s ``inference`` object for a workload with a cached prefix: Meta's rule, the best simulated
    ``ring`` and ``pass-q`` plans, and whether they agree. None without a prefix (or with neither method).

    With ``search --tp/--dp`` the methods' best job times (``job.together_s``) are compared. Where search left
    both methods' candidates at their closed-form bound, a copy of the best-bound one is
    simulated here (the ranking is not touched), so both times are simulated.
    """
    from meshplan.search.candidate import simulate_candidate

    w, topo, n = result.workload, result.topology, result.n_ranks
    if not w.prefix_len:
        return None
    best: dict[str, Any] = {}
    for name in (RING, PASS_Q):
        mine = [c for c in result.candidates if c.algorithm == name]
        if not mine:
            continue
        jobbed = [c for c in mine if c.job]                 # search --tp/--dp: the whole job's time decides
        if jobbed:
            c = min(jobbed, key=lambda c: c.job["together_s"])
            best[name] = {"time_s": c.job["together_s"], "layout": c.workload.layout, "knobs": c.knobs,
                          "as": "job"}
            continue
        done = [c for c in mine if c.model_level == "simulated"]
        if not done:
            c = min(mine, key=lambda c: c.bound_s)
            done = [simulate_candidate(dataclasses.replace(c), topo, result.ring_ccr)]
        c = min(done, key=lambda c: c.predicted.makespan_s)
        best[name] = {"time_s": c.predicted.makespan_s, "layout": c.workload.layout, "knobs": c.knobs,
                      "as": "group"}
    if not best:
        return None
    rule = meta_rule(w, topo, n)
    simulated = min(best, key=lambda k: best[k]["time_s"])
    body: dict[str, Any] = {"prefix_len": w.prefix_len, "new_tokens": w.n_queries, "rule": rule.to_dict(),
                            "simulated": best, "simulated_choice": simulated,
                            "agree": simulated == rule.choice if len(best) == 2 else None}
    if len(best) == 2:
        other = PASS_Q if simulated == RING else RING
        body["rule_regret_pct"] = 100.0 * (best[rule.choice]["time_s"] / best[simulated]["time_s"] - 1.0)
        body["margin_pct"] = 100.0 * (best[other]["time_s"] / best[simulated]["time_s"] - 1.0)
    return body
