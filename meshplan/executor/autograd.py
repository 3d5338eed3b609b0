"""The drop-in attention function: a schedule's forward and backward passes inside a model's autograd graph.

``out = attention(q, k, v, schedule, group)`` runs the schedule's ``fwd`` pass on this rank with the
executor's own machinery (:class:`~meshplan.executor.runner.PassRunner`: a thread per stream, a process group
per communicator, the ops as written) and returns this rank's output chunk; backward runs the ``bwd`` pass
from dO, the saved output and its LSE and returns dQ, dK, dV of the local chunks — the same numbers as
``meshplan run`` on the same inputs (the final O rounded to the input dtype, LSE fp32, D = rowsum(dO ∘ O),
gradients returned in the input dtype). The model is zhuzilin/ring-flash-attention's
``RingFlashAttnFunc`` (forward saves O and LSE, backward replays the ring), with the algorithm read from
the file instead of written in code.

Shapes (the executor's token-major layout, :mod:`~meshplan.executor.store`): q, out, dq [B, c, H, D];
k, v, dk, dv [B, c, Hkv, D], c the local chunk's tokens (:mod:`~meshplan.executor.local`: cut the sequence
with :func:`~meshplan.executor.local.shard`), B, H, Hkv, D and the dtype the schedule's workload's. The
group's rank r is the schedule's rank r; every rank of the group must call forward and backward in the
same order (both passes communicate), and each wait is bounded by ``timeout_s``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.autograd.function import once_differentiable

from meshplan.core.errors import UserError
from meshplan.executor.kernels import TORCH_DTYPE, row_delta
from meshplan.executor.local import Chunk, as_program, local_chunk
from meshplan.executor.program import FP32_PARTS, KV_PARTS, Program
from meshplan.executor.runner import PassRunner, connect
from meshplan.executor.store import Store

_POOLS: dict[object, list] = {}     # user group -> its communicators, created once, shared by every schedule


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, schedule, group=None, *,
              timeout_s: float = 120.0) -> torch.Tensor:
    """Attention of this rank's query chunk against the whole sequence's keys, distributed as ``schedule`` says.

    Args:
        q: [B, c, H, D] this rank's queries (the schedule's dtype: bf16, fp16 or fp32).
        k, v: [B, c, Hkv, D] this rank's keys and values.
        schedule: a :class:`~meshplan.executor.program.Program`, a :class:`~meshplan.plan.schedule.Schedule` or a
            schedule file; planned with ``--pass fwd+bwd`` to train (loaded and verified once, then cached).
        group: the torch.distributed process group (default: the world) of the schedule's size.
        timeout_s: the longest any op waits for its dependencies or a transfer (s).

    Returns:
        [B, c, H, D] this rank's output, in the input dtype (padded query rows 0).

    Raises:
        UserError: a shape, dtype or device that does not match the schedule, a group of another size, a
            schedule without a fwd pass (or without a bwd pass when a gradient is needed), or one whose passes
            do not start from each rank's own chunk.
        RunError: a transfer or dependency not done within ``timeout_s`` (names rank, op and peer).
    """
    prog = as_program(schedule)
    group = group if group is not None else dist.group.WORLD
    _check(q, k, v, prog, group, torch.is_grad_enabled() and any(x.requires_grad for x in (q, k, v)))
    return _Attention.apply(q, k, v, prog, group, timeout_s)


class _Attention(torch.autograd.Function):
    """Forward: the fwd pass, saving (q, k, v, O, LSE). Backward: the bwd pass from dO."""

    @staticmethod
    def forward(ctx, q, k, v, prog: Program, group, timeout_s: float):
        rank = dist.get_rank(group)
        chunk = local_chunk(prog, rank)
        values = {"q": q.detach(), "k": k.detach(), "v": v.detach()}
        store = _run(prog, rank, "fwd", chunk, values, group, timeout_s)
        w = prog.workload
        out, lse = _collect(prog, chunk, store, "fwd", {
            "o": ((w.batch, len(chunk.positions), w.n_heads, w.head_dim), q.dtype),
            "lse": ((w.batch, w.n_heads, len(chunk.positions)), torch.float32)}, q.device)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.prog, ctx.group, ctx.timeout_s = prog, group, timeout_s
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        prog, group = ctx.prog, ctx.group
        rank = dist.get_rank(group)
        chunk = local_chunk(prog, rank)
        do = dout.to(q.dtype).contiguous()
        values = {"q": q.detach(), "k": k.detach(), "v": v.detach(), "o": out, "lse": lse, "do": do,
                  "delta": row_delta(out.transpose(1, 2), do.transpose(1, 2))}
        store = _run(prog, rank, "bwd", chunk, values, group, ctx.timeout_s)
        dq, dk, dv = _collect(prog, chunk, store, "bwd", {"dq": (tuple(q.shape), q.dtype),
                              "dk": (tuple(k.shape), k.dtype), "dv": (tuple(v.shape), v.dtype)}, q.device)
        return dq, dk, dv, None, None, None


def _check(q, k, v, prog: Program, group, needs_grad: bool) -> None:
    """One-line errors for everything the schedule fixes, before any communication."""
    if not dist.is_initialized():
        raise UserError("group", "torch.distributed is not initialized",
                        "call torch.distributed.init_process_group first (gloo on CPU, nccl on GPUs)")
    size, name = dist.get_world_size(group), prog.doc.algorithm
    if size != prog.n_ranks:
        raise UserError("group", f"has {size} ranks but the {name} schedule has {prog.n_ranks}",
                        f"pass a group of {prog.n_ranks} ranks or plan the schedule for {size}")
    if dist.get_rank(group) < 0:
        raise UserError("group", f"this process (rank {dist.get_rank()}) is not a member of the group",
                        "call attention only on the group's ranks")
    if "fwd" not in prog.passes:
        raise UserError("schedule", f"the {name} schedule has no fwd pass", "plan it with --pass fwd+bwd")
    if needs_grad and "bwd" not in prog.passes:
        raise UserError("schedule", f"the {name} schedule has no bwd pass, so it cannot train",
                        "plan it with --pass fwd+bwd (or call attention under torch.no_grad())")
    w = prog.workload
    c = len(local_chunk(prog, dist.get_rank(group)).positions)
    want = {"q": (w.batch, c, w.n_heads, w.head_dim), "k": (w.batch, c, w.n_kv_heads, w.head_dim),
            "v": (w.batch, c, w.n_kv_heads, w.head_dim)}
    for label, x in (("q", q), ("k", k), ("v", v)):
        if tuple(x.shape) != want[label]:
            raise UserError(label, f"has shape {tuple(x.shape)}, the schedule's rank needs {want[label]} "
                            "[B, c, H or Hkv, D]", "cut the sequence with meshplan.executor.shard")
        if x.dtype != TORCH_DTYPE[w.dtype]:
            raise UserError(label, f"is {x.dtype}, the schedule's workload is {w.dtype}",
                            f"cast to {TORCH_DTYPE[w.dtype]} or plan with --dtype {_FLAG_DTYPE.get(x.dtype, x.dtype)}")
        if x.device != q.device:
            raise UserError(label, f"is on {x.device}, q on {q.device}", "put q, k and v on one device")


_FLAG_DTYPE = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}


def communicators(prog: Program, group) -> dict[int, object]:
    """Communicator id -> process group: one group per comm stream of the schedule over ``group``'s ranks,
    created on first use and kept (every member must make the same first calls in the same order)."""
    comms = sorted({s.communicator for s in prog.doc.streams if s.kind == "comm"})
    pool = _POOLS.setdefault(group, [])
    if len(pool) < len(comms):
        ranks, backend = dist.get_process_group_ranks(group), dist.get_backend(group)
        local = len(ranks) < dist.get_world_size()       # a subgroup: only its members take part in creating it
        fresh = [dist.new_group(ranks, backend=backend, use_local_synchronization=local)
                 for _ in range(len(comms) - len(pool))]
        connect(fresh, _device(group))
        pool.extend(fresh)
    return dict(zip(comms, pool))


def _device(group) -> torch.device:
    """This rank's device for the group's backend: the current CUDA device under NCCL, else the CPU."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _run(prog: Program, rank: int, pass_: str, chunk: Chunk, values: dict[str, torch.Tensor], group,
         timeout_s: float) -> Store:
    """One pass on this rank; the tensors alive at its start filled from ``values`` (local chunk layout)."""
    store = Store(next(iter(values.values())).device)

    def init(tid: int) -> None:
        t = prog.tensors[tid]
        layout = prog.layout(tid)
        parts = store.alloc(tid, layout, t.dtype)
        if t.role != "input":
            return
        idx = torch.from_numpy(chunk.index(t.chunks)).to(store.device)
        for part, x in parts.items():
            h0, h1 = layout.kv_heads if part in KV_PARTS else t.heads
            src = values[part]
            x.copy_(src[:, h0:h1].index_select(2, idx) if part in FP32_PARTS else src[:, :, h0:h1].index_select(1, idx))

    runner = PassRunner(prog, rank, pass_, store, communicators(prog, group), init, timeout_s, serialize=False)
    runner.prepare()
    if store.device.type == "cuda":       # the inputs' copies (this stream) before the streams' threads read them
        torch.cuda.current_stream(store.device).synchronize()
    runner.run()
    return store


