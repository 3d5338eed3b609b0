"""The executor's arithmetic in one process: kernels against float64, the LSE merge (C1), wire packing."""

from __future__ import annotations

import math

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from helpers import reference_attention  # noqa: E402

from meshplan.executor.kernels import (  # noqa: E402
    block_backward,
    block_backward_from_out,
    block_forward,
    merge_into,
    row_delta,
)
from meshplan.executor.program import Layout  # noqa: E402
from meshplan.executor.store import Store, pack, unpack  # noqa: E402

TOL = {torch.bfloat16: 2e-2, torch.float16: 3e-3, torch.float32: 1e-5}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_block_kernels_match_float64(dtype):
    g = torch.Generator().manual_seed(1)
    B, H, Sq, Skv, D = 1, 2, 24, 40, 16
    q, do = (torch.randn(B, H, Sq, D, generator=g).to(dtype) for _ in range(2))
    k, v = (torch.randn(B, H, Skv, D, generator=g).to(dtype) for _ in range(2))
    allowed = torch.rand(Sq, Skv, generator=g) < 0.6
    allowed[3] = False                                  # a row with no permitted key
    scale = 1 / math.sqrt(D)
    o_ref, lse_ref, dq_ref, dk_ref, dv_ref = reference_attention(q, k, v, do, scale, allowed)
    o, lse = block_forward(q, k, v, scale, allowed)
    assert o.dtype == dtype and lse.dtype == torch.float32
    live = allowed.any(1)
    assert torch.isneginf(lse[..., 3]).all() and (o[..., 3, :] == 0).all()     # normalised, not 0 or +inf
    assert torch.allclose(lse[..., live].double(), lse_ref[..., live], atol=TOL[dtype] * 4)
    assert torch.allclose(o.double(), o_ref, atol=TOL[dtype] * 2)
    dq, dk, dv = block_backward(q, k, v, do, lse_ref.float(), row_delta(o_ref, do), scale, allowed)
    for got, ref in ((dq, dq_ref), (dk, dk_ref), (dv, dv_ref)):
        assert torch.allclose(got.double(), ref, atol=TOL[dtype] * 4 * ref.abs().max().item())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_causal_diagonal_takes_the_is_causal_path_and_matches_float64(dtype):
    from meshplan.model.blockmask import KeyRanges, Piece, pieces
    g = torch.Generator().manual_seed(3)
    B, H, S, D = 1, 2, 48, 16
    q, k, v, do = (torch.randn(B, H, S, D, generator=g).to(dtype) for _ in range(4))
    tril = torch.ones(S, S, dtype=torch.bool).tril()
    assert pieces(KeyRanges.from_allowed(tril)) == [Piece(0, S, 0, S, True)]
    assert pieces(KeyRanges.from_allowed(torch.ones(S, S, dtype=torch.bool))) == [Piece(0, S, 0, S, False)]
    scale = 1 / math.sqrt(D)
    o_ref, lse_ref, dq_ref, dk_ref, dv_ref = reference_attention(q, k, v, do, scale, tril)
    o, lse = block_forward(q, k, v, scale, tril)
    assert torch.allclose(o.double(), o_ref, atol=TOL[dtype] * 2)
    assert torch.allclose(lse.double(), lse_ref, atol=TOL[dtype] * 4)
    dq, dk, dv = block_backward_from_out(q, k, v, o_ref.to(dtype), do, lse_ref.float(), scale, tril)
    for got, ref in ((dq, dq_ref), (dk, dk_ref), (dv, dv_ref)):
        assert torch.allclose(got.double(), ref, atol=TOL[dtype] * 4 * ref.abs().max().item())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_flash_backward_from_the_final_out_matches_float64(dtype):
    """A block holding the first half of the row's keys: the final O and LSE come from the whole row (float64), the
    block's partial gradients must equal the float64 ones restricted to its keys; GQA 4→2, a dead row."""
    g = torch.Generator().manual_seed(3)
    q, do = (torch.randn(1, 4, 16, 16, generator=g).to(dtype) for _ in range(2))
    k, v = (torch.randn(1, 2, 32, 16, generator=g).to(dtype) for _ in range(2))
    allowed = torch.rand(16, 32, generator=g) < 0.7
    allowed[5] = False
    scale = 0.25
    kx, vx = k.repeat_interleave(2, 1), v.repeat_interleave(2, 1)
    o_ref, lse_ref, dq_ref, dk_ref, dv_ref = reference_attention(q, kx, vx, do, scale, allowed)
    dq, dk, dv = block_backward_from_out(q, k[:, :, :16], v[:, :, :16], o_ref.to(dtype), do, lse_ref.float(),
                                         scale, allowed[:, :16])
    p = torch.exp((q.double() @ kx[:, :, :16].double().transpose(-1, -2) * scale).masked_fill(~allowed[:, :16],
                  float("-inf")) - lse_ref.nan_to_num(neginf=0.0)[..., None])
    dv_blk = (p.transpose(-1, -2) @ do.double()).unflatten(1, (2, 2)).sum(2)
    dp = do.double() @ vx[:, :, :16].double().transpose(-1, -2)
    ds = p * (dp - (do.double() * o_ref).sum(-1, keepdim=True))
    dq_blk = ds @ kx[:, :, :16].double() * scale
    dk_blk = (ds.transpose(-1, -2) @ q.double() * scale).unflatten(1, (2, 2)).sum(2)
    assert dk.shape == (1, 2, 16, 16)
    for got, ref in ((dq, dq_blk), (dk, dk_blk), (dv, dv_blk)):
        assert torch.isfinite(got).all()
        assert torch.allclose(got.double(), ref, atol=TOL[dtype] * 4 * ref.abs().max().item())
    assert (dq[:, :, 5] == 0).all()                        # the dead row contributes nothing
    d_full = block_backward_from_out(q, k, v, o_ref.to(dtype), do, lse_ref.float(), scale, allowed)
    for got, ref in zip(d_full, (dq_ref, dk_ref.unflatten(1, (2, 2)).sum(2), dv_ref.unflatten(1, (2, 2)).sum(2))):
        assert torch.allclose(got.double(), ref, atol=TOL[dtype] * 4 * ref.abs().max().item())


