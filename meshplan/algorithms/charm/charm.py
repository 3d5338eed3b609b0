"""CHARM+ (arXiv 2611.05906): ``merge`` (its merge communication alone), ``rmplus`` (Re-Merge Multistream
alone) and ``charm`` (RM+ inside domains with cross-hardware query parallelism), forward and backward.

Partner lists: :mod:`meshplan.algorithms.charm.lists`; lowering: :mod:`meshplan.algorithms.charm.build`.
``merge`` and ``rmplus`` treat all N ranks as one domain (N a power of two); ``charm`` takes its domains
from the topology (nodes, else NUMA sockets) or ``--domains M``, each a power of two; KV never leaves its
domain. Whether same-level transfers run concurrently (NVSwitch) or contend (PCIe) is the simulator's call.

Cross-domain order (``query_order``). ``fused``, as the paper describes it: the counterpart's Q joins the
own Q in one pipeline (2c × c kernels), so the Q transfer is exposed until it lands and the returned partial
after the last block. ``foreign-first`` (the default): the own Q's first levels run while the foreign Q is in
flight, then the foreign Q's whole pipeline, then the own Q's last level (half its blocks) as filler behind
the returning partial. The CHARM+ 2×8 H100 table fits it better (the published forward at B = 1, S = 215040,
66.74 ms, is the predicted compute alone, 66.6 ms: nothing exposed); the fit's declared grid picks it
(:mod:`meshplan.truth.reproduce_fit`).

Bytes received per rank (forward; KVc, Qc, Oc + Lc per docs/algorithms.md, Oc in ``partial_dtype``), p ranks
per domain, m domains, P_Q = number of Q-peers = p/2 − 1 for RM+ (0 for merge), P_KV = p − 1 − P_Q:
    P_KV·KVc  +  m·P_Q·(Qc + Oc + Lc)  +  (m − 1)·(Qc + Oc + Lc)
(m Q slots pass through the Q-peers: the own one and m − 1 foreign ones; m = 1 for merge and rmplus).
Backward: KV and Q-side (Q, dO, LSE, D) in place of Q, partial dQ (``dq_dtype``) in place of O, plus
P_KV·dKVc for the fetched KV's partial dK/dV (``dkv_dtype``).
"""

from __future__ import annotations

import numpy as np

from meshplan.algorithms.base import (
    DTYPE_KNOB,
    BuiltTiming,
    Knob,
    PassTiming,
    new_builder,
    positive_int_or_auto,
    topology_record,
)
from meshplan.algorithms.charm.build import Lowering
from meshplan.algorithms.charm.lists import domain_size, power_of_two
from meshplan.algorithms.charm.timing import charm_timing
from meshplan.core.errors import SkipCandidate, UserError
from meshplan.model.matrix import attn_matrix
from meshplan.model.topology import Topology
from meshplan.plan.plan import Plan, shared_owner
from meshplan.plan.schedule import Schedule

COMMON = {
    "partial_dtype": DTYPE_KNOB("partial_dtype", None, "dtype of partial outputs on the wire (default: input)"),
    "dq_dtype": DTYPE_KNOB("dq_dtype", "fp32", "dtype of partial dQ on the wire"),
    "dkv_dtype": DTYPE_KNOB("dkv_dtype", "fp32", "dtype of partial dK/dV on the wire"),
    "level_order": Knob("level_order", "ascending", ("ascending", "descending"),
                        "levels in Algorithm 1's order, or the Figure's (last level first)"),
}
QUERY_ORDERS = ("foreign-first", "fused")


