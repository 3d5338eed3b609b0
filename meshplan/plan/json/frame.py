"""A validated schedule document's frame — its workload, attention matrix and streams, the ranks it lists — and
the Schedule assembled from it and its converted ops and tensors (shared by the whole-document reader,
:func:`meshplan.plan.json.io.from_json`, and the reader in parts, :mod:`meshplan.plan.json.read_parts`)."""

from __future__ import annotations

import numpy as np

from meshplan.core.errors import UserError
from meshplan.model.matrix import AttnMatrix, attn_matrix
from meshplan.model.workload import Mask, Workload
from meshplan.plan.json.format import ScheduleJSON
from meshplan.plan.schedule import Schedule, Streams


def frame(doc: ScheduleJSON) -> tuple[Workload, AttnMatrix, Streams]:
    """A validated document's workload, attention matrix and streams."""
    w, streams = workload_streams(doc)
    return w, attn_matrix(w, doc.n_chunks), streams


def workload_streams(doc: ScheduleJSON) -> tuple[Workload, Streams]:
    """A validated document's workload and streams."""
    wl = doc.workload
    w = Workload(batch=wl.batch, seq_len=wl.seq_len, n_heads=wl.n_heads, n_kv_heads=wl.n_kv_heads,
                 head_dim=wl.head_dim, dtype=wl.dtype, mask=Mask.parse(wl.mask, "workload.mask"), layout=wl.layout,
                 passes=wl.passes, valid_len=wl.valid_len, model=wl.model, prefix_len=wl.prefix_len,
                 doc_layout=wl.doc_layout, doc_ranks=tuple(tuple(x) for x in wl.doc_ranks))
    streams = Streams()
    for s in doc.streams:
        streams.names.append(s.name)
        streams.kinds.append(s.kind)
        streams.communicator.append(-1 if s.communicator is None else s.communicator)
    return w, streams


def check_ranks(doc: ScheduleJSON, listed: list[int]) -> None:
    """The ranks listed must be 0..N−1 in order, with a device for each.

    Raises:
        UserError: they are not.
    """
    if listed != list(range(doc.n_ranks)) or len(doc.device_of_rank) != doc.n_ranks:
        raise UserError("ranks", f"must list ranks 0..{doc.n_ranks - 1} in order, with a device for each",
                        "fix the file or regenerate it")


def assemble(doc: ScheduleJSON, w: Workload, streams: Streams, ops, tensors) -> Schedule:
    """The Schedule of a document's frame and its converted ops and tensors."""
    del ops.id_map
    return Schedule(algorithm=doc.algorithm, knobs=doc.knobs, workload=w, n_ranks=doc.n_ranks, n_chunks=doc.n_chunks,
                    device_of_rank=np.asarray(doc.device_of_rank), topology=doc.topology.model_dump(), streams=streams,
                    ops=ops, tensors=tensors)