def test_gqa_kernels_expand_kv_only_before_the_kernel():
    g = torch.Generator().manual_seed(2)
    q = torch.randn(1, 4, 8, 8, generator=g)
    k, v = torch.randn(1, 2, 8, 8, generator=g), torch.randn(1, 2, 8, 8, generator=g)
    o, _ = block_forward(q, k, v, 0.5, None)
    o_ref = reference_attention(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), q, 0.5,
                       torch.ones(8, 8, dtype=torch.bool))[0]
    assert torch.allclose(o.double(), o_ref, atol=1e-5)
    lse = torch.logsumexp(q @ k.repeat_interleave(2, 1).transpose(-1, -2) * 0.5, -1)
    dq, dk, dv = block_backward(q, k, v, q, lse, row_delta(o, q), 0.5, None)
    assert dk.shape == (1, 2, 8, 8) and dv.shape == (1, 2, 8, 8)


@pytest.mark.parametrize("flip", [False, True])
def test_c1_merge_with_a_large_lse_gap(flip):
    """BUGCASES C1: (O=1, L=0) merged with (O=2, L=100) in fp32, both orders: L = 100, O = 2, no inf/NaN."""
    D = 8
    a = (torch.ones(1, 1, 1, D), torch.zeros(1, 1, 1))
    b = (2 * torch.ones(1, 1, 1, D), torch.full((1, 1, 1), 100.0))
    first, second = (b, a) if flip else (a, b)
    o, lse = first[0].clone(), first[1].clone()
    merge_into(o, lse, *second)
    assert lse.item() == pytest.approx(100.0, abs=1e-6)
    assert torch.allclose(o, 2 * torch.ones(1, 1, 1, D), atol=1e-6)
    assert torch.isfinite(o).all()