class Merge(BuiltTiming):
    """CHARM+'s merge communication: log2 N levels of KV swaps, dependencies only between levels."""

    name = "merge"
    mechanism = "merge"
    summary = "CHARM+ merge communication: KV swapped with log2(N) levels of XOR partners"
    knobs = dict(COMMON)

    schedule_free = True

    def schedule_free_timing(self, plan: Plan, topo: Topology) -> dict[str, PassTiming]:
        """The plan's lower bound without its schedule (:mod:`meshplan.algorithms.charm.timing`)."""
        return charm_timing(plan, topo, self.mechanism)

    def domain(self, workload, topo: Topology, n: int, knobs: dict, device_of_rank) -> int:
        """Ranks per domain: all N."""
        if not power_of_two(n):
            raise SkipCandidate("needs a power-of-two rank count", f"{self.name} needs N a power of two, not {n}")
        return n

    def check(self, workload, topo, n_ranks, knobs) -> None:
        """N (or the domains) must suit the partner lists."""
        super().check(workload, topo, n_ranks, knobs)
        self.domain(workload, topo, n_ranks, knobs, self.device_map(topo, n_ranks, knobs))

    def plan(self, workload, topo, n_ranks, knobs, matrix=None) -> Plan:
        """Blocks: (x, x^j) by x for KV offsets, by x^j for Q offsets; foreign slots as the domains say."""
        dev = self.device_map(topo, n_ranks, knobs)
        p = self.domain(workload, topo, n_ranks, knobs, dev)
        m = matrix if matrix is not None else attn_matrix(workload, n_ranks)
        owner = shared_owner(m, ("charm", p, self.mechanism), lambda: _owners(n_ranks, p, self.mechanism))
        idx = np.arange(n_ranks)
        extra = {"domain_size": p}
        k = dict(knobs)
        if "domains" in k:
            k["domains"] = n_ranks // p
        return Plan(self.name, k, m, n_ranks, owner, idx, idx, dev, extra=extra)

    def build(self, plan: Plan, topo: Topology) -> Schedule:
        """Each pass lowered by :class:`~meshplan.algorithms.charm.build.Lowering`."""
        b = new_builder(self, plan, topo)
        for phase, name in enumerate(("fwd", "bwd")):
            if name in plan.workload.pass_list:
                b.phase = phase
                Lowering(b, plan, plan.extra["domain_size"], self.mechanism, name).run()
        return b.build(topology_record(topo))



class RMPlus(Merge):
    """RM+ alone: KV-peers and Q-peers per Algorithm 1, Q and KV on separate streams."""

    name = "rmplus"
    mechanism = "rmplus"
    summary = "CHARM+ RM+: per level half the partners swap KV, half swap Q and return partial outputs"
    knobs = dict(COMMON)


class Charm(Merge):
    """Full CHARM+: RM+ inside each domain, queries swapped across domains, KV never crosses."""

    name = "charm"
    mechanism = "rmplus"
    summary = "CHARM+: RM+ inside NUMA/node domains, cross-domain query parallelism (KV stays in its domain)"
    knobs = dict(COMMON) | {
        "domains": Knob("domains", "auto", None, "number of domains (auto: nodes, else NUMA sockets)",
                        parse=positive_int_or_auto),
        "query_order": Knob("query_order", "foreign-first", QUERY_ORDERS,
                            "foreign Q as it lands, the own Q's last level held back as filler; or fused with the "
                            "own Q (2c x c kernels, the paper's description)")}

    def knob_space(self, workload, topo, n_ranks, filters) -> list[dict]:
        """Both query orders (or the one given); the default only above ``search_variants_max_ranks``."""
        if "query_order" in filters:
            orders = [filters["query_order"]]
        else:
            orders = list(QUERY_ORDERS) if n_ranks <= self.search_variants_max_ranks else [QUERY_ORDERS[0]]
        return [filters | {"query_order": o} for o in orders]

    def domain(self, workload, topo, n, knobs, device_of_rank) -> int:
        """Ranks per domain, from ``--domains`` or the topology."""
        declared = None if knobs["domains"] == "auto" else int(knobs["domains"])
        if declared is not None and declared < 2:
            raise UserError("--domains", f"charm needs two or more domains, not {declared}", "use rmplus for one")
        return domain_size(topo, n, device_of_rank, declared, self.name)


def _owners(n: int, p: int, mechanism: str) -> np.ndarray:
    """[N, N] who computes each block: inside a domain by the partner roles; across domains (q in domain
    d', KV in domain d) the counterpart of q's rank in domain d (or its Q-peer)."""
    from meshplan.algorithms.charm.lists import KV, roles

    role = roles(p, mechanism)
    x = np.arange(n)
    q, k = np.meshgrid(x, x, indexing="ij")
    local_q, local_k = q % p, k % p
    j = local_q ^ local_k
    holder = (k // p) * p + local_q                      # who holds q's chunk in KV's domain
    kv_role = role[local_q, j] == KV
    return np.where((j == 0) | kv_role, holder, k)
