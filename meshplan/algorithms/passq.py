"""Pass-Q ring: each rank keeps its KV chunk; query chunks rotate; partial outputs go home at the end.

Meta, "Context Parallelism for Scalable Million-Token Inference" (arXiv 2411.01783), pass-Q: at step s rank
r computes block (r − s mod N, r) for the visiting query chunk; the partial (O, LSE) of every foreign chunk
returns to its owner in one all-to-all after the ring (lowered to point-to-point), where it is merged.
Backward mirrors Ring with roles swapped: the Q side (Q, dO, LSE, D) rotates, partial dQ rides along
(N hops, ``dq_dtype`` on the wire, fp32 default), and dK/dV accumulate locally.

Bytes received per rank:
    forward   (N − 1) · Qc + (N − 1) · (Oc + Lc)      (Oc in ``partial_dtype``)
    backward  (N − 1) · (2·Qc + 8·B·c·H) + N · dQc    (Q and dO in the input dtype, LSE and D fp32)
"""

from __future__ import annotations

import numpy as np

from meshplan.algorithms.base import DTYPE_KNOB, Algorithm, Knob, PassTiming, new_builder, topology_record
from meshplan.algorithms.ring import MAPPINGS, ring_plan
from meshplan.algorithms.rotate import rotate_backward, rotate_forward_merge
from meshplan.algorithms.rotate_timing import Rotation, backward, forward, size_of
from meshplan.model.topology import Topology
from meshplan.plan.build import ScheduleBuilder
from meshplan.plan.plan import Plan
from meshplan.plan.schedule import Schedule


