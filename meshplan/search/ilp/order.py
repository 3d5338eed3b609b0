"""Writing a CP-SAT solution back into a schedule (:mod:`meshplan.search.ilp.model`): ops renumbered per rank by the
solver's start times, every op reference remapped, the hazard orders stream order used to give kept as deps."""

from __future__ import annotations

import numpy as np

from meshplan.plan.schedule import OpTable, Schedule, TensorTable


def apply_order(sched: Schedule, start_s: np.ndarray, orders: tuple[np.ndarray, np.ndarray] | None = None) -> Schedule:
    """A copy of ``sched`` whose stream orders follow ``start_s`` ([n_ops] seconds): ops renumbered per rank by
    (pass, start, original id), every op reference (deps, allocating ops, ``free_after``) remapped; ``orders``
    ((a, b) op pairs, :attr:`IlpResult.orders`) become deps of b where a and b are on different streams.
    Declared symmetries stay: the simulator checks each against the programs before it uses it."""
    o, t = sched.ops, sched.tensors
    if orders is not None and len(orders[0]):
        sched = _with_deps(sched, *orders)
        o = sched.ops
    perm = np.lexsort((np.arange(len(o)), start_s, o.phase, o.rank))      # new position -> old op id
    new_id = np.empty(len(o), dtype=np.int64)
    new_id[perm] = np.arange(len(o))
    fields = {}
    for name in OpTable.__dataclass_fields__:
        if name.endswith("_ptr"):
            continue
        fields[name] = getattr(o, name)
    csr = {"dep_ptr": "deps", "in_ptr": "inputs", "out_ptr": "outputs", "qc_ptr": "q_chunks", "kvc_ptr": "kv_chunks"}
    new = {}
    for name, value in fields.items():
        if name in csr.values():
            continue
        new[name] = value[perm]
    for ptr_name, values_name in csr.items():
        ptr, values = getattr(o, ptr_name), getattr(o, values_name)
        counts = np.diff(ptr)[perm]
        idx = np.repeat(ptr[:-1][perm] - np.cumsum(counts) + counts, counts) + np.arange(counts.sum())
        vals = values[idx]
        if values_name == "deps":
            vals = new_id[vals]
        new[ptr_name] = np.r_[0, np.cumsum(counts)].astype(ptr.dtype)
        new[values_name] = vals
    ops = OpTable(**new)
    tensors = TensorTable(**{name: getattr(t, name) for name in TensorTable.__dataclass_fields__})
    tensors.alloc_op = np.where(t.alloc_op >= 0, new_id[np.maximum(t.alloc_op, 0)], -1)
    tensors.free_after = new_id[t.free_after] if len(t.free_after) else t.free_after.copy()
    return Schedule(sched.algorithm, dict(sched.knobs), sched.workload, sched.n_ranks, sched.n_chunks,
                    sched.device_of_rank, sched.topology, sched.streams, ops, tensors, list(sched.symmetries))


def _with_deps(sched: Schedule, a: np.ndarray, b: np.ndarray) -> Schedule:
    """``sched`` with dep a → b added for every pair on different streams that is not a dep already."""
    o = sched.ops
    cross = o.stream[a] != o.stream[b]
    a, b = a[cross], b[cross]
    owner = np.repeat(np.arange(len(o)), np.diff(o.dep_ptr))
    have = set(zip(o.deps.tolist(), owner.tolist()))
    new = sorted({(int(x), int(y)) for x, y in zip(a.tolist(), b.tolist())} - have, key=lambda e: (e[1], e[0]))
    if not new:
        return sched
    add_a = np.asarray([x for x, _ in new], dtype=o.deps.dtype)
    add_b = np.asarray([y for _, y in new], dtype=np.int64)
    dep_owner = np.r_[owner, add_b]
    deps = np.r_[o.deps, add_a]
    order = np.lexsort((deps, dep_owner))
    fields = {name: getattr(o, name) for name in OpTable.__dataclass_fields__}
    fields["deps"] = deps[order]
    fields["dep_ptr"] = np.r_[0, np.cumsum(np.bincount(dep_owner, minlength=len(o)))].astype(o.dep_ptr.dtype)
    return Schedule(sched.algorithm, sched.knobs, sched.workload, sched.n_ranks, sched.n_chunks,
                    sched.device_of_rank, sched.topology, sched.streams, OpTable(**fields), sched.tensors,
                    list(sched.symmetries))


def orbit_pairs(sched: Schedule, rep_op: np.ndarray, a: np.ndarray, b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Op pairs of the representative ranks, repeated at the same positions on every rank they represent (so
    the deps they become keep the programs alike)."""
    o = sched.ops
    local = np.arange(len(o)) - sched.rank_ptr[o.rank]
    by_b: dict[int, list[int]] = {}
    for x, y in zip(a.tolist(), b.tolist()):
        by_b.setdefault(y, []).append(x)
    out_a, out_b = [], []
    for op in np.flatnonzero(np.isin(rep_op, b)).tolist():
        base = sched.rank_ptr[o.rank[op]]
        for x in by_b[int(rep_op[op])]:
            out_a.append(base + local[x])
            out_b.append(op)
    return np.asarray(out_a, dtype=np.int64), np.asarray(out_b, dtype=np.int64)
