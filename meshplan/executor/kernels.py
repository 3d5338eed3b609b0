"""Attention kernels for one block, the stable LSE merge, and gradient sums — the executor's arithmetic.

Shapes: q, o, do [B, H, Sq, D]; k, v [B, Hkv, Skv, D] (GQA: Hkv = H / g, expanded to H only right
before the kernel, so KV never travels replicated); lse, delta [B, H, Sq] fp32. ``mask``: None (every
pair), a :class:`~meshplan.model.blockmask.KeyRanges` (row i attends keys lo[i] … hi[i] − 1, what the
executor passes), a :class:`~meshplan.model.blockmask.Blocks` (key runs per rectangle: an op over
interleaved chunks), or a dense [Sq, Skv] bool tensor (converted to key runs when its rows are contiguous).

Forward (``block_forward``): on CPU, torch's ``_scaled_dot_product_flash_attention_for_cpu`` on each kernel of
the mask's cover (:func:`~meshplan.model.blockmask.kernel_cover`: full rectangles without a mask, causal squares
with ``is_causal``, a window's far edge as a causal square over its rows and keys reversed; a document boundary
cuts a block into kernels per document segment, a sliding window into strips of W rows), merged by LSE where
two kernels share rows; an additive bias over the dense matrix only for masks whose kernels would cost more than
the dense block (a window of a few tokens: a kernel per row). On CUDA, the same cover with no limit on its pieces
through FlashAttention's varlen kernels (:mod:`meshplan.executor.cuda_kernels`): never a dense mask or score matrix. All
return the log-sum-exp. Rows without a permitted key get O = 0 and LSE = −inf (kernels disagree
there: the CPU op returns LSE = 0, others +inf).

Backward from the final O (``block_backward_from_out``): torch's CPU flash-attention backward per kernel of the
cover. Backward from D = rowsum(dO ∘ O) (``block_backward``, the travelling Q side of pass-Q, Mesh, StarTrail and
CHARM+ carries D, not O): the same flash backward with a surrogate O' = dO · D / ‖dO‖² per row — the
FlashAttention-2 backward reads O only through D (Dao 2023, Algorithm 2, line 4), and O' has the same D — so
both backward paths run the same kernel, on CPU and on CUDA.

Precision on CPU: torch's CPU kernels in bf16/fp16 are emulated (a bf16 flash backward runs ~7x, fp16 ~14x
slower than fp32 on an AVX2 core), so on CPUs without native support (AVX512-BF16 / AMX) half-precision blocks
are computed in fp32 from the exactly upcast inputs and O returns in the input dtype; gradients are fp32 always.
"""

from __future__ import annotations

import functools

import torch

from meshplan.executor import cuda_kernels
from meshplan.executor.lse import merge_into
from meshplan.model.blockmask import Blocks, KeyRanges, Piece, rows_overlap

TORCH_DTYPE = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
_CPU_FWD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_CPU_BWD = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward


def expand_kv(x: torch.Tensor, group: int) -> torch.Tensor:
    """[B, Hkv, S, D] -> [B, Hkv·g, S, D]: each KV head repeated for its g query heads."""
    return x if group == 1 else x.repeat_interleave(group, dim=1)


