"""Attention on CUDA over a block's kernel cover: FlashAttention's varlen path, never a dense mask or score matrix.

The same cover the CPU path runs (:func:`cover`: full rectangles and causal squares, one or two per document
segment, three per W-row strip of a sliding window) becomes at most three varlen calls — the full pieces, the causal
squares, the reversed squares — with every (batch, piece) a sequence of the call (``cu_seqlens``), so any number of
documents costs one launch each way. A reversed square (a window's far edge) is a causal call over its rows and
keys packed in reverse order.
Pieces that share rows (a staircase's rectangle and square) are merged by LSE
(:func:`~meshplan.executor.lse.merge_into`) in forward and their gradients summed in backward. The backward is
the kernel's own, given the *final* O and LSE of the rows (ring-flash-attention's way: P = exp(S − LSE_final)
recomputed tile by tile), or, for the D-carrying backward, a surrogate O' with the same rowsum(dO ∘ O') = D
(:mod:`meshplan.executor.kernels`).

Kernels: half precision through torch's FlashAttention-2 varlen ops (``aten._flash_attention_forward`` /
``_flash_attention_backward``: q, k, v packed [total, H, D], LSE [H, total]); fp32, which those kernels do not
take, through the memory-efficient kernel one piece at a time (``aten._scaled_dot_product_efficient_attention``
and its backward). :data:`VARLEN` holds the two entry points so a test can run the packing on CPU against a
float64 reference.
"""

from __future__ import annotations

import numpy as np
import torch

from meshplan.executor.lse import merge_into
from meshplan.model.blockmask import Blocks, KeyRanges, Piece, kernel_cover, pieces

UNLIMITED = 1 << 62


def cuda_cover(mask, n_q: int, n_k: int) -> list[Piece]:
    """The mask's cover by full and causal pieces with no limit on their number (a varlen call takes any).
    Kept on a :class:`KeyRanges` or :class:`Blocks` mask (frozen: the executor decides an op's mask once and runs
    it every step), so the host builds each cover once — on a pack of a hundred documents it costs milliseconds,
    more than the kernels."""
    if isinstance(mask, (KeyRanges, Blocks)):
        memo = mask.__dict__.setdefault("_cuda_cover", {})
        if (n_q, n_k) not in memo:
            memo[(n_q, n_k)] = _cuda_cover(mask, n_q, n_k)
        return memo[(n_q, n_k)]
    return _cuda_cover(mask, n_q, n_k)


def _cuda_cover(mask, n_q: int, n_k: int) -> list[Piece]:
    if mask is None:
        return [Piece(0, n_q, 0, n_k, False)]
    if isinstance(mask, torch.Tensor):
        ranges = KeyRanges.from_allowed(mask)
        if ranges is None:
            raise ValueError("a CUDA block's mask must permit one run of keys per row")
        mask = ranges
    if isinstance(mask, Blocks):
        out = []
        for r0, _, c0, _, ranges in mask.parts:
            out += [p.shifted(r0, c0) for p in pieces(ranges, budget=UNLIMITED)]
        return out
    return kernel_cover(mask) or pieces(mask, budget=UNLIMITED)


