"""The memory model: a rank's peak memory = its live buffers + the workspace of the ops running + the runtime's own.

The schedule's buffers (:func:`meshplan.plan.peaks.peak_memory`) are a lower bound: the kernels, merges and
transfers of an op take transient memory while they run (upcasts, kernel outputs before they are merged,
wire images), and a pass's runtime takes some of its own. The model adds, per op and for the time it runs
(``[start, end)`` of the execution):

* a compute op: ``fixed + q · (B·h·s_q·D) + kv · (B·h·s_kv·D)`` bytes, with the coefficients of its pass and
  the workload's dtype (``h``: the op's query heads; ``s_q``/``s_kv``: its kernel's rows and columns);
* a merge or accumulate op: ``merge · size_bytes``;
* a send or recv: ``transfer · size_bytes`` (the executor's wire image or receive buffer);

and per pass and rank ``runtime_bytes``. ``peak_memory_total_bytes`` of a prediction is ``overhead_factor`` x the
peak of that sum over the execution + ``runtime_bytes``; ``meshplan search --memory-limit`` filters on it.

Coefficients come from ``meshplan calibrate`` (``memory`` of the calibration file: each op of a few small
schedules run alone on this host, its memory rise measured — micro-level, never the end-to-end runs compared
against), except ``overhead_factor``: the allocator's fragmentation is not seen by one op alone, so it is fitted
on one declared run (:data:`DECLARED_RUN`, a small Mesh, run by the executor during calibration) and that run
is not among those the model is judged on.

The coefficients and the device defaults: :mod:`meshplan.model.memory_spec`; their fit:
:mod:`meshplan.truth.memory_fit`.
"""

from __future__ import annotations

import numpy as np

from meshplan.model.memory_spec import MemorySpec
from meshplan.plan.peaks import peak_memory
from meshplan.plan.schedule import COMPUTE, KIND, RECV, SEND, Schedule


def op_workspace_bytes(sched: Schedule, spec: MemorySpec, s_q: np.ndarray | None = None,
                       s_kv: np.ndarray | None = None) -> np.ndarray:
    """[n_ops] transient bytes each op holds while it runs (module docstring); ``s_q``, ``s_kv``: [n_ops] kernel
    shapes in place of the ops' own (a quotient schedule's orbit member's, :mod:`meshplan.plan.quotient`)."""
    o, w = sched.ops, sched.workload
    s_q = o.s_q if s_q is None else s_q
    s_kv = o.s_kv if s_kv is None else s_kv
    coef = spec.coefficients(w.dtype)
    ws = np.zeros(len(o))
    elems = w.batch * (o.h1 - o.h0).astype(np.float64) * w.head_dim
    for phase, (cq, ckv) in enumerate(((coef.fwd_q_bytes_per_elem, coef.fwd_kv_bytes_per_elem),
                                       (coef.bwd_q_bytes_per_elem, coef.bwd_kv_bytes_per_elem))):
        sel = (o.kind == COMPUTE) & (o.phase == phase) & (o.flops > 0)
        ws[sel] = coef.fixed_bytes + elems[sel] * (cq * s_q[sel] + ckv * s_kv[sel])
    side = (o.kind == KIND["merge"]) | (o.kind == KIND["accumulate"])
    ws[side] = spec.merge_bytes_per_byte * o.size_bytes[side]
    comm = (o.kind == SEND) | (o.kind == RECV)
    ws[comm] = spec.transfer_bytes_per_byte * o.size_bytes[comm]
    return ws


def model_peak_bytes(sched: Schedule, spec: MemorySpec, phase: int, start: np.ndarray, end: np.ndarray,
                     workspace: np.ndarray | None = None) -> float:
    """The memory model's peak of one pass along an execution (op start/end times), max over ranks:
    ``overhead_factor`` x (buffers + each op's workspace while it runs) + ``runtime_bytes``. ``workspace``:
    :func:`op_workspace_bytes` when the caller has it already."""
    ws = op_workspace_bytes(sched, spec) if workspace is None else workspace
    return model_total_bytes(spec, float(peak_memory(sched, phase, start, end, ws).max(initial=0.0)))


def model_total_bytes(spec: MemorySpec, peak_with_workspace: float) -> float:
    """The memory model's total from a pass's peak of buffers and op workspace (bytes, max over ranks):
    ``overhead_factor`` x that + ``runtime_bytes``."""
    return spec.overhead_factor * peak_with_workspace + spec.runtime_bytes


def kernel_workspace_bytes(spec: MemorySpec, dtype: str, pass_: str, batch: int, heads: int, head_dim: int,
                           s_q: float, s_kv: float) -> float:
    """The workspace of one compute op of kernel shape s_q × s_kv tokens over ``heads`` query heads."""
    c = spec.coefficients(dtype)
    cq, ckv = ((c.fwd_q_bytes_per_elem, c.fwd_kv_bytes_per_elem) if pass_ == "fwd"
               else (c.bwd_q_bytes_per_elem, c.bwd_kv_bytes_per_elem))
    return c.fixed_bytes + batch * heads * head_dim * (cq * s_q + ckv * s_kv)


def closed_form_peak_bytes(spec: MemorySpec, plan, pass_: str, buffers_bytes: float, wire_bytes: float,
                           op_chunks: int = 1) -> float:
    """The memory-model peak of a closed form (Ring, pass-Q and Mesh timings, which run one block per op): its
    buffer peak + the largest block's kernel workspace + the wire images of ``wire_bytes`` in flight + the
    runtime's. ``op_chunks``: ops span that many chunks a side at every head (StarTrail's C × C), so the
    workspace's token terms scale by it. An estimate: ``search`` checks simulated candidates on their simulated
    total, and the schedules it writes on their own."""
    w, m = plan.workload, plan.matrix
    c = spec.coefficients(w.dtype)
    cq, ckv = ((c.fwd_q_bytes_per_elem, c.fwd_kv_bytes_per_elem) if pass_ == "fwd"
               else (c.bwd_q_bytes_per_elem, c.bwd_kv_bytes_per_elem))
    # the workspace grows with the block's shape: the largest block's, from the largest cq·s_q + ckv·s_kv over the
    # permitted blocks, kept on the matrix (a search asks it for every Mesh plan of one matrix: N² each)
    cache = m.__dict__.setdefault("_largest_shape", {})
    if (cq, ckv) not in cache:
        ok = m.permitted
        cache[(cq, ckv)] = float(np.max(cq * m.s_q[ok] + ckv * m.s_kv[ok], initial=-1.0))
    largest = cache[(cq, ckv)]
    ws = c.fixed_bytes + w.batch * w.n_heads * w.head_dim * largest * op_chunks if largest >= 0 else 0.0
    peak = float(buffers_bytes) + float(ws) + spec.transfer_bytes_per_byte * wire_bytes
    return spec.overhead_factor * peak + spec.runtime_bytes


def estimated_peak_bytes(timing: dict) -> float:
    """A candidate's memory-model peak before it is simulated: the largest over passes of each closed form's
    ``peak_memory_total_bytes`` (its buffer peak where it has none)."""
    return max(t.peak_memory_bytes if t.peak_memory_total_bytes is None else t.peak_memory_total_bytes
               for t in timing.values())
