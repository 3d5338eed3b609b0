"""``plan_batch``: one packed batch's plan, from its document boundaries (issue 25; ``meshplan plan-batch``).

A training loop brings a new pack of documents every step. ``plan_batch`` plans it with ``doc-place``
(:mod:`meshplan.algorithms.docplace`: documents placed by their work, long ones split over a subgroup), lowers
and verifies the schedule and predicts it with the contended closed form (:mod:`meshplan.cost.estimate`: the
simulator's sharing rules on time-averaged loads, within 5% of the simulator on Pile packs, milliseconds where
simulating takes seconds) or, when asked, with the simulator (``simulate``), and sets it
beside two references — per-document zigzag Ring (TransformerEngine's THD layout: every document padded to a
multiple of 2N and cut over all ranks) and the best fixed method ``search`` picks for the batch (on the same
padded documents) — so the answer says what planning per batch buys. ``best`` is the fastest of them.

``plan_s`` is the wall time from the document boundaries to the verified, lowered and predicted doc-place plan
(the references' predictions left out); a plan for the same documents, cluster and shape comes from an
in-process cache unless ``cache=False``. Each candidate's ``model_level`` says how it was predicted:
``estimated`` (the contended closed form) or ``simulated``.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from meshplan.core.errors import UserError
from meshplan.core.heap import keep_freed_memory
from meshplan.model.doc_lengths import document_lengths
from meshplan.model.topology import Topology
from meshplan.model.workload import Mask, Workload
from meshplan.plan.verify import Report, verify
from meshplan.search.candidate import Candidate, closed_form_predicted, make_candidate, simulate_candidate

_CACHE: OrderedDict = OrderedDict()
CACHE_SIZE = 256


@dataclass
class BatchPlan:
    """What :func:`plan_batch` returns.

    Attributes:
        best: the fastest candidate (by predicted makespan, seconds).
        candidates: every candidate with its role (``roles[i]`` for ``candidates[i]``): the doc-place plan,
            per-document zigzag Ring, and the best fixed method.
        plan_s: seconds from the boundaries to the verified, predicted doc-place plan (0 work when cached).
        cached: the doc-place plan came from the cache.
    """

    best: Candidate
    candidates: list[Candidate]
    roles: list[str]
    plan_s: float
    cached: bool = False
    notes: list[str] = field(default_factory=list)

    def json(self) -> dict[str, Any]:
        """The ``--json`` body: ``plan_s``, ``cached``, ``best`` and ``candidates`` (each with ``role``)."""
        rows = [_row(c, r) for c, r in zip(self.candidates, self.roles)]
        best = rows[self.candidates.index(self.best)]
        return {"plan_s": self.plan_s, "cached": self.cached, "best": best, "candidates": rows, "notes": self.notes}


def _row(c: Candidate, role: str) -> dict[str, Any]:
    p = c.predicted
    return {"algorithm": c.algorithm, "knobs": c.knobs, "layout": c.workload.layout, "role": role,
            "tokens": c.workload.seq_len, "model_level": c.model_level,
            "predicted": {"makespan_s": p.makespan_s, **{f"{k}_s": m.makespan_s for k, m in p.passes.items()}}}


def plan_batch(cu_seqlens, topo: Topology, n_ranks: int, shape: Workload, *, cache: bool = True,
               references: bool = True, simulate: bool = False) -> BatchPlan:
    """Plan one packed batch: doc-place (documents placed by their work, long ones split over a subgroup) lowered
    to a schedule, verified and predicted, beside per-document zigzag Ring and the best fixed method ``search``
    picks for the batch (both on the documents padded to a multiple of 2N, both simulated).

    Args:
        cu_seqlens: cumulative document ends, 0 first and S last (FlashAttention's varlen offsets).
        topo: the cluster; ``n_ranks`` the CP group's ranks on it.
        shape: the model shape and pass (batch, heads, KV heads, head dim, dtype, passes); its sequence
            length, mask and layout are replaced by the batch's.
        cache: reuse a plan made for the same documents, cluster and shape.
        references: also predict per-document zigzag Ring and the best fixed method.
        simulate: predict the plan with the simulator (seconds at 64+ ranks) instead of the contended closed form.

    Returns:
        A :class:`BatchPlan`: ``candidates`` (the doc-place plan first) with their ``roles``, ``best`` (the
        fastest predicted), ``plan_s`` (seconds to plan doc-place) and ``notes``.

    Raises:
        UserError: bad boundaries; ``n_ranks`` not the topology's device count; no plan fits (from search).
    """
    if n_ranks != topo.n_devices:
        raise UserError("n_ranks", f"{n_ranks} ranks on a topology loaded for {topo.n_devices} devices",
                        f"load it for the CP group: Topology.load({topo.name!r}, gpus={n_ranks})")
    keep_freed_memory()                 # numpy temporaries reuse the heap's pages (meshplan.core.heap)
    t0 = time.perf_counter()
    lens = document_lengths(cu_seqlens)
    key = (tuple(lens.tolist()), topo.content_hash, n_ranks, shape.batch, shape.n_heads, shape.n_kv_heads,
           shape.head_dim, shape.dtype, shape.passes, simulate)
    hit = _CACHE.get(key) if cache else None
    if hit is None:
        plan = make_candidate("doc-place", with_documents(shape, lens, pad_to=1), topo, n_ranks, {},
                              keep_schedule=True, alongside=lambda s: verify(s, topo.memory_bytes))
        plan.schedule = plan.plan.extra["schedule"]
        _verified(plan.plan.extra.pop("alongside"))
        if simulate:
            simulate_candidate(plan, topo, None)
        else:
            plan.predicted, plan.model_level = closed_form_predicted(plan, None, estimate=True), "estimated"
        if cache:
            _CACHE[key] = plan
            while len(_CACHE) > CACHE_SIZE:
                _CACHE.popitem(last=False)
    else:
        _CACHE.move_to_end(key)
    doc_place = hit or plan
    plan_s = time.perf_counter() - t0
    cands, roles, notes = [doc_place], ["plan"], []
    if not doc_place.plan.extra.get("cap_ok", True):
        notes.append("doc-place could not keep every rank within the token cap: the rest of the layer runs "
                     "unbalanced")
    if references:
        more, more_roles, note = _references(lens, topo, n_ranks, shape)
        cands, roles, notes = cands + more, roles + more_roles, notes + note
    best = min(cands, key=lambda c: c.predicted.makespan_s)
    return BatchPlan(best, cands, roles, plan_s, hit is not None, notes)


def _references(lens: np.ndarray, topo: Topology, n_ranks: int, shape: Workload):
    """(candidates, roles, notes) of the two references on the documents padded to 2N: per-document zigzag Ring
    and search's best fixed method."""
    from meshplan.algorithms import NAMES
    from meshplan.search import run_search

    padded = with_documents(shape, lens, pad_to=2 * n_ranks)
    notes = []
    if padded.seq_len != int(lens.sum()):
        notes.append(f"the references pad each document to a multiple of 2N = {2 * n_ranks}: "
                     f"{padded.seq_len - int(lens.sum())} padding tokens")
    cands = [simulate_candidate(make_candidate("ring", padded, topo, n_ranks, {}), topo, None)]
    roles = ["per_doc_ring"]
    fixed = next((c for c in run_search(padded, topo, n_ranks, algos=list(NAMES)).candidates
                  if c.predicted is not None), None)
    if fixed is not None:
        cands.append(fixed)
        roles.append("best_fixed")
    return cands, roles, notes


def with_documents(shape: Workload, lens: np.ndarray, pad_to: int) -> Workload:
    """``shape`` over these documents, each padded to a multiple of ``pad_to`` tokens (per-document layout)."""
    slots = -(-lens // pad_to) * pad_to
    spec = ",".join(f"{a}+{b - a}" if b > a else str(a) for a, b in zip(lens.tolist(), slots.tolist()))
    return shape.with_(seq_len=int(slots.sum()), mask=Mask.parse("docs:" + spec, "--cu-seqlens"), layout="zigzag",
                       doc_layout="per-doc", valid_len=None, prefix_len=0)


def _verified(report: Report) -> None:
    """Raise unless the verifier's ``report`` on the doc-place schedule is clean."""
    if not report.ok:
        if report.over_memory_only:
            raise UserError("--cu-seqlens", f"the doc-place plan does not fit the device: {report.violations[0]}",
                            "add GPUs or shorten the batch")
        raise RuntimeError(f"internal error: the doc-place schedule fails verification: {report.violations[0]}")
