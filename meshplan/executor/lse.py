"""The stable LSE merge of two partial attention results (shared by the CPU and CUDA kernel paths)."""

from __future__ import annotations

import torch


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
