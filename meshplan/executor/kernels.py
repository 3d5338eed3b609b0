"""Attention kernels for one block, the stable LSE merge, and gradient sums — the executor's arithmetic.

Shapes: q, o, do [B, H, Sq, D]; k, v [B, Hkv, Skv, D] (GQA: Hkv = H / g, expanded to H only right
before the kernel, so KV never travels replicated); lse, delta [B, H, Sq] fp32; ``allowed`` [Sq, Skv]
bool (None: every pair).

Forward (``block_forward``): on CUDA, flash-attn for unmasked half-precision blocks when it is installed,
else torch's flash-attention op, and torch's memory-efficient op (additive bias, ``compute_log_sumexp``) for
masked blocks; on CPU torch's ``_scaled_dot_product_flash_attention_for_cpu``. All return the log-sum-exp.
Rows without a permitted key get O = 0 and LSE = −inf (kernels disagree there: the CPU op returns LSE = 0, others +inf).

Backward (``block_backward``): the FlashAttention-2 recurrence (Dao 2023, Algorithm 2) in fp32 with the
*final* LSE and D = rowsum(dO ∘ O): P = exp(S − LSE), dV = Pᵀ dO, dS = P ∘ (dO Vᵀ − D), dQ = scale·dS K,
dK = scale·dSᵀ Q. It takes D rather than O because the travelling Q side of pass-Q and Mesh carries D
(``qside``); the flash kernels' own backward recomputes D from O, so they serve only where the op's Q side
holds O (Ring, a Mesh tile's own row): ``block_backward_from_out``, torch's CPU flash backward.
"""

from __future__ import annotations

import torch

TORCH_DTYPE = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
_HEAD_BLOCK_ELEMS = 1 << 24   # backward score matrices are built this many elements at a time (64 MiB fp32)


def expand_kv(x: torch.Tensor, group: int) -> torch.Tensor:
    """[B, Hkv, S, D] -> [B, Hkv·g, S, D]: each KV head repeated for its g query heads."""
    return x if group == 1 else x.repeat_interleave(group, dim=1)


def reduce_kv(x: torch.Tensor, group: int) -> torch.Tensor:
    """[B, Hkv·g, S, D] -> [B, Hkv, S, D]: sum the gradients of a KV head's g query heads."""
    if group == 1:
        return x
    b, h, s, d = x.shape
    return x.view(b, h // group, group, s, d).sum(dim=2)


def block_forward(q, k, v, scale: float, allowed: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of one block. Returns (O [B, H, Sq, D] in q's dtype, LSE [B, H, Sq] fp32, natural log)."""
    group = q.shape[1] // k.shape[1]
    k, v = expand_kv(k, group), expand_kv(v, group)
    if q.is_cuda:
        o, lse = _cuda_forward(q, k, v, scale, allowed)
    else:
        causal = is_tril(allowed)
        bias = None if allowed is None or causal else _bias(allowed, q.dtype)
        o, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, causal, attn_mask=bias,
                                                                            scale=scale)
    lse = lse.float()
    if allowed is not None:
        empty = ~allowed.any(dim=1)                  # [Sq]: rows with no permitted key
        if bool(empty.any()):
            lse = lse.masked_fill(empty, float("-inf"))
            o = o.masked_fill(empty[:, None], 0.0)
    return o, lse


def is_tril(allowed: torch.Tensor | None) -> bool:
    """Whether a mask is exactly the square lower triangle (a causal diagonal block in natural order): then the
    CPU flash kernels run with ``is_causal`` and skip the masked half instead of reading an additive bias."""
    return (allowed is not None and allowed.shape[0] == allowed.shape[1]
            and bool(torch.equal(allowed, torch.ones_like(allowed).tril())))


def _bias(allowed: torch.Tensor, dtype) -> torch.Tensor:
    """Additive mask: 0 where allowed, −inf elsewhere ([Sq, Skv], broadcast over B and H)."""
    return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill(~allowed, float("-inf"))


def _cuda_forward(q, k, v, scale, allowed):
    """Unmasked half-precision blocks: flash-attn, else torch's flash op; masked or fp32 blocks: torch's
    memory-efficient op with an additive bias (the flash kernels take no arbitrary mask). All return the LSE."""
    if allowed is None and q.dtype != torch.float32:
        try:
            from flash_attn.flash_attn_interface import flash_attn_func
        except ImportError:
            out = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, False, False, scale=scale)
            return out[0], out[1]
        o, lse, _ = flash_attn_func(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), softmax_scale=scale,
                                    return_attn_probs=True)
        return o.transpose(1, 2), lse
    bias = None if allowed is None else _bias(allowed, q.dtype).expand(q.shape[0], q.shape[1], -1, -1)
    out = torch.ops.aten._scaled_dot_product_efficient_attention(q, k, v, bias, True, scale=scale)
    return out[0], out[1][..., : q.shape[2]]


