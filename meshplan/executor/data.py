"""Inputs, the float64 reference and the single-process run — what the numerics check compares against.

Shapes (natural token order, as ``run --dump`` writes them): q, dout, out, dq [B, S, H, D]; k, v, dk, dv
[B, S, Hkv, D]; lse [B, H, S] fp32/fp64. The reference follows docs/bugcases.md: single-process attention on
the whole sequence in float64, on the *same dtype-rounded inputs*. Padding (positions ≥ valid_len, and a
document's padding) never contributes as a key, and its query rows are not computed; nor are the rows of a
cached prefix (inference), whose tokens are keys only.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from meshplan.core.errors import UserError
from meshplan.executor.kernels import TORCH_DTYPE, block_backward_from_out, block_forward
from meshplan.model.workload import Mask, Workload


@dataclass
class Inputs:
    """Global inputs, natural token order, already in the workload dtype."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    dout: torch.Tensor

    def to(self, device: torch.device) -> Inputs:
        """A copy on ``device``."""
        return Inputs(*(t.to(device) for t in (self.q, self.k, self.v, self.dout)))


def softmax_scale(w: Workload) -> float:
    """1/√D (the default of every kernel; the schedule format has no other)."""
    return 1.0 / math.sqrt(w.head_dim)


def make_inputs(w: Workload, seed: int) -> Inputs:
    """Standard-normal inputs from ``seed`` (identical on every rank), rounded to the workload dtype."""
    g = torch.Generator().manual_seed(seed)
    dt = TORCH_DTYPE[w.dtype]
    qs, ks = (w.batch, w.seq_len, w.n_heads, w.head_dim), (w.batch, w.seq_len, w.n_kv_heads, w.head_dim)
    return Inputs(*(torch.randn(s, generator=g).to(dt) for s in (qs, ks, ks, qs)))


def load_inputs(path: str | Path, w: Workload) -> Inputs:
    """Inputs from an ``.npz`` with arrays q, k, v and optionally dout (shapes as above).

    Raises:
        UserError: a missing array or a shape that does not match the workload.
    """
    with np.load(path) as z:
        arrays = {name: z[name] for name in z.files}
    qs, ks = (w.batch, w.seq_len, w.n_heads, w.head_dim), (w.batch, w.seq_len, w.n_kv_heads, w.head_dim)
    arrays.setdefault("dout", np.random.default_rng(0).standard_normal(qs).astype(np.float32))
    for name, shape in (("q", qs), ("k", ks), ("v", ks), ("dout", qs)):
        if name not in arrays or tuple(arrays[name].shape) != shape:
            got = arrays[name].shape if name in arrays else "missing"
            raise UserError(f"{Path(path).name}: {name}", f"shape {got}, the schedule's workload needs {shape}",
                            "save q, k, v (and dout) in (B, S, H, D) with the schedule's sizes")
    dt = TORCH_DTYPE[w.dtype]
    return Inputs(*(torch.from_numpy(np.ascontiguousarray(arrays[n], dtype=np.float32)).to(dt)
                    for n in ("q", "k", "v", "dout")))


def allowed(w: Workload, q_pos: np.ndarray, k_pos: np.ndarray, mask: Mask | None = None) -> np.ndarray:
    """[len(q_pos), len(k_pos)] bool: the mask rule and padding (no padded key; no query row that is padding or
    in a cached prefix)."""
    ok = (mask or w.mask).permits(q_pos, k_pos)
    return ok & w.is_real(k_pos)[None, :] & w.is_query(q_pos)[:, None]


def attention_rows(inp: Inputs, w: Workload, rows: np.ndarray, h0: int, h1: int):
    """Single-process forward of query positions ``rows``, heads [h0, h1), against every key, in the input
    dtype. Returns (O [B, T, h, D] input dtype, LSE [B, h, T] fp32)."""
    g = w.gqa_group
    pos = np.arange(w.seq_len)
    ok = torch.from_numpy(allowed(w, rows, pos)).to(inp.q.device)
    idx = torch.from_numpy(rows).to(inp.q.device)
    q = inp.q[:, idx, h0:h1].transpose(1, 2)
    k = inp.k[:, :, h0 // g: -(-h1 // g)].transpose(1, 2)
    v = inp.v[:, :, h0 // g: -(-h1 // g)].transpose(1, 2)
    o, lse = block_forward(q.contiguous(), k.contiguous(), v.contiguous(), softmax_scale(w), ok)
    return o.transpose(1, 2), lse


def single_process(inp: Inputs, w: Workload, backward: bool) -> dict[str, torch.Tensor]:
    """The executor's own kernels on the whole sequence in one process (the 3× yardstick of docs/bugcases.md)."""
    pos = np.arange(w.seq_len)
    ok = torch.from_numpy(allowed(w, pos, pos))
    q, k, v, do = (t.transpose(1, 2).contiguous() for t in (inp.q, inp.k, inp.v, inp.dout))
    o, lse = block_forward(q, k, v, softmax_scale(w), ok)
    res = {"out": o.transpose(1, 2), "lse": lse}
    if backward:
        dq, dk, dv = block_backward_from_out(q, k, v, o, do, lse, softmax_scale(w), ok)
        dt = q.dtype
        res |= {"dq": dq.to(dt).transpose(1, 2), "dk": dk.to(dt).transpose(1, 2), "dv": dv.to(dt).transpose(1, 2)}
    return res


def reference(inp: Inputs, w: Workload, backward: bool) -> dict[str, torch.Tensor]:
    """Float64 attention (and gradients) on the dtype-rounded inputs, one head at a time."""
    pos = np.arange(w.seq_len)
    ok = torch.from_numpy(allowed(w, pos, pos))
    g, scale = w.gqa_group, softmax_scale(w)
    q, k, v, do = (t.double() for t in (inp.q, inp.k, inp.v, inp.dout))
    out, lse = torch.zeros_like(q), torch.zeros(w.batch, w.n_heads, w.seq_len, dtype=torch.float64)
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    for h in range(w.n_heads):
        qh, kh, vh, doh = q[:, :, h], k[:, :, h // g], v[:, :, h // g], do[:, :, h]       # [B, S, D]
        s = (qh @ kh.transpose(1, 2) * scale).masked_fill(~ok, float("-inf"))
        lse[:, h] = torch.logsumexp(s, dim=-1)
        p = torch.exp(s - lse[:, h, :, None].nan_to_num(neginf=0.0)).masked_fill(~ok, 0.0)
        out[:, :, h] = p @ vh
        if backward:
            ds = p * (doh @ vh.transpose(1, 2) - (doh * out[:, :, h]).sum(-1, keepdim=True))
            dq[:, :, h] = ds @ kh * scale
            dk[:, :, h // g] += ds.transpose(1, 2) @ qh * scale
            dv[:, :, h // g] += p.transpose(1, 2) @ doh
    res = {"out": out, "lse": lse}
    return res | ({"dq": dq, "dk": dk, "dv": dv} if backward else {})
