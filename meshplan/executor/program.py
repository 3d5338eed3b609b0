"""A schedule file as the executor runs it: validated, verified and indexed per rank and pass (torch-free).

Everything the executor does comes from the file: chunk token positions (``chunks[*].segments``), each
compute op's inputs, outputs, rows, columns, mask piece and heads, every transfer's peer, tensor, dtype
and step, and the tensors' lifetimes. Nothing is recomputed from the algorithm, so a file that the
verifier accepts but whose arithmetic is wrong (a mask piece relabelled, an op reading another chunk's
tensor) runs as written and fails the numerics check.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from meshplan.core.errors import UserError
from meshplan.core.units import DTYPE_BYTES
from meshplan.model.workload import Mask, Workload
from meshplan.plan.json.format import ScheduleJSON

PARTS = {
    "q": ("q",), "kv": ("k", "v"), "out": ("o", "lse"), "dout": ("do",),
    "qside": ("q", "do", "lse", "delta"), "dside": ("do", "lse", "delta"), "dq": ("dq",), "dkv": ("dk", "dv"),
}
FP32_PARTS = ("lse", "delta")
KV_PARTS = ("k", "v", "dk", "dv")


@dataclass(frozen=True)
class Layout:
    """Shapes of one tensor's parts: ``tokens`` tokens, query heads [h0, h1) (KV parts: their KV heads)."""

    kind: str
    tokens: int
    h0: int
    h1: int
    batch: int
    head_dim: int
    group: int

    @property
    def kv_heads(self) -> tuple[int, int]:
        """[kv_h0, kv_h1): the KV heads the query heads [h0, h1) read."""
        return self.h0 // self.group, -(-self.h1 // self.group)

    def shape(self, part: str) -> tuple[int, ...]:
        """[B, T, heads, D] for value parts, [B, heads, T] for LSE and D (fp32)."""
        k0, k1 = self.kv_heads
        heads = k1 - k0 if part in KV_PARTS else self.h1 - self.h0
        if part in FP32_PARTS:
            return (self.batch, heads, self.tokens)
        return (self.batch, self.tokens, heads, self.head_dim)

    def nbytes(self, dtype: str) -> int:
        """Bytes with value parts in ``dtype`` (the wire size of a send in that dtype)."""
        return sum(int(np.prod(self.shape(p))) * (4 if p in FP32_PARTS else DTYPE_BYTES[dtype])
                   for p in PARTS[self.kind])


