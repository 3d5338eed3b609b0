"""Compute, merge and accumulate ops, read exactly as the schedule writes them.

A compute op's query tokens are the concatenation, in input order, of what its Q-side input tensors hold
(``q``: Q; ``out``: O and LSE; ``dout``: dO; ``qside``: Q, dO, LSE, D; ``dside``: dO, LSE, D); its keys
are the concatenation of its ``kv`` inputs. ``q_rows``/``kv_cols`` select token ranges of those
concatenations, the op's chunk ids give the tokens' global positions for the mask piece, and ``heads``
the query heads. Results go to the outputs in the same token order (forward: ``out`` tensors, merged or
written; backward: ``dq`` over the query tokens, ``dkv`` over the keys, accumulated in fp32 or written).
"""

from __future__ import annotations

import numpy as np
import torch

from meshplan.executor.kernels import (
    block_backward,
    block_backward_from_out,
    block_forward,
    cover,
    merge_into,
    row_delta,
)
from meshplan.executor.program import FP32_PARTS, KV_PARTS, PARTS, Program
from meshplan.executor.store import Store
from meshplan.model.blockmask import (
    Blocks,
    KeyRanges,
    block_pieces,
    by_block_budget,
    chunk_switches,
    prefer_by_block,
    rectangles,
    worth_blocks,
)

Q_SIDE = ("q", "out", "dout", "qside", "dside")


