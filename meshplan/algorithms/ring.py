"""Ring-Attention (pass-KV): each rank keeps its query chunk; KV chunks rotate around the ring.

Liu et al., "Ring Attention with Blockwise Transformers" (arXiv 2310.01889); the schedule follows
zhuzilin/ring-flash-attention: at step s rank r computes block (r, r − s mod N) while it forwards that KV
chunk to rank r + 1. The layout (contiguous, zigzag, striped) is a workload flag.

Bytes received per rank (docs/algorithms.md):
    forward   (N − 1) · KVc
    backward  (N − 1) · KVc + N · dKVc   (``dkv_hops = n``, ring-flash-attention)
              (N − 1) · KVc + (N − 1) · dKVc   (``dkv_hops = n-1``: the owner keeps its own partial)
with KVc = 2·B·c·Hkv·D·β and dKVc = KVc · (bytes of ``dkv_dtype``) / β (fp32 by default).
"""

from __future__ import annotations

import numpy as np

from meshplan.algorithms.base import DTYPE_KNOB, Algorithm, Knob, PassTiming, new_builder, topology_record
from meshplan.algorithms.rotate import rotate_backward, rotate_forward_merge
from meshplan.algorithms.rotate_timing import Rotation, backward, forward, size_of
from meshplan.core.errors import UserError
from meshplan.model.matrix import AttnMatrix, attn_matrix
from meshplan.model.topology import Topology
from meshplan.model.workload import Workload
from meshplan.plan.plan import Plan, shared_owner
from meshplan.plan.schedule import Schedule

MAPPINGS = ("auto", "identity")


def ring_plan(alg: Algorithm, workload: Workload, topo: Topology, n: int, knobs: dict,
              matrix: AttnMatrix | None, rows: bool) -> Plan:
    """Row split (``rows``: rank r computes query chunk r's row) or column split (pass-Q)."""
    m = matrix if matrix is not None else attn_matrix(workload, n)
    idx = np.arange(n)
    owner = shared_owner(m, ("ring", rows), lambda: np.broadcast_to(idx[:, None] if rows else idx[None, :], (n, n)))
    return Plan(alg.name, knobs, m, n, owner, idx, idx, alg.device_map(topo, n, knobs))


