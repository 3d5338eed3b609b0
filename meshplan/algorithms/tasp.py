"""TASP (arXiv 2509.26541): the KV all-gather of Ring-Attention as N − 1 concurrent Hamiltonian rings.

Each rank's KV chunk is cut into f = N − 1 sub-chunks; sub-chunk k travels on ring k, the k-th directed
Hamiltonian cycle of a decomposition of K_N* (:mod:`meshplan.algorithms.tasp_cycles`), so every link of a
fully connected node carries one ring at once. At step s every rank computes its query chunk against the f
sub-chunks it holds (one per ring, from f different owners; step 0: its own KV) and forwards them — the
f transfers of a step form one batch (concurrent; on PCIe they contend: the simulator decides).
The sequence is cut into N·f chunks of the workload's layout, rank r holding chunks r·f … r·f + f − 1, which
for ``contiguous`` and ``zigzag`` is exactly that layout's chunk r over N ranks; hence S must be a multiple
of N·(N − 1) (zigzag: 2·N·(N − 1)). ``striped`` is refused. Forward only, as TASP's code.

Bytes received per rank (forward): (N − 1) · KVc — Ring's, on N − 1 links instead of one.
Valid N: 8, 12, 16, 20 (shipped decompositions); N = 4 and 6 have none; other N: not implemented.
"""

from __future__ import annotations

import numpy as np

from meshplan.algorithms.base import BuiltTiming, Knob, new_builder, topology_record
from meshplan.algorithms.ring import MAPPINGS
from meshplan.algorithms.tasp_cycles import IMPOSSIBLE, shipped
from meshplan.core.errors import SkipCandidate, UserError
from meshplan.model.matrix import attn_matrix
from meshplan.model.topology import Topology
from meshplan.plan.plan import Plan
from meshplan.plan.schedule import Schedule


class TASP(BuiltTiming):
    """Ring-Attention's KV all-gather decomposed into N − 1 concurrent Hamiltonian rings (forward only)."""

    name = "tasp"
    forward_only = True
    summary = "TASP: KV all-gather as N−1 concurrent Hamiltonian rings over all links (forward only)"
    knobs = {"mapping": Knob("mapping", "auto", MAPPINGS, "rank -> GPU placement (auto = identity)")}

    def check(self, workload, topo, n_ranks, knobs) -> None:
        """Forward only; N with a shipped decomposition; S a multiple of N·(N−1) (2·N·(N−1) for zigzag)."""
        super().check(workload, topo, n_ranks, knobs)
        if n_ranks in IMPOSSIBLE:
            raise SkipCandidate("no Hamiltonian decomposition for N", f"K_{n_ranks}* has no decomposition into "
                                f"{n_ranks - 1} Hamiltonian cycles (Tillson 1980): TASP cannot use {n_ranks} ranks")
        if n_ranks not in shipped():
            raise SkipCandidate("not implemented for N", f"TASP is implemented for N = "
                                f"{', '.join(map(str, sorted(shipped())))}, not {n_ranks}")
        if workload.layout == "striped":
            raise SkipCandidate("layout not supported", "TASP takes the contiguous or zigzag layout")
        unit = n_ranks * (n_ranks - 1) * (2 if workload.layout == "zigzag" else 1)
        if workload.prefix_len:
            raise SkipCandidate("no cached prefix", "TASP is implemented without a KV-cache prefix")
        regions = [e - a for a, e, _, _ in workload.regions()]
        if len(regions) > 1 and any(x % unit for x in regions):
            raise SkipCandidate("document not divisible by N·(N−1)",
                                f"TASP cuts every document into multiples of {unit} tokens: pad each document "
                                "to one, or use --doc-layout packed")
        if workload.seq_len % unit:
            padded = -(-workload.seq_len // unit) * unit
            raise SkipCandidate("sequence not divisible by N·(N−1)",
                                f"TASP cuts every KV chunk into N−1 = {n_ranks - 1} pieces: --seq-len must be a "
                                f"multiple of {unit}; pad to {padded} with --valid-len {workload.n_valid}")

    def plan(self, workload, topo, n_ranks, knobs, matrix=None) -> Plan:
        """Rank r computes its query chunks' rows (N·f chunks, f per rank)."""
        f = n_ranks - 1
        try:
            m = attn_matrix(workload, n_ranks * f)
        except UserError as err:
            raise SkipCandidate("sequence not divisible by N·(N−1)", str(err)) from None
        home = np.arange(n_ranks * f) // f
        owner = np.broadcast_to(home[:, None], m.permitted.shape).copy()
        owner[~m.permitted] = -1
        return Plan(self.name, knobs, m, n_ranks, owner, home, home, self.device_map(topo, n_ranks, knobs))

    def build(self, plan: Plan, topo: Topology) -> Schedule:
        """N steps; at each, f sub-chunks move on f rings at once (one batch) while the rank computes."""
        b = new_builder(self, plan, topo)
        n = plan.n_ranks
        f, r = n - 1, np.arange(n)
        succ = shipped()[n]                                  # [f, n]
        pred = np.argsort(succ, axis=1)                      # pred[k, succ[k, x]] = x
        b.stream("compute", "compute")
        b.stream("kv", "comm")
        b.phase = 0
        own = r[:, None] * f + np.arange(f)[None, :]         # [n, f] the rank's chunks
        q = b.tensor(r, "q", own, role="input")
        out = b.tensor(r, "out", own, role="output", dtype="fp32")
        held = [b.tensor(r, "kv", own[:, k], role="input") for k in range(f)]
        owner = np.tile(r, (f, 1))                           # owner[k, x]: whose sub-chunk k rank x holds
        recv, last = [np.full(n, -1)] * f, np.full(n, -1)
        permitted = plan.matrix.permitted
        for s in range(n):
            nxt, snds = None, []
            if s < n - 1:                                    # forward every ring's piece (one batch)
                nxt, got = [], []
                for k in range(f):
                    new_owner = owner[k][pred[k]]
                    land = b.tensor(r, "kv", new_owner * f + k)
                    snd, rc = b.transfer(r, succ[k], held[k], land[succ[k]], stream="kv", step=s,
                                         recv_deps=[last[succ[k]]])
                    snds.append(snd)
                    on = np.empty(n, dtype=np.int64)
                    on[succ[k]] = rc
                    nxt.append(land)
                    got.append(on)
            kv_chunks = np.stack([owner[k] * f + k for k in range(f)], axis=1)     # [n, f]
            ok = permitted[own[:, :, None], kv_chunks[:, None, :]].any(axis=(1, 2))
            comp = np.full(n, -1)
            comp[ok] = b.compute(r[ok], own[ok], kv_chunks[ok], inputs=[q[ok]] + [h[ok] for h in held],
                                 outputs=[out[ok]], combine="merge", deps=[rc[ok] for rc in recv])
            if s > 0:                                        # received pieces die after their compute and send
                for k in range(f):
                    b.free_after(held[k][ok], comp[ok])
                    if snds:
                        b.free_after(held[k], snds[k])
            last = np.where(ok, comp, last)
            if nxt is not None:
                held, recv = nxt, got
                owner = np.stack([owner[k][pred[k]] for k in range(f)])
        return b.build(topology_record(topo))