class PassQ(Algorithm):
    """Pass-Q ring."""

    name = "pass-q"
    summary = "Q rotates, partial outputs return in a final all-to-all (Meta's pass-Q)"
    knobs = {
        "mapping": Knob("mapping", "auto", MAPPINGS, "rank -> GPU placement (auto = identity)"),
        "partial_dtype": DTYPE_KNOB("partial_dtype", None, "dtype of partial outputs on the wire"),
        "dq_dtype": DTYPE_KNOB("dq_dtype", "fp32", "dtype of partial dQ on the wire"),
        "dq_hops": Knob("dq_hops", "n", ("n", "n-1"), "dQ accumulator hops: n or n-1"),
    }

    def plan(self, workload, topo, n_ranks, knobs, matrix=None) -> Plan:
        """Rank r computes column r (every permitted block (i, r))."""
        return ring_plan(self, workload, topo, n_ranks, knobs, matrix, rows=False)

    def schedule(self, plan: Plan, topo: Topology) -> Schedule:
        """Q rotation forward (+ all-to-all of partial outputs) and/or backward."""
        b = new_builder(self, plan, topo)
        n, w = plan.n_ranks, plan.workload
        r = np.arange(n)
        b.stream("compute", "compute")
        b.stream("q", "comm")
        if "fwd" in w.pass_list:
            b.phase = 0
            self._forward(b, plan)
        if "bwd" in w.pass_list:
            b.stream("dq", "comm")
            b.phase = 1
            qside = b.tensor(r, "qside", r, role="input")
            kv = b.tensor(r, "kv", r, role="input")
            dkv = b.tensor(r, "dkv", r, role="output", dtype="fp32")
            rotate_backward(b, plan, travel=qside, travel_kind="qside", grad_kind="dq",
                            grad_dtype=plan.knobs["dq_dtype"], hops=plan.knobs["dq_hops"],
                            block=lambda rr, j: (j, rr), static_inputs=[kv], local_grad=dkv, travel_first=True,
                            stream="q")
        return b.build(topology_record(topo))

    def _forward(self, b: ScheduleBuilder, plan: Plan) -> None:
        n, w = plan.n_ranks, plan.workload
        r = np.arange(n)
        pdt = plan.knobs["partial_dtype"] or w.dtype
        q = b.tensor(r, "q", r, role="input")
        kv = b.tensor(r, "kv", r, role="input")
        out = b.tensor(r, "out", r, role="output", dtype="fp32")
        parts: list[tuple[int, np.ndarray, np.ndarray, np.ndarray]] = []  # (step, ranks, chunk, partial)

        def io(ok, s, j, cur):
            if s == 0:
                return [cur[0][ok], kv[ok]], [out[ok]], "merge", None
            t = b.tensor(r[ok], "out", j[ok], dtype=pdt)
            parts.append((s, r[ok], j[ok], t))
            return [cur[0][ok], kv[ok]], [t], "write", t

        comp = rotate_forward_merge(b, plan, q, "q", lambda rr, j: (j, rr), io)
        if n == 1 or not parts:
            return
        b.stream("out", "comm")
        src = np.concatenate([p[1] for p in parts])
        dst = np.concatenate([p[2] for p in parts])
        sent = np.concatenate([p[3] for p in parts])
        made_by = np.concatenate([comp[p[0]][p[1]] for p in parts])
        landing = b.tensor(dst, "out", dst, dtype=pdt)
        snd, rcv = b.transfer(src, dst, sent, landing, stream="out", step=n, send_deps=[made_by])
        b.free_after(sent, snd)
        # each received partial is merged into the owner's output (step order, the same on every rank)
        mrg = b.combine_op(dst, "merge", src=landing, dst=out[dst], deps=[rcv])
        b.free_after(landing, mrg)

    def timing(self, plan: Plan, topo: Topology) -> dict[str, PassTiming]:
        """Closed form per pass: the uncontended recurrence (a lower bound) and bytes per rank."""
        w, out = plan.workload, {}
        rot = Rotation(plan, topo, rows=False)
        kv, q = size_of(plan, "kv", w.dtype), size_of(plan, "q", w.dtype)
        if "fwd" in w.pass_list:
            out["fwd"] = self._forward_timing(plan, topo, rot, q, kv)
        if "bwd" in w.pass_list:
            qside = size_of(plan, "qside", w.dtype)
            out["bwd"] = backward(rot, "qside", "dq", plan.knobs["dq_dtype"], plan.knobs["dq_hops"],
                                  size_of(plan, "dkv", "fp32"), qside + kv)
        return out

    def _forward_timing(self, plan, topo, rot, q, kv) -> PassTiming:
        """Q rotation, then the all-to-all of partial outputs and the owners' merges."""
        n, dev = plan.n_ranks, plan.device_of_rank
        acc = size_of(plan, "out", "fp32")
        part = size_of(plan, "out", plan.knobs["partial_dtype"] or plan.workload.dtype)
        combine = np.r_[3 * acc, np.zeros(n - 1)]
        cend, d, ends = forward(rot, "q", combine)
        src, step = np.nonzero(rot.ok[:, 1:])
        dst = (src - step - 1) % n
        lat, bw = topo.pair_stats(dev[src], dev[dst])
        t = np.maximum(cend[src], cend[dst]) + lat + part / bw
        a2a = np.zeros(n)
        np.maximum.at(a2a, src, t)
        np.maximum.at(a2a, dst, t)
        merges = np.bincount(dst, minlength=n) * float(rot.cost.merge_time_s(2 * acc + part))
        end = np.maximum(cend, a2a) + merges
        if n > 1:
            end = np.maximum(end, ends.max(axis=1))
        recv = (n - 1) * q + np.bincount(dst, minlength=n) * part
        a2a_cross = np.bincount(dst, weights=np.where(topo.same_node(dev[src], dev[dst]), 0.0, part), minlength=n)
        cross = np.where(rot.hop_cross, (n - 1) * q, 0.0) + a2a_cross
        loads = rot.hop_loads(q, n - 1) + topo.link_loads(dev[src], dev[dst], part)
        comm = (n - 1) * rot.hop(q) + np.bincount(dst, weights=lat + part / bw, minlength=n)
        peak = q + kv + acc + min(n - 1, 2) * q + 2 * (n - 1) * part
        return rot.timing("fwd", end, d.sum(axis=1) + merges, comm, recv, cross, loads, peak, (n - 1) * q)
