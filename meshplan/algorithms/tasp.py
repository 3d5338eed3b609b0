"""TASP (arXiv 2509.26541): the KV all-gather of Ring-Attention as f concurrent Hamiltonian rings.

Each rank's KV chunk is cut into f sub-chunks; sub-chunk k travels on ring k, the k-th directed Hamiltonian cycle
of a decomposition (:mod:`meshplan.algorithms.tasp_cycles`). ``routing`` chooses it:

- ``flat``: f = N − 1 cycles decomposing K_N*, so every link of a fully connected node carries one ring at once
  (on two nodes about half the arcs cross them: the node's network carries ~N/4 of a KV chunk per step and
  direction against Ring's one);
- ``node-aware`` (ranks on 2+ nodes of g GPUs each, g ∈ {2, 4, 8}): f = g cycles, each walking a Hamiltonian path
  inside every node in turn, so each rank sends one of its g sub-chunks across nodes per step — every NIC carries
  one flow, a node's network 1 KV chunk per step and direction spread over its g NICs (TASP's topology
  decomposition of an H100 cluster: an AlltoAll NVSwitch node plus a NIC per GPU);
- ``auto`` (default): node-aware where the ranks span nodes, else flat.

At step s every rank computes its query chunk against the f sub-chunks it holds (one per ring, from f different
owners; step 0: its own KV) and forwards them — the f transfers of a step form one batch (concurrent; on PCIe
they contend: the simulator decides). The sequence is cut into N·f chunks of the workload's layout, rank r
holding chunks r·f … r·f + f − 1, which for ``contiguous`` and ``zigzag`` is exactly that layout's chunk r over
N ranks; hence S must be a multiple of N·f (zigzag: 2·N·f). ``striped`` is refused. Forward only, as TASP's code.

Bytes received per rank (forward): (N − 1) · KVc — Ring's, on f links instead of one.
Valid N, flat: 8, 12, 16, 20 (shipped decompositions); N = 4 and 6 have none; other N: not implemented.
Node-aware: any number of nodes ≥ 2 holding g ∈ {2, 4, 8} ranks each.
"""

from __future__ import annotations

import numpy as np

from meshplan.algorithms.base import BuiltTiming, Knob, new_builder, topology_record
from meshplan.algorithms.ring import MAPPINGS
from meshplan.algorithms.tasp_cycles import IMPOSSIBLE, node_aware, shipped, shipped_paths
from meshplan.core.errors import SkipCandidate, UserError
from meshplan.model.matrix import attn_matrix
from meshplan.model.topology import Topology
from meshplan.plan.plan import Plan
from meshplan.plan.schedule import Schedule

ROUTINGS = ("auto", "flat", "node-aware")


