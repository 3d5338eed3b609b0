"""A quotient build's Schedule: the representatives' kept ops and tensors renumbered compactly and assembled as any
build, with its :class:`~meshplan.plan.quotient.Quotient` (the partners in the final numbering, each orbit member's
kernel shapes where they differ). The build and its checks: :mod:`meshplan.plan.quotient`."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from meshplan.plan.quotient import SHAPE_FIELDS, TENSOR_REFS, NotSymmetric, Quotient, QuotientCheck


def assemble_quotient(builder, topology: dict, assemble: Callable):
    """The Schedule of a quotient build's kept ops and tensors (ids renumbered compactly, then assembled as any
    build by ``assemble``: :func:`meshplan.plan.build.assemble`), with its :class:`Quotient`.

    Raises:
        NotSymmetric: a kept op refers to an op or tensor that was not kept (a dependency across ranks).
    """
    import copy

    q: QuotientCheck = builder.q
    q.finish(builder._alloc, builder._free)
    op_new = _compact([b["ids"] for b in builder._ops], builder._n_ops)
    t_new = _compact([b["ids"] for b in builder._tensors], builder._n_tensors)
    ops = []
    for b in builder._ops:
        b = dict(b, ids=op_new[b["ids"]], deps=_mapped(op_new, b["deps"]))
        for name in TENSOR_REFS:
            if isinstance(b.get(name), np.ndarray) and b[name].ndim:
                b[name] = _mapped(t_new, b[name])
        if "partner" in b:
            b["partner"] = _mapped(op_new, b["partner"])
        ops.append(b)
    view = copy.copy(builder)
    view._ops = ops
    view._tensors = [dict(b, ids=t_new[b["ids"]]) for b in builder._tensors]
    view._n_tensors = int(t_new.max(initial=-1)) + 1
    view._alloc = [_kept_pairs(t_new, op_new, t, o) for t, o in builder._alloc]
    view._free = [_kept_pairs(t_new, op_new, t, o) for t, o in builder._free]
    sched = assemble(view, topology)
    lengths = [len(b["rank"]) for b in ops]
    rank = np.concatenate([b["rank"] for b in ops]) if ops else np.zeros(0, dtype=np.int64)
    new_id = np.empty(len(rank), dtype=np.int64)
    new_id[np.argsort(rank, kind="stable")] = np.arange(len(rank))       # as assemble orders them
    partner = np.concatenate([b["partner"] if "partner" in b else np.full(k, -1, dtype=np.int64)
                              for b, k in zip(ops, lengths)]) if ops else np.zeros(0, dtype=np.int64)
    final = np.full(len(rank), -1, dtype=np.int64)
    has = partner >= 0
    final[new_id[has]] = new_id[partner[has]]
    reps = np.flatnonzero(q.keep_rank)
    members = {}
    if any("orbit_s_q" in b for b in ops):        # every op's shape on each node's member, in the final order
        for f in SHAPE_FIELDS:
            own = getattr(sched.ops, f)
            table = np.repeat(own[:, None], q.orbit_size, axis=1)
            for b, start in zip(ops, np.r_[0, np.cumsum(lengths)[:-1]]):
                if "orbit_" + f in b:
                    table[new_id[start:start + len(b["rank"])]] = b["orbit_" + f]
            members["member_" + f] = table
    sched.quotient = Quotient(reps, final, q.orbit_size, q.node_rep, **members)
    return sched


def _compact(kept_ids: list[np.ndarray], total: int) -> np.ndarray:
    """[total] each global id's compact number (−1: not kept), in the order kept."""
    out = np.full(total, -1, dtype=np.int64)
    ids = np.concatenate(kept_ids) if kept_ids else np.zeros(0, dtype=np.int64)
    out[ids] = np.arange(len(ids))
    return out


def _mapped(new: np.ndarray, ids: np.ndarray) -> np.ndarray:
    """Global ids (−1 kept as −1) as compact numbers; NotSymmetric when one was not kept."""
    ids = np.asarray(ids, dtype=np.int64)
    out = np.where(ids >= 0, new[np.maximum(ids, 0)], -1)
    if ((ids >= 0) & (out < 0)).any():
        raise NotSymmetric("a kept op refers to one of another rank")
    return out


def _kept_pairs(t_new: np.ndarray, op_new: np.ndarray, t: np.ndarray, o: np.ndarray):
    """The (tensor, op) pairs of kept tensors, renumbered; NotSymmetric when the op of one was not kept."""
    t, o = np.asarray(t, dtype=np.int64), np.asarray(o, dtype=np.int64)
    keep = t_new[t] >= 0
    return t_new[t[keep]], _mapped(op_new, o[keep])