@dataclass
class Program:
    """The validated document plus per-rank indices. Op and tensor ids are the file's."""

    doc: ScheduleJSON
    workload: Workload
    sha256: str
    positions: list[np.ndarray]
    schedule: object = None                 # the in-memory Schedule it was read from (for the memory check)
    ops: dict[int, object] = field(default_factory=dict)
    rank_of: dict[int, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        for r in self.doc.ranks:
            for op in r.ops:
                self.ops[op.id] = op
                self.rank_of[op.id] = r.rank
        self.tensors = {t.id: t for t in self.doc.tensors}
        prefix = self.workload.prefix_len
        self.q_positions = [p[p >= prefix] for p in self.positions]

    def tokens_of(self, kind: str, chunks) -> np.ndarray:
        """Global positions a tensor of ``kind`` over ``chunks`` holds, in its local order: every token of the
        chunks for KV kinds (kv, dkv), only their query tokens (outside a cached prefix) for the rest."""
        from meshplan.model.matrix import KV_KINDS
        table = self.positions if kind in KV_KINDS else self.q_positions
        parts = [table[c] for c in chunks]
        return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)

    @property
    def n_ranks(self) -> int:
        """World size the schedule needs."""
        return self.doc.n_ranks

    @property
    def passes(self) -> list[str]:
        """The passes present, in order."""
        present = {op.pass_ for op in self.ops.values()}
        return [p for p in ("fwd", "bwd") if p in present]

    def layout(self, tid: int) -> Layout:
        """The part shapes of tensor ``tid``."""
        t, w = self.tensors[tid], self.workload
        tokens = len(self.tokens_of(t.kind, t.chunks))
        return Layout(t.kind, tokens, t.heads[0], t.heads[1], w.batch, w.head_dim, w.gqa_group)

    def ops_of(self, rank: int, pass_: str) -> list:
        """The rank's ops of one pass in program order."""
        return [op for op in self.doc.ranks[rank].ops if op.pass_ == pass_]

    def units(self, rank: int, pass_: str) -> dict[str, list[list]]:
        """Per stream, its ops in order grouped into units: a batch (consecutive send/recv of one step) or one op."""
        out: dict[str, list[list]] = {}
        for op in self.ops_of(rank, pass_):
            seq = out.setdefault(op.stream, [])
            prev = seq[-1][-1] if seq else None
            if (op.kind in ("send", "recv") and prev is not None and prev.kind in ("send", "recv")
                    and op.step is not None and op.step >= 0 and prev.step == op.step):
                seq[-1].append(op)
            else:
                seq.append([op])
        return out

    def ordered_units(self, rank: int, pass_: str) -> list[list]:
        """The rank's units in the order of their first op in its program (the ``--serialize`` order)."""
        by_first = {u[0].id: u for units in self.units(rank, pass_).values() for u in units}
        return [by_first[op.id] for op in self.ops_of(rank, pass_) if op.id in by_first]

    def lifetimes(self, rank: int, pass_: str) -> tuple[list[int], dict[int, list[int]], dict[int, list[int]]]:
        """(tensors alive at pass start, op id -> tensors it allocates, op id -> tensors freed after it).

        A tensor is freed after the last of its ``free_after`` ops ends; ``frees`` maps that op to it only
        once all others have ended, which the runner tracks with counts (see :class:`Lifetimes`).
        """
        start, alloc, frees = [], {}, {}
        for t in self.doc.tensors:
            if t.rank != rank or t.pass_ != pass_:
                continue
            if t.alloc_op is None or t.alloc_op < 0:
                start.append(t.id)
            else:
                alloc.setdefault(t.alloc_op, []).append(t.id)
            for o in t.free_after:
                frees.setdefault(o, []).append(t.id)
        return start, alloc, frees

    def mask_of(self, op) -> Mask | None:
        """The op's elementwise rule (None for ``full``), with the workload's window and documents."""
        if op.mask == "full":
            return None
        m = self.workload.mask
        return Mask(op.mask, window=m.window, doc_lens=m.doc_lens, doc_pad=m.doc_pad)


def load_program(path: str | Path) -> Program:
    """Read, validate and verify a schedule file for execution.

    Raises:
        UserError: unreadable, another schema version, fails the verifier, or a transfer whose bytes do not
            match its tensor (all before any process starts).
    """
    from meshplan.plan.json.io import from_json, no_gc, read_document

    doc, raw = read_document(path)
    with no_gc():
        sched = from_json(doc)
    return _indexed(doc, raw, sched, Path(path).name)


def program_of(sched) -> Program:
    """The Program of an in-memory :class:`~meshplan.plan.schedule.Schedule`, as if written and loaded (same checks).

    Raises:
        UserError: the schedule fails the verifier or its sizes do not match its workload.
    """
    from meshplan.plan.json.io import no_gc, to_json_bytes

    raw = to_json_bytes(sched)
    with no_gc():
        doc = ScheduleJSON.model_validate_json(raw)
    return _indexed(doc, raw, sched, f"the {sched.algorithm} schedule")


def _indexed(doc: ScheduleJSON, raw: bytes, sched, name: str) -> Program:
    """Verify the schedule, then index the document (chunk positions from its segments) and check its sizes."""
    from meshplan.plan.verify import verify

    report = verify(sched)
    if not report.ok:
        raise UserError(name, f"the schedule is invalid: {report.violations[0]}",
                        "run `meshplan validate` on it and regenerate it")
    positions = [np.concatenate([s + st * np.arange(c) for s, st, c in ch.segments]) if ch.segments
                 else np.zeros(0, dtype=np.int64) for ch in sorted(doc.chunks, key=lambda c: c.id)]
    prog = Program(doc, sched.workload, hashlib.sha256(raw).hexdigest(), positions, sched)
    _check_sizes(prog)
    return prog