def reduce_kv(x: torch.Tensor, group: int) -> torch.Tensor:
    """[B, Hkv·g, S, D] -> [B, Hkv, S, D]: sum the gradients of a KV head's g query heads."""
    if group == 1:
        return x
    b, h, s, d = x.shape
    return x.view(b, h // group, group, s, d).sum(dim=2)


@functools.cache
def cpu_native(dtype: torch.dtype) -> bool:
    """Whether this CPU computes ``dtype`` natively (fp32 always; bf16 with AVX512-BF16 or AMX; fp16 with
    AMX-FP16). Unknown (torch without the probes): False, so half precision is computed in fp32."""
    if dtype == torch.float32:
        return True
    try:
        if dtype == torch.bfloat16:
            return bool(torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported())
        return bool(torch.cpu._is_amx_fp16_supported())
    except AttributeError:
        return False


def compute_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype a CPU block of ``x``'s dtype is computed in (see the module docstring); CUDA: x's own."""
    return x.dtype if x.is_cuda or cpu_native(x.dtype) else torch.float32


def cover(mask, n_q: int, n_k: int) -> list[Piece] | None:
    """The mask's cover by dense kernels (:func:`~meshplan.model.blockmask.kernel_cover`), or None when it has
    none (a dense mask whose rows are not runs of keys, or one whose kernels would cost more than the dense
    block: a sliding window inside it)."""
    if mask is None:
        return [Piece(0, n_q, 0, n_k, False)]
    if isinstance(mask, (Blocks, KeyRanges)):
        return mask.kernels
    ranges = KeyRanges.from_allowed(mask)
    return None if ranges is None else ranges.kernels


def _rows(x: torch.Tensor, a: int, b: int, p: Piece) -> torch.Tensor:
    """x[:, :, a:b] ([B, H, S, ...] tokens on dim 2), reversed for a reversed square (the kernel's causal
    triangle then is the piece's)."""
    x = x[:, :, a:b]
    return x.flip(2) if p.anti else x


def _whole(plan: list[Piece], n_q: int, n_k: int) -> bool:
    """Whether the cover is one plain kernel over the whole block (no slicing or merging needed)."""
    return len(plan) == 1 and not plan[0].anti and (plan[0].r0, plan[0].r1, plan[0].c0, plan[0].c1) == (0, n_q, 0, n_k)


def _piece_forward(q, k, v, p: Piece, scale: float):
    """(O, LSE) of one kernel of a cover (CPU, inputs in the compute dtype), rows in the block's order."""
    o, lse = _CPU_FWD(_rows(q, p.r0, p.r1, p), _rows(k, p.c0, p.c1, p), _rows(v, p.c0, p.c1, p), 0.0, p.causal,
                      scale=scale)
    return (o.flip(2), lse.flip(2)) if p.anti else (o, lse)


def _dense(mask, device) -> torch.Tensor | None:
    if mask is None or isinstance(mask, torch.Tensor):
        return mask
    return mask.dense(device)


def block_forward(q, k, v, scale: float, mask) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of one block. Returns (O [B, H, Sq, D] in q's dtype, LSE [B, H, Sq] fp32, natural log)."""
    group = q.shape[1] // k.shape[1]
    k, v = expand_kv(k, group), expand_kv(v, group)
    if q.is_cuda:
        return cuda_kernels.forward(q, k, v, scale, cuda_kernels.cuda_cover(mask, q.shape[2], k.shape[2]))
    dt = compute_dtype(q)
    qc, kc, vc = q.to(dt), k.to(dt), v.to(dt)
    plan = cover(mask, q.shape[2], k.shape[2])
    if plan is None:                                        # no short cover: an additive bias, dense
        allowed = _dense(mask, q.device)
        o, lse = _CPU_FWD(qc, kc, vc, 0.0, False, attn_mask=_bias(allowed, dt), scale=scale)
        return _empty_rows(o.to(q.dtype), lse.float(), allowed)
    if _whole(plan, q.shape[2], k.shape[2]):
        o, lse = _CPU_FWD(qc, kc, vc, 0.0, plan[0].causal, scale=scale)
        return o.to(q.dtype), lse.float()
    shared = rows_overlap(plan)                             # two kernels on some same rows: merge by LSE
    o = q.new_zeros(q.shape, dtype=torch.float32 if shared else q.dtype)
    lse = torch.full(q.shape[:3], float("-inf"), dtype=torch.float32, device=q.device)
    for p in plan:
        o_p, l_p = _piece_forward(qc, kc, vc, p, scale)
        if shared:
            merge_into(o[:, :, p.r0:p.r1], lse[:, :, p.r0:p.r1], o_p, l_p.float())
        else:
            o[:, :, p.r0:p.r1] = o_p
            lse[:, :, p.r0:p.r1] = l_p
    return o.to(q.dtype), lse


def _empty_rows(o, lse, allowed):
    """Rows with no permitted key: O = 0, LSE = −inf (whatever the kernel returned there)."""
    if allowed is not None:
        empty = ~allowed.any(dim=1)                  # [Sq]: rows with no permitted key
        if bool(empty.any()):
            lse = lse.masked_fill(empty, float("-inf"))
            o = o.masked_fill(empty[:, None], 0.0)
    return o, lse


def _bias(allowed: torch.Tensor, dtype) -> torch.Tensor:
    """Additive mask: 0 where allowed, −inf elsewhere ([Sq, Skv], broadcast over B and H)."""
    return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill(~allowed, float("-inf"))


def block_backward(q, k, v, do, lse, delta, scale: float, mask):
    """Partial gradients of one block in fp32: (dQ [B, H, Sq, D], dK [B, Hkv, Skv, D], dV like dK).

    ``lse`` and ``delta`` are the final (merged) LSE and D of the query rows; rows with LSE = −inf
    (nothing permitted anywhere) contribute nothing. On CPU: the flash backward with the surrogate O'
    (module docstring), on CUDA through the varlen kernels (:mod:`meshplan.executor.cuda_kernels`).
    """
    do32 = do.float()
    norm = (do32 * do32).sum(dim=-1)
    o_sur = do32 * torch.where(norm > 0, delta / norm.clamp_min(torch.finfo(torch.float32).tiny), 0.0)[..., None]
    if q.is_cuda:
        return _cuda_backward(q, k, v, o_sur, do32, lse, scale, mask)
    return _cpu_backward(q.float(), k.float(), v.float(), o_sur, do32, lse, scale, mask)


def _cuda_backward(q, k, v, o, do, lse, scale: float, mask):
    """The CUDA kernels' backward over the mask's cover (q's dtype); fp32 gradients, K and V reduced to Hkv."""
    group = q.shape[1] // k.shape[1]
    dq, dk, dv = cuda_kernels.backward(q, expand_kv(k, group), expand_kv(v, group), o, do, lse, scale,
                                       cuda_kernels.cuda_cover(mask, q.shape[2], k.shape[2]))
    return dq, reduce_kv(dk, group), reduce_kv(dv, group)


def block_backward_from_out(q, k, v, o, do, lse, scale: float, mask):
    """Like :func:`block_backward`, from the final O instead of D: torch's CPU flash-attention backward (it
    recomputes P from the final LSE and D from O), per kernel of the mask's cover; on CUDA the varlen kernels'
    backward. Returns fp32 (dQ, dK, dV)."""
    if q.is_cuda:
        return _cuda_backward(q, k, v, o, do, lse, scale, mask)
    dt = compute_dtype(q)
    return _cpu_backward(q.to(dt), k.to(dt), v.to(dt), o.to(dt), do.to(dt), lse, scale, mask)


def _cpu_backward(q, k, v, o, do, lse, scale: float, mask):
    """torch's CPU flash backward over the mask's cover (all inputs in the compute dtype); fp32 gradients."""
    group = q.shape[1] // k.shape[1]
    kx, vx = expand_kv(k, group).contiguous(), expand_kv(v, group).contiguous()
    lse = torch.where(torch.isinf(lse), torch.full_like(lse, float("inf")), lse).contiguous()
    plan = cover(mask, q.shape[2], k.shape[2])
    if plan is None:
        allowed = _dense(mask, q.device)
        got = _CPU_BWD(do.contiguous(), q.contiguous(), kx, vx, o.contiguous(), lse, 0.0, False,
                       attn_mask=_bias(allowed, q.dtype), scale=scale)
        dq, dk, dv = (g.float() for g in got)
    elif _whole(plan, q.shape[2], k.shape[2]):
        got = _CPU_BWD(do.contiguous(), q.contiguous(), kx, vx, o.contiguous(), lse, 0.0, plan[0].causal,
                       scale=scale)
        dq, dk, dv = (g.float() for g in got)
    else:
        dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        dk = torch.zeros(kx.shape, dtype=torch.float32, device=q.device)
        dv = torch.zeros_like(dk)
        for p in plan:
            rows = [_rows(x, p.r0, p.r1, p).contiguous() for x in (do, q)]
            keys = [_rows(x, p.c0, p.c1, p).contiguous() for x in (kx, vx)]
            got = _CPU_BWD(*rows, *keys, _rows(o, p.r0, p.r1, p).contiguous(), _rows(lse, p.r0, p.r1, p).contiguous(),
                           0.0, p.causal, scale=scale)
            g_q, g_k, g_v = (g.flip(2) if p.anti else g for g in got[:3])
            dq[:, :, p.r0:p.r1] += g_q.float()
            dk[:, :, p.c0:p.c1] += g_k.float()
            dv[:, :, p.c0:p.c1] += g_v.float()
    return dq, reduce_kv(dk, group), reduce_kv(dv, group)


def row_delta(o: torch.Tensor, do: torch.Tensor) -> torch.Tensor:
    """D = rowsum(dO ∘ O) in fp32, [B, H, S] (FlashAttention-2's preprocessing step)."""
    return (o.float() * do.float()).sum(dim=-1)
