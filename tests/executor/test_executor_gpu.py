"""GPU checks of the executor (marker ``gpu``; skipped without CUDA: ``pytest -m gpu``)."""

from __future__ import annotations

import math

import pytest

torch = pytest.importorskip("torch")
pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.mark.parametrize("masked", [False, True])
def test_cuda_kernels_match_the_cpu_float64_reference(masked):
    from helpers import reference_attention

    from meshplan.executor.kernels import block_backward, block_forward, row_delta

    g = torch.Generator().manual_seed(0)
    q, k, v, do = (torch.randn(1, 4, 256, 64, generator=g).to(torch.bfloat16) for _ in range(4))
    pos = torch.arange(256)
    allowed = pos[None, :] <= pos[:, None] if masked else torch.ones(256, 256, dtype=torch.bool)
    scale = 1 / math.sqrt(64)
    o_ref, lse_ref, *grads_ref = reference_attention(q, k, v, do, scale, allowed)
    dev = torch.device("cuda")
    qc, kc, vc, dc = (t.to(dev) for t in (q, k, v, do))
    mask = allowed.to(dev) if masked else None
    o, lse = block_forward(qc, kc, vc, scale, mask)
    assert (o.double().cpu() - o_ref).abs().max() <= 4 * 2 ** -8 * o_ref.abs().max()
    assert (lse.double().cpu() - lse_ref).abs().max() <= 4 * 2 ** -8 * lse_ref.abs().max()
    grads = block_backward(qc, kc, vc, dc, lse, row_delta(o, dc), scale, mask)
    for got, ref in zip(grads, grads_ref):
        assert (got.double().cpu() - ref).abs().max() <= 4 * 2 ** -8 * ref.abs().max()
