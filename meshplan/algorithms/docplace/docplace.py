"""``doc-place``: each document where its work is cheapest — whole on one rank, or split over a subgroup.

The plan (:mod:`.placement`): documents by their tile-quantised causal work, longest first, each to the
least-loaded rank with room under the token cap (LPT, Graham 1969); a document above the mean work (or the cap)
split over the fewest consecutive ranks that bring it under (its group, inside a node when it fits; groups kept
apart where they can be). The layout (:mod:`meshplan.model.doc_place`): rank r holds chunk 2r (its whole
documents) and chunk 2r + 1 (its zigzag pieces of split documents); the workload carries the placement as
``doc_ranks``.

The schedule, per pass: rank r computes its whole documents (block (2r, 2r)) with no communication. A group's
pieces run one of two ways (:func:`split_modes`, knob ``split``):

* **head-parallel** (:mod:`.heads`; ``split=auto``, where the group shares no rank with another group and a
  Ulysses degree u fits: u divides the group, the query and the KV heads, and each run of u members lies in one
  node): Ulysses inside each node (all-to-alls), a ring over the group's nodes — USP over the group's pieces, so
  across nodes only the ring's KV moves (u times less than fetching) and each rank runs one kernel per ring step;
  with u = 1 (no degree fits the heads) a plain zigzag ring over the group;
* **direct fetch** (:mod:`.fetch`; overlapping groups, or ``split=fetch``): every member fetches every other
  member's pieces, one batch per offset, and sends their partial dK/dV home.
"""

from __future__ import annotations

import numpy as np

from meshplan.algorithms.base import DTYPE_KNOB, BuiltTiming, Knob, new_builder, topology_record
from meshplan.algorithms.docplace import fetch, heads
from meshplan.algorithms.docplace.heads import HeadGroups
from meshplan.algorithms.docplace.placement import DEFAULT_TOKEN_CAP, place_documents
from meshplan.core.errors import SkipCandidate
from meshplan.model.matrix import attn_matrix
from meshplan.model.topology import Topology
from meshplan.model.workload import DOC_PLACE, Workload
from meshplan.plan.plan import Plan
from meshplan.plan.schedule import Schedule


def _cap(raw: str) -> float:
    value = float(raw)
    if not value >= 1.0:
        raise ValueError(raw)
    return value