def block_backward(q, k, v, do, lse, delta, scale: float, allowed: torch.Tensor | None):
    """Partial gradients of one block in fp32: (dQ [B, H, Sq, D], dK [B, Hkv, Skv, D], dV like dK).

    ``lse`` and ``delta`` are the final (merged) LSE and D of the query rows; rows with LSE = −inf
    (nothing permitted anywhere) contribute nothing.
    """
    group = q.shape[1] // k.shape[1]
    q32, do32 = q.float(), do.float()
    k32, v32 = expand_kv(k.float(), group), expand_kv(v.float(), group)
    lse = torch.where(torch.isinf(lse), torch.full_like(lse, float("inf")), lse)   # −inf rows: P = 0
    dq, dk, dv = torch.zeros_like(q32), torch.zeros_like(k32), torch.zeros_like(v32)
    step = max(1, _HEAD_BLOCK_ELEMS // max(1, q.shape[0] * q.shape[2] * k.shape[2]))
    for h in range(0, q.shape[1], step):
        sl = slice(h, h + step)
        s = torch.matmul(q32[:, sl], k32[:, sl].transpose(-1, -2)) * scale
        if allowed is not None:
            s = s.masked_fill(~allowed, float("-inf"))
        p = torch.exp(s - lse[:, sl, :, None])
        dv[:, sl] = torch.matmul(p.transpose(-1, -2), do32[:, sl])
        ds = p * (torch.matmul(do32[:, sl], v32[:, sl].transpose(-1, -2)) - delta[:, sl, :, None])
        dq[:, sl] = torch.matmul(ds, k32[:, sl]) * scale
        dk[:, sl] = torch.matmul(ds.transpose(-1, -2), q32[:, sl]) * scale
    return dq, reduce_kv(dk, group), reduce_kv(dv, group)


def block_backward_from_out(q, k, v, o, do, lse, scale: float, allowed: torch.Tensor | None):
    """Like :func:`block_backward`, from the final O instead of D: torch's CPU flash-attention backward
    (it recomputes P from the final LSE and D from O), about 3.5× faster than the fp32 recurrence on CPU.
    Returns fp32 (dQ, dK, dV); on CUDA it falls back to :func:`block_backward`."""
    if q.is_cuda:
        return block_backward(q, k, v, do, lse, row_delta(o, do), scale, allowed)
    group = q.shape[1] // k.shape[1]
    causal = is_tril(allowed)
    bias = None if allowed is None or causal else _bias(allowed, q.dtype)
    lse = torch.where(torch.isinf(lse), torch.full_like(lse, float("inf")), lse).contiguous()
    dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        do.to(q.dtype).contiguous(), q, expand_kv(k, group).contiguous(), expand_kv(v, group).contiguous(),
        o.to(q.dtype).contiguous(), lse, 0.0, causal, attn_mask=bias, scale=scale)
    return dq.float(), reduce_kv(dk.float(), group), reduce_kv(dv.float(), group)


def merge_into(o_acc: torch.Tensor, lse_acc: torch.Tensor, o_part: torch.Tensor, lse_part: torch.Tensor) -> None:
    """In place: (o_acc, lse_acc) ← the LSE merge of itself with a partial, in fp32, overflow-free.

    LSE = m + log(e^(a − m) + e^(b − m)), m = max(a, b); O = e^(a − LSE)·O_a + e^(b − LSE)·O_b
    (ring-flash-attention's form). Rows where both are −inf stay O = 0, LSE = −inf.
    ``o_*`` [B, H, S, D] (o_acc fp32), ``lse_*`` [B, H, S] fp32.
    """
    a, b = lse_acc, lse_part.float()
    m = torch.maximum(a, b)
    live = torch.isfinite(m)
    m_safe = torch.where(live, m, torch.zeros_like(m))
    wa, wb = torch.exp(a - m_safe), torch.exp(b - m_safe)
    total = wa + wb
    new = torch.where(live, m_safe + torch.log(total), m)
    wa, wb = torch.where(live, wa / total, 0.0), torch.where(live, wb / total, 0.0)
    o_acc.mul_(wa[..., None]).add_(o_part.float() * wb[..., None])
    lse_acc.copy_(new)


def row_delta(o: torch.Tensor, do: torch.Tensor) -> torch.Tensor:
    """D = rowsum(dO ∘ O) in fp32, [B, H, S] (FlashAttention-2's preprocessing step)."""
    return (o.float() * do.float()).sum(dim=-1)