def _check_sizes(prog: Program) -> None:
    """Every tensor's bytes and every transfer's bytes agree with the workload's shapes."""
    for t in prog.doc.tensors:
        want = prog.layout(t.id).nbytes(t.dtype)
        if t.size_bytes != want:
            raise UserError(f"tensors[{t.id}].size_bytes", f"is {t.size_bytes}, the workload gives {want}",
                            "regenerate the schedule for this workload")
    for op in prog.ops.values():
        if op.kind in ("send", "recv"):
            want = sum(prog.layout(t).nbytes(op.dtype) for t in (op.parts if op.kind == "send" and op.parts
                                                                  else [op.tensor]))
            if op.size_bytes != want:
                raise UserError(f"op {op.id}.size_bytes", f"is {op.size_bytes}, its tensor in {op.dtype} is {want}",
                                "regenerate the schedule for this workload")


def check_world(prog: Program, world_size: int, n_devices: int | None, local_devices: list[int]) -> None:
    """Refuse a world size or device map that cannot run the schedule (before any communication).

    Args:
        world_size: processes in the job.
        n_devices: accelerators on this host (None on CPU: one process per rank is the device).
        local_devices: the device index each local rank will use (CUDA only).
    """
    if world_size != prog.n_ranks:
        raise UserError("--nproc", f"the world has {world_size} processes but the schedule has {prog.n_ranks} ranks",
                        f"run it with --nproc {prog.n_ranks} (or a torchrun job of {prog.n_ranks} processes)")
    devices = prog.doc.device_of_rank
    if max(devices) >= prog.doc.topology.devices or len(set(devices)) != len(devices):
        raise UserError("device_of_rank", f"names devices {sorted(set(devices))[:8]}... not all distinct devices of "
                        f"the {prog.doc.topology.devices}-device topology", "regenerate the schedule")
    if n_devices is not None:
        missing = [d for d in local_devices if d >= n_devices]
        if missing:
            raise UserError("device_of_rank", f"needs GPU {missing[0]} on this host, which has {n_devices}",
                            "run on a host with enough GPUs, or plan for fewer ranks per node")


def sequential_ok(prog: Program, pass_: str) -> bool:
    """Whether running every rank's ops one at a time in program order completes (``--serialize``).

    A rank posts the batch at the head of its program; the batch completes when every member's partner is
    posted (at the head of its rank). Repeats until every rank is done (True) or none can move (False).
    """
    heads = {r: 0 for r in range(prog.n_ranks)}
    seqs = {r: prog.ordered_units(r, pass_) for r in heads}
    partner = _partners(prog, pass_)
    while True:
        posted = {op.id for r, i in heads.items() if i < len(seqs[r]) for op in seqs[r][i]}
        moved = False
        for r in heads:
            i = heads[r]
            if i < len(seqs[r]) and all(op.kind not in ("send", "recv") or partner[op.id] in posted
                                        for op in seqs[r][i]):
                heads[r] += 1
                moved = True
        if all(heads[r] == len(seqs[r]) for r in heads):
            return True
        if not moved:
            return False


def _partners(prog: Program, pass_: str) -> dict[int, int]:
    """send/recv id -> matched op id, FIFO per (communicator, src, dst) (comm streams each have one)."""
    queues: dict[tuple, list[int]] = {}
    pending: dict[tuple, list[int]] = {}
    for r in range(prog.n_ranks):
        for op in prog.ops_of(r, pass_):
            if op.kind == "send":
                queues.setdefault((op.stream, r, op.peer), []).append(op.id)
            elif op.kind == "recv":
                pending.setdefault((op.stream, op.peer, r), []).append(op.id)
    out = {}
    for key, sends in queues.items():
        for s, rcv in zip(sends, pending.get(key, [])):
            out[s], out[rcv] = rcv, s
    return out