class OpRunner:
    """Runs one rank's compute-type ops on its :class:`Store`."""

    def __init__(self, prog: Program, store: Store, scale: float) -> None:
        self.prog, self.store, self.scale = prog, store, scale
        self.group = prog.workload.gqa_group
        self._layouts: dict[int, tuple] = {}          # op id -> how it runs (:meth:`_layout`), decided once

    # ------------------------------------------------------------------ views
    def _part(self, tid: int, part: str, h0: int, h1: int) -> torch.Tensor:
        """Part of tensor ``tid`` for query heads [h0, h1) (KV parts: their KV heads), as stored."""
        t = self.prog.tensors[tid]
        x = self.store.get(tid)[part]
        if part in KV_PARTS:
            a, b = h0 // self.group - t.heads[0] // self.group, -(-h1 // self.group) - t.heads[0] // self.group
        else:
            a, b = h0 - t.heads[0], h1 - t.heads[0]
        if a < 0 or b > (x.shape[1] if part in FP32_PARTS else x.shape[2]):
            raise ValueError(f"heads [{h0}, {h1}) are not in tensor {tid}'s heads {t.heads}")
        return x[:, a:b] if part in FP32_PARTS else x[:, :, a:b]

    def _gather(self, tids: list[int], part: str, h0: int, h1: int) -> torch.Tensor | None:
        """The concatenation over tokens of ``part`` from the tensors (in order) that hold it."""
        pieces = [self._part(t, part, h0, h1) for t in tids if part in PARTS[self.prog.tensors[t].kind]]
        if not pieces:
            return None
        return pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=2 if part in FP32_PARTS else 1)

    # ------------------------------------------------------------------ compute
    def compute(self, op) -> None:
        """One compute op (forward when its pass is fwd, else backward)."""
        p, (h0, h1) = self.prog, op.heads
        q_in = [t for t in op.inputs if p.tensors[t].kind in Q_SIDE]
        kv_in = [t for t in op.inputs if p.tensors[t].kind == "kv"]
        q_pos, k_pos = p.tokens_of("q", op.q_chunks), p.tokens_of("kv", op.kv_chunks)
        if op.id not in self._layouts:
            self._layouts[op.id] = self._layout(op, q_pos, k_pos)
        rows, cols, allowed, r_idx, c_idx, kv_map = self._layouts[op.id]

        def tokens(x: torch.Tensor, idx: torch.Tensor | None, n: int) -> torch.Tensor:   # [B, T, h, D] -> [B, h, t, D]
            if x.shape[1] != n:
                raise ValueError(f"op {op.id}: inputs hold {x.shape[1]} tokens, its chunks have {n}")
            return (x if idx is None else x.index_select(1, idx)).transpose(1, 2).contiguous()

        def expand(x: torch.Tensor) -> torch.Tensor:       # KV heads -> the op's query heads (GQA)
            return x if kv_map is None else x.index_select(1, kv_map)

        k = expand(tokens(self._gather(kv_in, "k", h0, h1), c_idx, len(k_pos)))
        v = expand(tokens(self._gather(kv_in, "v", h0, h1), c_idx, len(k_pos)))
        if op.pass_ == "fwd":
            q = tokens(self._gather(q_in, "q", h0, h1), r_idx, len(q_pos))
            o, lse = block_forward(q, k, v, self.scale, allowed)
            self._emit(op, "out", {"o": o, "lse": lse}, rows, h0, h1)
            return
        q = tokens(self._gather(q_in, "q", h0, h1), r_idx, len(q_pos))
        do = self._gather(q_in, "do", h0, h1)
        lse = self._gather(q_in, "lse", h0, h1)
        lse = lse if r_idx is None else lse.index_select(2, r_idx)
        o = self._gather(q_in, "o", h0, h1)
        if o is not None and o.shape[1] == len(q_pos):      # O for every row: the flash backward can run
            dq, dk, dv = block_backward_from_out(q, k, v, tokens(o, r_idx, len(q_pos)), tokens(do, r_idx, len(q_pos)),
                                                 lse, self.scale, allowed)
        else:
            delta = self._delta(q_in, do, h0, h1)
            delta = delta if r_idx is None else delta.index_select(2, r_idx)
            dq, dk, dv = block_backward(q, k, v, tokens(do, r_idx, len(q_pos)), lse, delta, self.scale, allowed)
        self._emit(op, "dq", {"dq": dq}, rows, h0, h1)
        n_kv = -(-h1 // self.group) - h0 // self.group
        dk_kv = dk if kv_map is None else _reduce_heads(dk, kv_map, n_kv)
        dv_kv = dv if kv_map is None else _reduce_heads(dv, kv_map, n_kv)
        self._emit(op, "dkv", {"dk": dk_kv, "dv": dv_kv}, cols, h0, h1)

    def _layout(self, op, q_pos: np.ndarray, k_pos: np.ndarray) -> tuple:
        """How op ``op`` runs, decided once per op (every step runs it alike): (rows, cols, mask, row index, key
        index, KV head map). Tokens in position order: every mask then permits one run of keys per row (KeyRanges,
        no [Sq, Skv] matrix), covered by full, causal and reversed kernels (zigzag diagonals, striped blocks,
        Ulysses over a permuted sequence, document segments, window strips); an op over interleaved chunks block
        by block where that cover costs less (:func:`~meshplan.model.blockmask.prefer_by_block`). Results go back
        to their tokens through ``rows``/``cols``."""
        p, (h0, h1) = self.prog, op.heads
        rows, cols = _select(op.q_rows, len(q_pos)), _select(op.kv_cols, len(k_pos))
        rows, cols = rows[np.argsort(q_pos[rows], kind="stable")], cols[np.argsort(k_pos[cols], kind="stable")]
        mask = p.mask_of(op)
        allowed = None if mask is None else KeyRanges(*mask.key_ranges(q_pos[rows], k_pos[cols]), len(cols))
        if len(op.q_chunks) * len(op.kv_chunks) > 1 and allowed is not None:
            in_order = cover(allowed, len(rows), len(cols))
            switches = chunk_switches(_owners(p, "q", op.q_chunks, rows), _owners(p, "kv", op.kv_chunks, cols))
            if worth_blocks(in_order, len(op.q_chunks) * len(op.kv_chunks), switches):  # by block, if cheaper
                by_rows, by_cols, blocks = _by_chunk(mask, p, op, q_pos, k_pos, rows, cols)
                if prefer_by_block(in_order, block_pieces(blocks, by_block_budget(in_order))):
                    rows, cols, allowed = by_rows, by_cols, blocks
        dev = self.store.device
        r_idx, c_idx = _index(rows, len(q_pos), dev), _index(cols, len(k_pos), dev)
        kv_map = [h // self.group - h0 // self.group for h in range(h0, h1)]
        kv_map = None if kv_map == list(range(len(kv_map))) else torch.tensor(kv_map, device=dev)
        return rows, cols, allowed, r_idx, c_idx, kv_map

    def _delta(self, q_in: list[int], do: torch.Tensor, h0: int, h1: int) -> torch.Tensor:
        """D [B, h, T] per Q-side group: carried by qside/dside, else rowsum(dO ∘ O) from an ``out`` input."""
        pieces, at = [], 0
        for t in q_in:
            kind = self.prog.tensors[t].kind
            if kind not in ("out", "qside", "dside"):
                continue
            if kind == "out":
                o = self._part(t, "o", h0, h1)
                pieces.append(row_delta(o.transpose(1, 2), do[:, at:at + o.shape[1]].transpose(1, 2)))
            else:
                pieces.append(self._part(t, "delta", h0, h1).float())
            at += pieces[-1].shape[2]
        return torch.cat(pieces, dim=2)

    def _emit(self, op, kind: str, result: dict[str, torch.Tensor], sel: np.ndarray, h0: int, h1: int) -> None:
        """Combine a result ([B, h, t, D] / [B, h, t]) into the op's outputs of ``kind``, which hold, in order,
        the op's query tokens (out, dq) or key tokens (dkv); ``sel`` are the result's token indices."""
        at = 0
        for tid in (t for t in op.outputs if self.prog.tensors[t].kind == kind):
            n = self.prog.layout(tid).tokens
            keep = (sel >= at) & (sel < at + n)
            if keep.any():
                local = torch.from_numpy(sel[keep] - at).to(self.store.device)
                pick = torch.from_numpy(np.flatnonzero(keep)).to(self.store.device)
                views = {part: self._part(tid, part, h0, h1) for part in result}
                combine(op.combine, views, {p: r.index_select(2, pick) for p, r in result.items()}, local)
            at += n

    # ------------------------------------------------------------------ merge / accumulate
    def fold(self, op) -> None:
        """A merge (LSE merge of (O, LSE)) or accumulate (fp32 add) of ``inputs[0]`` into each output, every
        output taking the input's tokens of its own chunks (one output over the input's chunks: all of it)."""
        src = op.inputs[0]
        h0, h1 = self.prog.tensors[src].heads
        for dst in op.outputs:
            lo, hi = self._token_range(src, dst)
            kind = self.prog.tensors[dst].kind
            if op.kind == "merge":
                o = self._part(dst, "o", h0, h1)
                merge_into(o.transpose(1, 2), self._part(dst, "lse", h0, h1),
                           self._part(src, "o", h0, h1)[:, lo:hi].transpose(1, 2),
                           self._part(src, "lse", h0, h1)[:, :, lo:hi])
                continue
            for part in PARTS[kind]:
                x = self._part(src, part, h0, h1)
                self._part(dst, part, h0, h1).add_((x[:, :, lo:hi] if part in FP32_PARTS else x[:, lo:hi]).float())

    def _token_range(self, src: int, dst: int) -> tuple[int, int]:
        """[lo, hi): the tokens of ``src`` that belong to ``dst``'s chunks (a contiguous run of src's chunks)."""
        s, d = self.prog.tensors[src], self.prog.tensors[dst]
        if list(s.chunks) == list(d.chunks):
            return 0, self.prog.layout(src).tokens
        at = next(i for i in range(len(s.chunks)) if list(s.chunks[i:i + len(d.chunks)]) == list(d.chunks))
        lo = len(self.prog.tokens_of(s.kind, s.chunks[:at]))
        return lo, lo + len(self.prog.tokens_of(s.kind, d.chunks))

def _by_chunk(mask, prog, op, q_pos: np.ndarray, k_pos: np.ndarray, rows: np.ndarray,
              cols: np.ndarray) -> tuple[np.ndarray, np.ndarray, Blocks]:
    """The op's rows and keys ordered chunk by chunk (each in position order) and its mask as one
    :class:`~meshplan.model.blockmask.Blocks` rectangle per (query chunk, KV chunk) with permitted pairs.
    ``q_pos``/``k_pos``: the positions of the op's query and key tokens in their concatenation order."""
    def grouped(kind: str, chunks, sel: np.ndarray):
        owner = _owners(prog, kind, chunks, sel)                     # sel is in position order already
        order = np.argsort(owner, kind="stable")
        bounds = np.searchsorted(owner[order], np.arange(len(chunks) + 1))
        return sel[order], bounds

    rows, rb = grouped("q", op.q_chunks, rows)
    cols, cb = grouped("kv", op.kv_chunks, cols)
    parts = rectangles(mask, [q_pos[rows[a:b]] for a, b in zip(rb[:-1], rb[1:])],
                       [k_pos[cols[a:b]] for a, b in zip(cb[:-1], cb[1:])])
    return rows, cols, Blocks(tuple(parts), len(rows), len(cols))


def _owners(prog, kind: str, chunks, sel: np.ndarray) -> np.ndarray:
    """The chunk (its index in ``chunks``) of each selected token (``sel``: indices into the chunks' tokens)."""
    sizes = np.cumsum([len(prog.tokens_of(kind, [c])) for c in chunks])
    return np.searchsorted(sizes, sel, side="right")


def _index(sel: np.ndarray, n: int, device) -> torch.Tensor | None:
    """``sel`` as an index tensor, or None when it takes all n tokens in order (no gather needed)."""
    if len(sel) == n and (n == 0 or (sel[0] == 0 and bool((np.diff(sel) == 1).all()))):
        return None
    return torch.from_numpy(sel).to(device)


def _select(ranges: list, n: int) -> np.ndarray:
    """Token indices of [start, end) ranges (an empty list: all n tokens)."""
    if not ranges:
        return np.arange(n)
    return np.concatenate([np.arange(a, b) for a, b in ranges])


def _reduce_heads(x: torch.Tensor, kv_map: torch.Tensor, n_kv: int) -> torch.Tensor:
    """[B, h, T, D] per query head -> [B, n_kv, T, D]: each KV head's query heads summed."""
    out = torch.zeros(x.shape[0], n_kv, *x.shape[2:], dtype=x.dtype, device=x.device)
    return out.index_add_(1, kv_map, x)


def combine(how: str, views: dict[str, torch.Tensor], result: dict[str, torch.Tensor], rows: torch.Tensor) -> None:
    """Write/merge/accumulate ``result`` (kernel layout) into the stored ``views`` at token ``rows``."""
    if how == "merge":
        o_view, lse_view = views["o"], views["lse"]
        o_acc = o_view.index_select(1, rows).transpose(1, 2).float()
        lse_acc = lse_view.index_select(2, rows).float()
        merge_into(o_acc, lse_acc, result["o"], result["lse"])
        o_view.index_copy_(1, rows, o_acc.transpose(1, 2).to(o_view.dtype))
        lse_view.index_copy_(2, rows, lse_acc)
        return
    for part, r in result.items():
        view = views[part]
        r = r if part in FP32_PARTS else r.transpose(1, 2)
        axis = 2 if part in FP32_PARTS else 1
        if how == "accumulate":
            view.index_add_(axis, rows, r.to(view.dtype))
        else:
            view.index_copy_(axis, rows, r.to(view.dtype))