class Ring(Algorithm):
    """Ring-Attention, pass-KV."""

    name = "ring"
    summary = "KV rotates around the ring; N−1 dependent transfers (Ring-Attention, ring-flash-attention)"
    knobs = {
        "mapping": Knob("mapping", "auto", MAPPINGS, "rank -> GPU placement (auto = identity for a ring)"),
        "dkv_dtype": DTYPE_KNOB("dkv_dtype", "fp32", "dtype of partial dK/dV on the wire"),
        "dkv_hops": Knob("dkv_hops", "n", ("n", "n-1"), "dK/dV accumulator hops: n (ring-flash-attention) or n-1"),
    }

    def plan(self, workload, topo, n_ranks, knobs, matrix=None) -> Plan:
        """Rank r computes row r (every permitted block (r, j))."""
        return ring_plan(self, workload, topo, n_ranks, knobs, matrix, rows=True)

    def schedule(self, plan: Plan, topo: Topology) -> Schedule:
        """Forward and/or backward rotation of KV (see the module docstring)."""
        b = new_builder(self, plan, topo)
        n, w = plan.n_ranks, plan.workload
        r = np.arange(n)
        b.stream("compute", "compute")
        b.stream("kv", "comm")
        if "fwd" in w.pass_list:
            b.phase = 0
            q = b.tensor(r, "q", r, role="input")
            kv = b.tensor(r, "kv", r, role="input")
            out = b.tensor(r, "out", r, role="output", dtype="fp32")
            io = lambda ok, s, j, cur: ([q[ok], cur[0][ok]], [out[ok]], "merge", None)  # noqa: E731
            rotate_forward_merge(b, plan, kv, "kv", lambda rr, j: (rr, j), io)
        if "bwd" in w.pass_list:
            b.stream("dkv", "comm")
            b.phase = 1
            q = b.tensor(r, "q", r, role="input")
            kv = b.tensor(r, "kv", r, role="input")
            out = b.tensor(r, "out", r, role="input")
            dout = b.tensor(r, "dout", r, role="input")
            dq = b.tensor(r, "dq", r, role="output", dtype="fp32")
            rotate_backward(b, plan, travel=kv, travel_kind="kv", grad_kind="dkv",
                            grad_dtype=plan.knobs["dkv_dtype"], hops=plan.knobs["dkv_hops"],
                            block=lambda rr, j: (rr, j), static_inputs=[q, out, dout], local_grad=dq,
                            travel_first=False)
        return b.build(topology_record(topo))

    def timing(self, plan: Plan, topo: Topology) -> dict[str, PassTiming]:
        """Closed form per pass: the uncontended recurrence (a lower bound) and bytes per rank."""
        w, n, out = plan.workload, plan.n_ranks, {}
        rot = Rotation(plan, topo, rows=True)
        kv, q = size_of(plan, "kv", w.dtype), size_of(plan, "q", w.dtype)
        if "fwd" in w.pass_list:
            acc = size_of(plan, "out", "fp32")
            cend, d, ends = forward(rot, "kv", 3 * acc)
            end = np.maximum(cend, ends.max(axis=1)) if n > 1 else cend
            recv = np.full(n, (n - 1) * kv)
            peak = q + kv + acc + min(n - 1, 2) * kv
            out["fwd"] = rot.timing("fwd", end, d.sum(axis=1), (n - 1) * rot.hop(kv), recv,
                                    np.where(rot.hop_cross, recv, 0.0), rot.hop_loads(kv, n - 1), peak,
                                    (n - 1) * kv)
        if "bwd" in w.pass_list:
            static = q + kv + size_of(plan, "out", w.dtype) + size_of(plan, "dout", w.dtype)
            out["bwd"] = backward(rot, "kv", "dkv", plan.knobs["dkv_dtype"], plan.knobs["dkv_hops"],
                                  size_of(plan, "dq", "fp32"), static)
        return out


def ring_ccr(workload: Workload, topo: Topology, n_ranks: int) -> float | None:
    """CHARM+'s CCR of Ring on this workload: Σ over steps of the slowest rank's block time divided by
    Σ over steps of the slowest hop's transfer time (KV forward; KV and dK/dV in fp32 backward), every rank's
    hop of a step running at once (their max-min shares where they meet: :meth:`Rotation.hop_concurrent`).

    Uses the workload's layout, or contiguous when the layout cannot split the sequence (zigzag, then contiguous,
    for a doc-place workload: Ring has no placement). None for N = 1, or when neither layout can split it.
    """
    if n_ranks == 1:
        return None
    base = workload if not workload.doc_ranks else workload.with_(layout="zigzag", doc_ranks=())   # doc-place
    for w in (base, base.with_(layout="contiguous")):
        try:
            matrix = attn_matrix(w, n_ranks)
            break
        except UserError:
            continue
    else:
        return None                   # documents no layout can cut into N equal parts: no Ring to compare with
    ring = Ring()
    plan = ring.plan(w, topo, n_ranks, ring.normalize({}), matrix)
    rot = Rotation(plan, topo, rows=True)
    comp = comm = 0.0
    kv = size_of(plan, "kv", w.dtype)
    dkv = size_of(plan, "dkv", "fp32")
    for pass_ in w.pass_list:
        comp += rot.blocks(pass_, 0.0).max(axis=0).sum()
        if pass_ == "fwd":
            comm += (n_ranks - 1) * rot.hop_concurrent(kv).max()
        else:  # N−1 steps move KV and dK/dV over the same hop, the last one dK/dV alone
            comm += (n_ranks - 1) * rot.hop_concurrent(kv + dkv).max() + rot.hop_concurrent(dkv).max()
    return float(comp / comm) if comm else None
