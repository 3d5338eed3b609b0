"""The CUDA path's packing, merging and gradient sums, run on CPU: the two varlen entry points replaced by float64
references that record the largest score matrix they build (the CUDA kernels themselves: test_executor_gpu)."""

from __future__ import annotations

import math

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from helpers import reference_attention  # noqa: E402

from meshplan.executor import cuda_kernels  # noqa: E402
from meshplan.model.blockmask import Blocks, KeyRanges  # noqa: E402
from meshplan.model.workload import Mask  # noqa: E402


class Reference:
    """Varlen forward/backward in float64, one sequence at a time (causal: top-left, the pieces are squares)."""

    def __init__(self):
        self.largest = 0

    def _scores(self, q, k, causal, scale):
        s = torch.einsum("thd,uhd->htu", q.double(), k.double()) * scale
        self.largest = max(self.largest, s.shape[1] * s.shape[2])
        if causal:
            s = s.masked_fill(torch.ones(s.shape[1:], dtype=torch.bool).triu(1), float("-inf"))
        return s

    def forward(self, q, k, v, cu_q, cu_k, max_q, max_k, causal, scale):
        o, lse = torch.zeros_like(q, dtype=torch.float64), torch.zeros(q.shape[1], q.shape[0], dtype=torch.float64)
        for a, e, c, f in cuda_kernels._sequences(cu_q, cu_k):
            s = self._scores(q[a:e], k[c:f], causal, scale)
            lse[:, a:e] = torch.logsumexp(s, -1)
            o[a:e] = torch.einsum("htu,uhd->thd", torch.softmax(s, -1), v[c:f].double())
        return o.to(q.dtype), lse.float()

    def backward(self, do, q, k, v, o, lse, cu_q, cu_k, max_q, max_k, causal, scale):
        dq, dk, dv = (torch.zeros_like(x, dtype=torch.float64) for x in (q, k, v))
        for a, e, c, f in cuda_kernels._sequences(cu_q, cu_k):
            p = torch.exp(self._scores(q[a:e], k[c:f], causal, scale) - lse[:, a:e, None].double())
            g, vv = do[a:e].double(), v[c:f].double()
            delta = (g * o[a:e].double()).sum(-1).T                                       # [H, t]
            dv[c:f] = torch.einsum("htu,thd->uhd", p, g)
            ds = p * (torch.einsum("thd,uhd->htu", g, vv) - delta[..., None])
            dq[a:e] = torch.einsum("htu,uhd->thd", ds, k[c:f].double()) * scale
            dk[c:f] = torch.einsum("htu,thd->uhd", ds, q[a:e].double()) * scale
        return dq, dk, dv


@pytest.fixture
def reference(monkeypatch):
    ref = Reference()
    monkeypatch.setitem(cuda_kernels.VARLEN, "forward", ref.forward)
    monkeypatch.setitem(cuda_kernels.VARLEN, "backward", ref.backward)
    return ref


def _documents(lens, shift: int = 0):
    """Key runs of a packed-document block: every position a query, all but the last ``shift`` a key."""
    pos = np.arange(sum(lens))
    keys = pos[: len(pos) - shift]
    mask = Mask("docs", doc_lens=tuple(lens))
    return KeyRanges(*mask.key_ranges(pos, keys), len(keys)), torch.from_numpy(mask.permits(pos, keys))


@pytest.mark.parametrize("shift", [0, 7])
def test_document_block_matches_float64_without_a_dense_matrix(reference, shift):
    lens = [37, 120, 5, 64, 90]
    ranges, allowed = _documents(lens, shift)
    g = torch.Generator().manual_seed(1)
    n_q, n_k = len(ranges.lo), ranges.n_keys
    q, do = (torch.randn(2, 3, n_q, 16, generator=g) for _ in range(2))
    k, v = (torch.randn(2, 3, n_k, 16, generator=g) for _ in range(2))
    scale = 1 / math.sqrt(16)
    plan = cuda_kernels.cuda_cover(ranges, n_q, n_k)
    o, lse = cuda_kernels.forward(q, k, v, scale, plan)
    o_ref, lse_ref, *grads_ref = reference_attention(q, k, v, do, scale, allowed)
    torch.testing.assert_close(o.double(), o_ref, atol=1e-5, rtol=1e-5)
    live = torch.isfinite(lse_ref)
    torch.testing.assert_close(lse.double()[live], lse_ref[live], atol=1e-5, rtol=1e-5)
    assert torch.isneginf(lse[~live]).all()
    grads = cuda_kernels.backward(q, k, v, o, do, lse, scale, plan)
    for got, ref in zip(grads, grads_ref):
        torch.testing.assert_close(got.double(), ref, atol=1e-5, rtol=1e-5)
    assert reference.largest <= max(lens) ** 2 < n_q * n_k         # one document at a time, never the block


def test_blocks_mask_runs_each_rectangle(reference):
    """An op over interleaved chunks (key runs per rectangle) on the same path."""
    ranges, allowed = _documents([40, 24])
    half = KeyRanges(ranges.lo[:32], np.minimum(ranges.hi[:32], 32), 32)
    blocks = Blocks(((0, 32, 0, 32, half), (32, 64, 0, 64, KeyRanges(ranges.lo[32:], ranges.hi[32:], 64))), 64, 64)
    g = torch.Generator().manual_seed(2)
    q, k, v, do = (torch.randn(1, 2, 64, 8, generator=g) for _ in range(4))
    plan = cuda_kernels.cuda_cover(blocks, 64, 64)
    o, lse = cuda_kernels.forward(q, k, v, 0.3, plan)
    dense = blocks.dense("cpu")
    o_ref, lse_ref, *grads_ref = reference_attention(q, k, v, do, 0.3, dense)
    torch.testing.assert_close(o.double(), o_ref, atol=1e-5, rtol=1e-5)
    for got, ref in zip(cuda_kernels.backward(q, k, v, o, do, lse, 0.3, plan), grads_ref):
        torch.testing.assert_close(got.double(), ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("window, q0", [(24, 0), (24, 40), (3, 16)])
def test_sliding_window_block_matches_float64_without_a_dense_matrix(reference, window, q0):
    """A window inside a block: strips of W rows whose far edge (a reversed square) joins the causal call with its
    rows and keys packed in reverse order — exact against float64, and no score matrix beyond a strip's."""
    mask = Mask("window", window=window)
    qp, kp = np.arange(q0, q0 + 64), np.arange(96)
    ranges = KeyRanges(*mask.key_ranges(qp, kp), len(kp))
    plan = cuda_kernels.cuda_cover(ranges, len(qp), len(kp))
    assert any(p.anti for p in plan)
    g = torch.Generator().manual_seed(3)
    q, do = (torch.randn(1, 2, len(qp), 8, generator=g) for _ in range(2))
    k, v = (torch.randn(1, 2, len(kp), 8, generator=g) for _ in range(2))
    o, lse = cuda_kernels.forward(q, k, v, 0.3, plan)
    o_ref, lse_ref, *grads_ref = reference_attention(q, k, v, do, 0.3, torch.from_numpy(mask.permits(qp, kp)))
    torch.testing.assert_close(o.double(), o_ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse.double(), lse_ref, atol=1e-5, rtol=1e-5)
    for got, ref in zip(cuda_kernels.backward(q, k, v, o, do, lse, 0.3, plan), grads_ref):
        torch.testing.assert_close(got.double(), ref, atol=1e-5, rtol=1e-5)
    assert reference.largest <= max(window, 64 - window) ** 2 < len(qp) * len(kp)
