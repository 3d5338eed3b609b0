"""A rank's local chunk as the drop-in :func:`~meshplan.executor.autograd.attention` sees it, and the helpers
that cut a whole sequence into the ranks' chunks and put it back.

Rank r's **local chunk** is the concatenation, in chunk-id order, of the chunks whose Q its forward pass
starts from (the schedule's ``q`` input tensors of rank r, ``chunks[*].segments`` giving each chunk's token
positions — what ``meshplan run`` fills them from). With a zigzag layout on N ranks, rank r's tokens are
the pieces r and 2N−1−r of the sequence; contiguous, the r-th slice; c = S / N when each rank starts from
one of N equal chunks (Ring, pass-Q, Mesh, CHARM+). The token axis is ``dim`` (1 for the executor's
[B, S, H, D]).

The schedule can be a :class:`~meshplan.executor.program.Program`, a :class:`~meshplan.plan.schedule.Schedule`
or the path of a schedule file; :func:`as_program` converts (cached, so a training loop reads the file once).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from meshplan.core.errors import UserError
from meshplan.executor.program import Program, load_program, program_of

_PROGRAMS: dict[object, tuple[object, Program]] = {}      # key -> (the object it came from, its Program)
_LOCALS: dict[tuple[int, int], tuple[Program, Chunk]] = {}


@dataclass(frozen=True)
class Chunk:
    """Rank ``rank``'s local tokens: ``positions`` [c] (global token positions in local order), and where each
    of its chunks starts in that order."""

    rank: int
    positions: np.ndarray
    offset: dict[int, int]
    sizes: dict[int, int]

    def index(self, chunks) -> np.ndarray:
        """Local token indices of these chunks' tokens, concatenated in the given order."""
        return np.concatenate([np.arange(self.offset[c], self.offset[c] + self.sizes[c]) for c in chunks])


def as_program(schedule) -> Program:
    """The Program of a Program, a Schedule or a schedule file (.json / .json.gz), loaded and verified once.

    Raises:
        UserError: an unreadable or invalid schedule (see :func:`~meshplan.executor.program.load_program`).
    """
    if isinstance(schedule, Program):
        return schedule
    if isinstance(schedule, (str, Path)):
        path = Path(schedule).resolve()
        key = (str(path), path.stat().st_mtime_ns if path.exists() else 0)
        make = lambda: load_program(path)  # noqa: E731
    else:
        key = id(schedule)
        make = lambda: program_of(schedule)  # noqa: E731
    hit = _PROGRAMS.get(key)
    if hit is None or (not isinstance(schedule, (str, Path)) and hit[0] is not schedule):
        hit = _PROGRAMS[key] = (schedule, make())
    return hit[1]


def local_chunk(prog: Program, rank: int) -> Chunk:
    """Rank ``rank``'s local chunk, after checking that the drop-in function can run the schedule there.

    Raises:
        UserError: a cached prefix (inference), the rank's Q and KV inputs on different tokens, Q inputs that
            do not cover every head of its chunks, or a pass that starts from tokens the rank does not hold
            (Ulysses' and USP's backward start from the forward's head-scattered tensors).
    """
    hit = _LOCALS.get((id(prog), rank))
    if hit is not None and hit[0] is prog:
        return hit[1]
    mine = [t for t in prog.doc.tensors if t.rank == rank and t.role == "input"]
    q = sorted({c for t in mine if t.pass_ == "fwd" and t.kind == "q" for c in t.chunks})
    kv = sorted({c for t in mine if t.pass_ == "fwd" and t.kind == "kv" for c in t.chunks})
    where = f"the {prog.doc.algorithm} schedule, rank {rank}"
    if prog.workload.prefix_len:
        raise UserError(where, "has a cached prefix (inference): its Q and K/V chunks hold different tokens, "
                        "which attention() does not take yet", "run it with meshplan run, or plan without --prefix-len")
    if q != kv:
        raise UserError(where, f"starts from Q of chunks {q} but K/V of chunks {kv}",
                        "the drop-in attention needs each rank's Q and K/V on the same tokens")
    heads = {c: np.zeros(prog.workload.n_heads, dtype=bool) for c in q}
    for t in (t for t in mine if t.pass_ == "fwd" and t.kind == "q"):
        for c in t.chunks:
            heads[c][t.heads[0]:t.heads[1]] = True
    if not all(h.all() for h in heads.values()):
        raise UserError(where, "starts from only some heads of its chunks",
                        "the drop-in attention needs every head of a rank's tokens on that rank")
    for t in mine:
        if not set(t.chunks) <= set(q):
            raise UserError(where, f"starts its {t.pass_} pass from chunks {t.chunks} (tensor {t.id}, {t.kind}) "
                            f"that it does not hold (it holds {q})",
                            "plan with an algorithm whose passes start from each rank's own chunks (not Ulysses, USP)")
    sizes = {c: len(prog.positions[c]) for c in q}
    offset = dict(zip(q, np.cumsum([0] + [sizes[c] for c in q])[:-1].tolist()))
    pos = np.concatenate([prog.positions[c] for c in q]) if q else np.zeros(0, dtype=np.int64)
    chunk = Chunk(rank, pos, offset, sizes)
    _LOCALS[(id(prog), rank)] = (prog, chunk)
    return chunk


def shard(x: torch.Tensor, schedule, rank: int, dim: int = 1) -> torch.Tensor:
    """Rank ``rank``'s local chunk of ``x``, a whole sequence in natural token order along ``dim``
    (``q`` [B, S, H, D] -> [B, c, H, D]; ``torch.arange(S)`` with ``dim=0`` gives the chunk's positions).

    Raises:
        UserError: ``x`` does not have the schedule's S tokens along ``dim``.
    """
    prog = as_program(schedule)
    if x.shape[dim] != prog.workload.seq_len:
        raise UserError("x", f"has {x.shape[dim]} tokens along dim {dim}, the schedule has S = "
                        f"{prog.workload.seq_len}", "pass the whole sequence in natural token order")
    pos = local_chunk(prog, rank).positions
    return x.index_select(dim, torch.from_numpy(pos).to(x.device))


def unshard(pieces: list[torch.Tensor], schedule, dim: int = 1) -> torch.Tensor:
    """The whole sequence in natural order from every rank's local chunk (``pieces[r]`` from rank r; the
    inverse of :func:`shard`).

    Raises:
        UserError: not one piece per rank, a piece of the wrong length, or chunks that do not tile the sequence.
    """
    prog = as_program(schedule)
    if len(pieces) != prog.n_ranks:
        raise UserError("pieces", f"{len(pieces)} pieces for a schedule of {prog.n_ranks} ranks",
                        "pass one local chunk per rank, in rank order")
    pos = [local_chunk(prog, r).positions for r in range(prog.n_ranks)]
    for r, (p, x) in enumerate(zip(pos, pieces)):
        if x.shape[dim] != len(p):
            raise UserError(f"pieces[{r}]", f"has {x.shape[dim]} tokens along dim {dim}, rank {r} holds {len(p)}",
                            "pass each rank's local chunk as attention() takes it")
    order = np.concatenate(pos)
    if not np.array_equal(np.sort(order), np.arange(prog.workload.seq_len)):
        raise UserError("schedule", "the ranks' local chunks do not tile the sequence", "regenerate the schedule")
    whole = torch.cat(pieces, dim=dim)
    inverse = torch.from_numpy(np.argsort(order)).to(whole.device)
    return whole.index_select(dim, inverse)