def _index(group: list[Piece], rows: bool, batch: int, device) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(token index [T] of the group's rows (or keys) in order, a reversed square's backwards; cu_seqlens int32
    over ``batch`` copies; the longest piece), built on the host and copied once: a launch per piece would cost
    more than the kernel on a pack of hundreds of short documents."""
    a = np.array([p.r0 if rows else p.c0 for p in group], dtype=np.int64)
    b = np.array([p.r1 if rows else p.c1 for p in group], dtype=np.int64)
    anti = np.array([p.anti for p in group], dtype=bool)
    n = b - a
    local = np.arange(n.sum()) - np.repeat(np.cumsum(n) - n, n)
    idx = np.repeat(np.where(anti, b - 1, a), n) + np.repeat(np.where(anti, -1, 1), n) * local
    cu = np.concatenate([[0], np.cumsum(np.tile(n, batch))]).astype(np.int32)
    return (torch.from_numpy(idx).to(device, non_blocking=True), torch.from_numpy(cu).to(device, non_blocking=True),
            int(n.max()))


def _pack(x: torch.Tensor, group: list[Piece], rows: bool, index=None):
    """[B, H, S, D] -> ([B·T, H, D] the group's rows (or keys) of every batch, cu_seqlens int32, max length, index);
    a reversed square's rows and keys in reverse order. ``index``: :func:`_index`'s result, when the caller packs
    several tensors over the same tokens."""
    idx, cu, longest = index if index is not None else _index(group, rows, x.shape[0], x.device)
    packed = x.transpose(1, 2).index_select(1, idx).reshape(-1, x.shape[1], x.shape[3])
    return packed.contiguous(), cu, longest, idx


def _unpack(packed: torch.Tensor, batch: int) -> torch.Tensor:
    """[B·T, H, D] -> [B, H, T, D]."""
    return packed.reshape(batch, -1, *packed.shape[1:]).transpose(1, 2)


def _groups(plan: list[Piece]) -> list[tuple[bool, list[Piece]]]:
    """The varlen calls: (causal, pieces) for the full pieces, the causal squares and the reversed squares — each
    call's pieces on disjoint rows (a window strip's reversed and causal squares share rows: two calls, merged)."""
    kinds = [(False, False), (True, False), (True, True)]
    groups = [(c, [p for p in plan if (p.causal, p.anti) == (c, a)]) for c, a in kinds]
    return [(c, g) for c, g in groups if g]


def forward(q, k, v, scale: float, plan: list[Piece]) -> tuple[torch.Tensor, torch.Tensor]:
    """(O [B, H, Sq, D] in q's dtype, LSE [B, H, Sq] fp32) of the pieces (K, V already expanded to H heads)."""
    b = q.shape[0]
    groups = _groups(plan)
    o = torch.zeros(q.shape, dtype=torch.float32 if len(groups) > 1 else q.dtype, device=q.device)
    lse = torch.full(q.shape[:3], float("-inf"), dtype=torch.float32, device=q.device)
    for causal, group in groups:
        cols = _index(group, False, b, q.device)
        qp, cu_q, max_q, r_idx = _pack(q, group, True)
        kp, cu_k, max_k, _ = _pack(k, group, False, cols)
        vp, *_ = _pack(v, group, False, cols)
        o_p, l_p = VARLEN["forward"](qp, kp, vp, cu_q, cu_k, max_q, max_k, causal, scale)
        o_p = _unpack(o_p, b)                                           # [B, H, T, D]
        l_p = l_p.float().reshape(q.shape[1], b, -1).transpose(0, 1)    # [H, B·T] -> [B, H, T]
        if len(groups) > 1:
            o_view, l_view = o.index_select(2, r_idx), lse.index_select(2, r_idx)
            merge_into(o_view, l_view, o_p, l_p)
            o.index_copy_(2, r_idx, o_view)
            lse.index_copy_(2, r_idx, l_view)
        else:
            o.index_copy_(2, r_idx, o_p.to(o.dtype))
            lse.index_copy_(2, r_idx, l_p)
    return o.to(q.dtype), lse


def backward(q, k, v, o, do, lse, scale: float, plan: list[Piece]):
    """fp32 (dQ, dK, dV) of the pieces given the rows' final O (or a surrogate with the same D) and LSE."""
    b = q.shape[0]
    lse = torch.where(torch.isinf(lse), torch.full_like(lse, float("inf")), lse)     # −inf rows: P = 0
    dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    dk = torch.zeros(k.shape, dtype=torch.float32, device=q.device)
    dv = torch.zeros_like(dk)
    for causal, group in _groups(plan):
        rows, cols = _index(group, True, b, q.device), _index(group, False, b, q.device)
        qp, cu_q, max_q, r_idx = _pack(q, group, True, rows)
        kp, cu_k, max_k, c_idx = _pack(k, group, False, cols)
        vp, *_ = _pack(v, group, False, cols)
        op, *_ = _pack(o.to(q.dtype), group, True, rows)
        dop, *_ = _pack(do.to(q.dtype), group, True, rows)
        lp = lse.index_select(2, r_idx).transpose(0, 1).reshape(q.shape[1], -1).contiguous()   # [H, B·T]
        g_q, g_k, g_v = VARLEN["backward"](dop, qp, kp, vp, op, lp, cu_q, cu_k, max_q, max_k, causal, scale)
        dq.index_add_(2, r_idx, _unpack(g_q, b).float())
        dk.index_add_(2, c_idx, _unpack(g_k, b).float())
        dv.index_add_(2, c_idx, _unpack(g_v, b).float())
    return dq, dk, dv


# ------------------------------------------------------------------------------------------------ kernels
def _flash_forward(q, k, v, cu_q, cu_k, max_q, max_k, causal, scale):
    if q.dtype == torch.float32:
        return _per_sequence_forward(q, k, v, cu_q, cu_k, causal, scale)
    out = torch.ops.aten._flash_attention_forward(q, k, v, cu_q, cu_k, max_q, max_k, 0.0, causal, False, scale=scale)
    return out[0], out[1]


def _flash_backward(do, q, k, v, o, lse, cu_q, cu_k, max_q, max_k, causal, scale):
    if q.dtype == torch.float32:
        return _per_sequence_backward(do, q, k, v, o, lse, cu_q, cu_k, causal, scale)
    rng = torch.zeros(2, dtype=torch.int64, device=q.device)          # dropout 0: never read
    unused = torch.empty(0, dtype=torch.int64, device=q.device)
    return torch.ops.aten._flash_attention_backward(do, q, k, v, o, lse, cu_q, cu_k, max_q, max_k, 0.0, causal,
                                                    rng, unused, scale=scale)


def _sequences(cu_q, cu_k):
    return list(zip(cu_q.tolist()[:-1], cu_q.tolist()[1:], cu_k.tolist()[:-1], cu_k.tolist()[1:]))


def _per_sequence_forward(q, k, v, cu_q, cu_k, causal, scale):
    """fp32: the memory-efficient kernel per sequence ([T, H, D] slices as [1, H, t, D])."""
    o = torch.empty_like(q)
    lse = torch.empty(q.shape[1], q.shape[0], dtype=torch.float32, device=q.device)
    for a, e, c, f in _sequences(cu_q, cu_k):
        qs, ks, vs = (x[None].transpose(1, 2) for x in (q[a:e], k[c:f], v[c:f]))
        out = torch.ops.aten._scaled_dot_product_efficient_attention(qs, ks, vs, None, True, 0.0, causal, scale=scale)
        o[a:e] = out[0][0].transpose(0, 1)
        lse[:, a:e] = out[1][0, :, : e - a]
    return o, lse


def _per_sequence_backward(do, q, k, v, o, lse, cu_q, cu_k, causal, scale):
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    seed = torch.zeros((), dtype=torch.int64, device=q.device)
    for a, e, c, f in _sequences(cu_q, cu_k):
        pad = -(-(e - a) // 32) * 32                     # the kernel's LSE rows are padded to a multiple of 32
        l_s = torch.zeros(1, q.shape[1], pad, dtype=torch.float32, device=q.device)
        l_s[0, :, : e - a] = lse[:, a:e]
        args = [x[None].transpose(1, 2) for x in (do[a:e], q[a:e], k[c:f], v[c:f])]
        g = torch.ops.aten._scaled_dot_product_efficient_attention_backward(
            args[0], args[1], args[2], args[3], None, o[a:e][None].transpose(1, 2), l_s, seed, seed, 0.0,
            [True, True, True, False], causal, scale=scale)
        dq[a:e], dk[c:f], dv[c:f] = (x[0].transpose(0, 1) for x in g[:3])
    return dq, dk, dv


VARLEN = {"forward": _flash_forward, "backward": _flash_backward}
