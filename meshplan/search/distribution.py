"""Planning for a document-length distribution: does per-batch planning pay? (``search --doc-lengths``.)

Before training, a team knows its data's document lengths, not the packs. This draws K packs of S tokens from a
histogram (:mod:`meshplan.model.doc_lengths`) and predicts, on every pack,

* each **fixed method** — one algorithm, layout and knob setting used for every batch, as a framework is
  configured once (the documents padded to a multiple of 2N, what per-document layouts need): ``search`` on each
  pack, and the simulator for the leading methods (and per-document zigzag Ring, always shown) on the packs
  where search left them unsimulated; layouts that come out the same computation on every pack are one row; and
* **per-batch planning** — :func:`~meshplan.search.batch.plan_batch` on each pack: the fastest of its doc-place
  plan and that pack's best fixed method.

Rows are ranked by their mean step time over the packs, with the 90th percentile (numpy's linear
interpolation) as the spread. Deterministic for a seed.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from meshplan.model.doc_lengths import DocLengths, draw_packs
from meshplan.model.topology import Topology
from meshplan.model.workload import Workload

LEADERS = 6          # fixed methods simulated on every pack (by their mean over the packs search simulated)


@dataclass
class DistributionRow:
    """One row: a fixed method (``role`` "fixed") or per-batch planning (``role`` "per_batch"); seconds per pack."""

    algorithm: str
    layout: str | None
    knobs: dict[str, Any]
    role: str
    times_s: list[float] = field(default_factory=list)

    @property
    def mean_s(self) -> float:
        """Mean predicted step time over the packs, seconds."""
        return float(np.mean(self.times_s))

    @property
    def p90_s(self) -> float:
        """90th percentile over the packs, seconds."""
        return float(np.percentile(self.times_s, 90))

    def json(self) -> dict[str, Any]:
        """``--json`` row."""
        return {"algorithm": self.algorithm, "layout": self.layout, "knobs": self.knobs, "role": self.role,
                "mean_s": self.mean_s, "p90_s": self.p90_s, "times_s": self.times_s}


def rank_for_distribution(lengths: DocLengths, seq_len: int, batches: int, topo: Topology, n_ranks: int,
                          shape: Workload, seed: int = 0,
                          progress: Callable[[int, int, str], None] | None = None) -> dict[str, Any]:
    """Rows best first (by mean) for ``batches`` packs of ``seq_len`` tokens; the ``--json`` body.

    Raises:
        UserError: bad pack sizes (from :func:`~meshplan.model.doc_lengths.draw_packs`).
    """
    from meshplan.algorithms.ring import Ring
    from meshplan.search import run_search
    from meshplan.search.batch import plan_batch, with_documents
    from meshplan.search.candidate import predict

    packs = draw_packs(lengths, seq_len, batches, seed)
    per_batch = DistributionRow("per-batch", None, {}, "per_batch")
    picks: list[str] = []
    seen: dict[str, dict[int, float]] = {}
    meta: dict[str, tuple[str, str, dict]] = {}
    padded = []
    for k, lens in enumerate(packs):
        if progress:
            progress(k, len(packs), f"pack {k + 1} of {len(packs)}")
        cu = np.concatenate([[0], np.cumsum(lens)])
        w = with_documents(shape, lens, pad_to=2 * n_ranks)
        padded.append(w)
        got = run_search(w, topo, n_ranks)
        for c in got.candidates:
            if c.model_level == "simulated" and c.predicted is not None and c.predicted.makespan_s is not None:
                key = _key(c)
                seen.setdefault(key, {})[k] = c.predicted.makespan_s
                meta[key] = (c.algorithm, c.workload.layout, c.knobs)
        plan = plan_batch(cu, topo, n_ranks, shape, cache=False, references=False)
        best_fixed = min((t[k] for t in seen.values() if k in t), default=np.inf)
        own = plan.best.predicted.makespan_s
        per_batch.times_s.append(float(min(own, best_fixed)))
        picks.append("doc-place" if own <= best_fixed else "best fixed")
    ring = ("ring", "zigzag", Ring().normalize({}))            # the reference everyone knows: always a row
    meta[_key_of(*ring)] = ring
    seen.setdefault(_key_of(*ring), {})
    leaders = sorted((k for k in seen if seen[k]), key=lambda key: np.mean(list(seen[key].values())))[:LEADERS]
    leaders += [_key_of(*ring)] if _key_of(*ring) not in leaders else []
    rows, shown = [], set()
    for key in leaders:
        algo, layout, knobs = meta[key]
        row = DistributionRow(algo, layout, knobs, "fixed")
        for k, w in enumerate(padded):
            if k not in seen[key]:
                seen[key][k] = predict(algo, w.with_(layout=layout), topo, n_ranks,
                                       _as_given(knobs)).predicted.makespan_s
            row.times_s.append(float(seen[key][k]))
        same = (algo, tuple(row.times_s))              # layouts that are the same computation here: one row
        if same not in shown:
            shown.add(same)
            rows.append(row)
    rows.append(per_batch)
    rows.sort(key=lambda r: r.mean_s)
    return {"batches": batches, "seq_len": seq_len, "seed": seed, "documents_per_pack": [len(p) for p in packs],
            "histogram": lengths.source, "per_batch_picks": picks, "rows": [r.json() for r in rows]}


def _as_given(knobs: dict) -> dict:
    """A candidate's knobs as a user gives them: unset ones (None) left out, a resolved ``auto:choice`` back to
    ``auto`` (the method resolves it again on each pack, as a framework configured with it would)."""
    return {k: "auto" if isinstance(v, str) and v.startswith("auto:") else v for k, v in knobs.items()
            if v is not None}


def _key(c) -> str:
    return _key_of(c.algorithm, c.workload.layout, c.knobs)


def _key_of(algorithm: str, layout: str, knobs: dict) -> str:
    return json.dumps([algorithm, layout, knobs], sort_keys=True, default=str)