def _collect(prog: Program, chunk: Chunk, store: Store, pass_: str, want: dict[str, tuple], device) -> list:
    """The pass's output parts in the local chunk layout, each (token, head) written exactly once.

    Raises:
        ValueError: the schedule's outputs on this rank cover a (token, head) twice or not at all.
    """
    res = {p: torch.zeros(shape, dtype=dt, device=device) for p, (shape, dt) in want.items()}
    seen = {p: torch.zeros(len(chunk.positions), shape[1 if p in FP32_PARTS else 2], dtype=torch.int32)
            for p, (shape, _) in want.items()}
    for t in prog.doc.tensors:
        if t.rank != chunk.rank or t.pass_ != pass_ or t.role != "output":
            continue
        parts, layout = store.get(t.id), prog.layout(t.id)
        idx = torch.from_numpy(chunk.index(t.chunks))
        for part in set(parts) & set(want):
            h0, h1 = layout.kv_heads if part in KV_PARTS else t.heads
            x = parts[part].to(res[part].dtype)
            if part in FP32_PARTS:
                res[part][:, h0:h1].index_copy_(2, idx.to(device), x)
            else:
                res[part][:, :, h0:h1].index_copy_(1, idx.to(device), x)
            seen[part][idx, h0:h1] += 1
    for part, count in seen.items():
        if (count != 1).any():
            i, h = (count != 1).nonzero()[0].tolist()
            raise ValueError(f"the {prog.doc.algorithm} schedule's {pass_} outputs on rank {chunk.rank} cover "
                             f"{part} of local token {i}, head {h} {int(count[i, h])} times (once expected)")
    return [res[p] for p in want]