class TASP(BuiltTiming):
    """Ring-Attention's KV all-gather decomposed into concurrent Hamiltonian rings (forward only)."""

    name = "tasp"
    forward_only = True
    summary = "TASP: KV all-gather as concurrent Hamiltonian rings over all links (forward only)"
    knobs = {"mapping": Knob("mapping", "auto", MAPPINGS, "rank -> GPU placement (auto = identity)"),
             "routing": Knob("routing", "auto", ROUTINGS, "the rings: flat (N−1 over all ranks) | node-aware (one "
                             "per GPU of a node, each crossing nodes once per node) | auto (node-aware across nodes)")}
    #: node-aware TASP runs on any number of nodes, but its schedule has N · N · g transfers: search takes it up to
    #: this many ranks (``simulate --algo tasp`` at any N)
    search_max_ranks = 64

    def cycles(self, topo: Topology, n_ranks: int, knobs) -> tuple[str, np.ndarray]:
        """(the routing taken, [f, N] successor arrays: cycle k sends rank r's piece to ``succ[k, r]``).

        Raises:
            SkipCandidate: no decomposition for these ranks (the reason and what to use).
        """
        want = knobs["routing"]
        node = topo.node_of_device[self.device_map(topo, n_ranks, knobs)]
        counts = np.bincount(node)[np.unique(node)]
        if want != "flat" and len(counts) >= 2:
            if (counts == counts[0]).all() and int(counts[0]) in shipped_paths():
                order = np.lexsort((np.arange(n_ranks), node))            # ranks node by node
                return "node-aware", node_aware(order.reshape(len(counts), int(counts[0])))
            if want == "node-aware":
                raise SkipCandidate("no node-aware decomposition", f"node-aware TASP needs every node to hold the "
                                    f"same number of ranks, one of {sorted(shipped_paths())}: these hold "
                                    f"{sorted(set(counts.tolist()))}")
        if want == "node-aware":
            raise SkipCandidate("node-aware needs 2+ nodes", "the ranks are on one node: use --knob routing=flat")
        if n_ranks in IMPOSSIBLE:
            raise SkipCandidate("no Hamiltonian decomposition for N", f"K_{n_ranks}* has no decomposition into "
                                f"{n_ranks - 1} Hamiltonian cycles (Tillson 1980): TASP cannot use {n_ranks} ranks")
        if n_ranks not in shipped():
            raise SkipCandidate("not implemented for N", f"flat TASP is implemented for N = "
                                f"{', '.join(map(str, sorted(shipped())))}, not {n_ranks}")
        return "flat", shipped()[n_ranks]

    def check(self, workload, topo, n_ranks, knobs) -> None:
        """Forward only; a decomposition for the ranks (:meth:`cycles`); S a multiple of N·f (2·N·f for zigzag)."""
        super().check(workload, topo, n_ranks, knobs)
        f = self.cycles(topo, n_ranks, knobs)[1].shape[0]
        if workload.layout == "striped":
            raise SkipCandidate("striped layout of tasp not supported", "TASP takes the contiguous or zigzag layout")
        unit = n_ranks * f * (2 if workload.layout == "zigzag" else 1)
        if workload.prefix_len:
            raise SkipCandidate("no cached prefix", "TASP is implemented without a KV-cache prefix")
        regions = [e - a for a, e, _, _ in workload.regions()]
        if len(regions) > 1 and any(x % unit for x in regions):
            raise SkipCandidate("a document not a multiple of N x f tokens (f: TASP's rings per chunk)",
                                f"TASP cuts every document into multiples of {unit} tokens: pad each document "
                                "to one, or use --doc-layout packed")
        if workload.seq_len % unit:
            padded = -(-workload.seq_len // unit) * unit
            raise SkipCandidate("sequence not a multiple of N x f tokens (f: TASP's rings per chunk; simulate --algo "
                                "tasp names the padding)",
                                f"TASP cuts every KV chunk into f = {f} pieces (one per ring): --seq-len must be a "
                                f"multiple of {unit}; pad to {padded} with --valid-len {workload.n_valid}")

    def plan(self, workload, topo, n_ranks, knobs, matrix=None) -> Plan:
        """Rank r computes its query chunks' rows (N·f chunks, f per rank); the cycles in ``extra``."""
        routing, succ = self.cycles(topo, n_ranks, knobs)
        f = succ.shape[0]
        try:
            m = attn_matrix(workload, n_ranks * f)
        except UserError as err:
            raise SkipCandidate("sequence not a multiple of N x f tokens (f: TASP's rings per chunk; simulate --algo "
                                "tasp names the padding)", str(err)) from None
        home = np.arange(n_ranks * f) // f
        owner = np.broadcast_to(home[:, None], m.permitted.shape).copy()
        owner[~m.permitted] = -1
        plan = Plan(self.name, knobs, m, n_ranks, owner, home, home, self.device_map(topo, n_ranks, knobs))
        plan.extra.update(routing=routing, succ=succ)
        return plan

    def build(self, plan: Plan, topo: Topology) -> Schedule:
        """N steps; at each, f sub-chunks move on f rings at once (one batch) while the rank computes."""
        b = new_builder(self, plan, topo)
        n = plan.n_ranks
        succ = plan.extra["succ"]                            # [f, n]
        f, r = succ.shape[0], np.arange(n)
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