class DocPlace(BuiltTiming):
    """Documents placed by their work (module docstring)."""

    name = "doc-place"
    summary = "documents placed by work: short ones whole on a rank, long ones zigzag over a subgroup sized to them"
    places_tokens = True
    contended_estimate = True
    knobs = {
        "token_cap": Knob("token_cap", DEFAULT_TOKEN_CAP, None,
                          "most tokens per rank, as a multiple of the mean (>= 1)", _cap),
        "dkv_dtype": DTYPE_KNOB("dkv_dtype", "fp32", "dtype of partial dK/dV on the wire"),
        "split": Knob("split", "auto", ("auto", "fetch"), "a split document's group: auto (head-parallel: Ulysses "
                      "inside the node x ring over nodes, where the group stands alone) or fetch (direct fetch)"),
    }

    def check(self, workload: Workload, topo: Topology, n_ranks: int, knobs: dict) -> None:
        """Documents only: a docs mask without a cached prefix or ``--valid-len``."""
        if workload.mask.kind != "docs" or workload.prefix_len or workload.valid_len is not None:
            raise SkipCandidate("documents only", "doc-place needs a docs mask (no prefix, no --valid-len)")

    def plan(self, workload, topo, n_ranks, knobs, matrix=None) -> Plan:
        """Place the documents (:func:`~.placement.place_documents` with the kernel's forward tile), then own
        every block by its query chunk's rank."""
        self.check(workload, topo, n_ranks, knobs)
        mask = workload.mask
        per_node = _ranks_per_node(topo, n_ranks)
        unit = 1 if knobs["split"] == "fetch" else max(
            d for d in range(1, per_node + 1)
            if per_node % d == 0 and workload.n_heads % d == 0 and workload.n_kv_heads % d == 0)
        placed = place_documents(mask.doc_real_lens(), n_ranks, slots=mask.doc_lens,
                                 tile=topo.kernel.tile("fwd"), token_cap=knobs["token_cap"],
                                 ranks_per_node=per_node, group_unit=unit)
        w = workload.with_(layout=DOC_PLACE, doc_ranks=placed.doc_ranks)
        m = attn_matrix(w, 2 * n_ranks)
        home = np.arange(2 * n_ranks) // 2
        owner = np.where(m.permitted, home[:, None], -1)
        return Plan(self.name, knobs, m, n_ranks, owner, home, home, self.device_map(topo, n_ranks, knobs),
                    extra={"cap_ok": placed.cap_ok})

    def build(self, plan: Plan, topo: Topology) -> Schedule:
        """Whole documents and fetched groups (:mod:`.fetch`), head-parallel groups (:mod:`.heads`)."""
        b = new_builder(self, plan, topo)
        w = plan.workload
        groups, fetched = split_modes(w, topo, plan.n_ranks, plan.knobs["split"])
        b.stream("compute", "compute")
        b.stream("kv", "comm")
        if groups:
            b.stream("a2a", "comm")
        permitted = plan.matrix.permitted
        if "fwd" in w.pass_list:
            b.phase = 0
            fetch.forward(b, plan, fetched)
            for hg in groups:
                heads.forward(b, hg, permitted)
        if "bwd" in w.pass_list:
            b.stream("dkv", "comm")
            b.phase = 1
            fetch.backward(b, plan, fetched)
            for hg in groups:
                heads.backward(b, hg, permitted, plan.knobs["dkv_dtype"])
        return b.build(topology_record(topo))


def split_modes(w: Workload, topo: Topology, n: int, split: str) -> tuple[list[HeadGroups], np.ndarray]:
    """(the head-parallel groups, by shape (u, m); [n] bool: the ranks whose pieces are fetched directly).

    A group (ranks [a, a + g) of a split document; documents with the very same ranks share it) runs
    head-parallel when ``split`` is ``auto`` and it shares no rank with another group: u is the largest degree
    dividing g, the query heads and the KV heads whose runs of u members each lie in one node (u = 1, a ring over
    the group, when none ≥ 2 does). Every other group's ranks fetch."""
    ranks = np.asarray(w.doc_ranks, dtype=np.int64).reshape(-1, 2)
    windows = sorted({(int(a), int(g)) for a, g in ranks if g > 1})
    fetched = np.zeros(n, dtype=bool)
    per_node = _ranks_per_node(topo, n)
    shapes: dict[tuple[int, int], list[int]] = {}
    cover = np.zeros(n, dtype=np.int64)
    for a, g in windows:
        cover[a:a + g] += 1
    for a, g in windows:
        if split == "fetch" or (cover[a:a + g] > 1).any():
            fetched[a:a + g] = True
            continue
        u = max(d for d in range(1, g + 1) if g % d == 0 and w.n_heads % d == 0 and w.n_kv_heads % d == 0
                and _inside_nodes(a, g, d, per_node))
        shapes.setdefault((u, g // u), []).append(a)
    groups = [HeadGroups(u, m, w.n_heads, np.asarray(firsts, dtype=np.int64))
              for (u, m), firsts in sorted(shapes.items())]
    return groups, fetched


def _inside_nodes(a: int, g: int, u: int, per_node: int) -> bool:
    """Whether every run of u consecutive members of the group [a, a + g) lies in one node."""
    starts = np.arange(a, a + g, u)
    return bool((starts // per_node == (starts + u - 1) // per_node).all())


def _ranks_per_node(topo: Topology, n: int) -> int:
    per = min(topo.gpus_per_node, n)
    return per if n % per == 0 else n


