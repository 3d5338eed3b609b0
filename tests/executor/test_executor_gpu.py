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


@pytest.mark.parametrize("dtype", ["bf16", "fp32"])
def test_cuda_document_block_runs_varlen_without_a_dense_matrix(dtype, monkeypatch):
    """A packed-document block on CUDA: the varlen path (one call per kind of piece), float64's answer, and no
    tensor of [Sq, Skv] elements allocated on the device."""
    import numpy as np
    from helpers import reference_attention

    from meshplan.executor import cuda_kernels
    from meshplan.executor.kernels import TORCH_DTYPE, block_backward_from_out, block_forward
    from meshplan.model.blockmask import KeyRanges
    from meshplan.model.workload import Mask

    lens = [300, 17, 1024, 555, 152]
    pos = np.arange(sum(lens))
    mask = Mask("docs", doc_lens=tuple(lens))
    ranges = KeyRanges(*mask.key_ranges(pos, pos), len(pos))
    allowed = torch.from_numpy(mask.permits(pos, pos))
    g = torch.Generator().manual_seed(0)
    dt = TORCH_DTYPE[dtype]
    q, k, v, do = (torch.randn(1, 4, len(pos), 64, generator=g).to(dt) for _ in range(4))
    calls = []
    forward = cuda_kernels.VARLEN["forward"]
    monkeypatch.setitem(cuda_kernels.VARLEN, "forward", lambda *a: calls.append(a[5:7]) or forward(*a))
    scale = 0.125
    dev = torch.device("cuda")
    torch.cuda.reset_peak_memory_stats()
    o, lse = block_forward(*(t.to(dev) for t in (q, k, v)), scale, ranges)
    dq, dk, dv = block_backward_from_out(*(t.to(dev) for t in (q, k, v)), o, do.to(dev), lse, scale, ranges)
    dense_bytes = len(pos) ** 2 * 4 * 4                     # one fp32 [H, S, S] score matrix
    assert torch.cuda.max_memory_allocated() < dense_bytes
    assert len(calls) == 1 and calls[0] == (max(lens), max(lens))  # one call: every document a sequence
    o_ref, lse_ref, *grads_ref = reference_attention(q, k, v, do, scale, allowed)
    tol = 1e-4 if dtype == "fp32" else 4 * 2 ** -8
    assert (o.double().cpu() - o_ref).abs().max() <= tol * o_ref.abs().max()
    for got, ref in zip((dq, dk, dv), grads_ref):
        assert (got.double().cpu() - ref).abs().max() <= tol * ref.abs().max()