def test_merge_of_two_empty_rows_stays_empty():
    o, lse = torch.zeros(1, 1, 2, 4), torch.full((1, 1, 2), float("-inf"))
    merge_into(o, lse, torch.zeros(1, 1, 2, 4), torch.tensor([[[float("-inf"), 1.0]]]))
    assert torch.isneginf(lse[0, 0, 0]) and lse[0, 0, 1] == 1.0 and torch.isfinite(o).all()


def test_merge_equals_attention_over_the_union():
    g = torch.Generator().manual_seed(3)
    q, k, v = torch.randn(1, 1, 6, 4, generator=g), torch.randn(1, 1, 10, 4, generator=g), torch.randn(1, 1, 10, 4,
                                                                                                        generator=g)
    o1, l1 = block_forward(q, k[:, :, :4], v[:, :, :4], 0.5, None)
    o2, l2 = block_forward(q, k[:, :, 4:], v[:, :, 4:], 0.5, None)
    acc_o, acc_l = torch.zeros_like(o1), torch.full_like(l1, float("-inf"))
    merge_into(acc_o, acc_l, o1, l1)
    merge_into(acc_o, acc_l, o2, l2)
    o, lse = block_forward(q, k, v, 0.5, None)
    assert torch.allclose(acc_o, o, atol=1e-6) and torch.allclose(acc_l, lse, atol=1e-6)


@pytest.mark.parametrize("kind,wire", [("out", "bf16"), ("kv", "fp16"), ("qside", "bf16"), ("dkv", "fp32")])
def test_pack_moves_exactly_the_schedules_bytes(kind, wire):
    layout = Layout(kind, tokens=6, h0=0, h1=4, batch=1, head_dim=8, group=2)
    store = Store(torch.device("cpu"))
    parts = store.alloc(0, layout, "fp32")
    for x in parts.values():
        x.copy_(torch.randn(x.shape))
    buf = pack(parts, kind, wire)
    assert buf.numel() == layout.nbytes(wire)
    dst = store.alloc(1, layout, "fp32")
    unpack(buf, dst, kind, wire)
    for name, x in parts.items():
        expect = x if name in ("lse", "delta") or wire == "fp32" else x.to({"bf16": torch.bfloat16,
                                                                           "fp16": torch.float16}[wire]).float()
        assert torch.equal(dst[name], expect)
    assert store.peak_bytes == 2 * layout.nbytes("fp32")
    store.free(0)
    assert store.live_bytes == layout.nbytes("fp32")


def test_kv_wire_bytes_scale_with_kv_heads_not_query_heads():
    """BUGCASES C7: KV travels with Hkv heads; it is expanded to H only inside the kernel."""
    sizes = [Layout("kv", 16, 0, 4, 1, 64, group).nbytes("bf16") for group in (1, 2, 4)]
    assert sizes == [2 * 16 * 4 * 64 * 2, 2 * 16 * 2 * 64 * 2, 2 * 16 * 1 * 64 * 2]
    assert np.allclose(np.array(sizes) / sizes[0], [1, 0.5, 0.25])


def test_freed_memory_is_kept_for_reuse_on_glibc():
    import platform
    import sys

    from meshplan.executor.memory import reuse_freed_memory
    glibc = sys.platform.startswith("linux") and platform.libc_ver()[0] == "glibc"
    assert reuse_freed_memory() is glibc


def test_half_precision_runs_in_fp32_on_cpus_without_native_support():
    from meshplan.executor.kernels import compute_dtype, cpu_native
    x = torch.zeros(1, dtype=torch.bfloat16)
    assert compute_dtype(torch.zeros(1)) == torch.float32
    assert compute_dtype(x) == (torch.bfloat16 if cpu_native(torch.bfloat16) else torch.float32)
    native = torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()
    assert cpu_native(torch.bfloat16) == bool(native)
