"""Gather the distributed results, judge them against the float64 reference, and dump them.

Criterion (BUGCASES.md), per tensor (out, lse, dq, dk, dv): the ∞-norm error against the float64
reference, over real tokens (real query rows for out, lse, dq — not padding, not a cached prefix; real keys
for dk, dv), is at
most max(floor, 3 × the single-process error in the same dtype), floor = ε·max|reference| with ε = 2⁻⁸
(bf16), 2⁻¹¹ (fp16), 2⁻²⁰ (fp32). A lossy transport knob (partial outputs or dQ/dK/dV travelling in a dtype
coarser than the input's, e.g. ``--dkv-dtype bf16`` under fp16) is reported with its error rather than gated
by the 3× rule: that tensor's floor takes the coarsest dtype its partials travelled in.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import numpy as np
import torch

from meshplan.executor.data import Inputs, reference, single_process, softmax_scale
from meshplan.executor.program import Program
from meshplan.measurement import Numerics, TensorError

EPSILON = {"bf16": 2.0 ** -8, "fp16": 2.0 ** -11, "fp32": 2.0 ** -20}
RESULT_PARTS = {"out": ("o", "lse"), "dq": ("dq",), "dkv": ("dk", "dv")}
NAMES = {"o": "out", "lse": "lse", "dq": "dq", "dk": "dk", "dv": "dv"}


def local_results(prog: Program, rank: int, stores: dict[str, object], dtype: torch.dtype) -> list[tuple]:
    """The rank's output tensors as (name, positions, h0, h1, float32 numpy array), final values rounded to
    the input dtype (LSE stays fp32)."""
    out = []
    for t in prog.doc.tensors:
        if t.rank != rank or t.role != "output" or t.kind not in RESULT_PARTS:
            continue
        parts = stores[t.pass_].data.get(t.id)
        if parts is None:
            continue
        pos = prog.tokens_of(t.kind, t.chunks)
        for part in RESULT_PARTS[t.kind]:
            x = parts[part]
            x = x.float() if part == "lse" else x.to(dtype).float()
            out.append((NAMES[part], pos, t.heads[0], t.heads[1], x.cpu().numpy()))
    return out


def assemble(prog: Program, pieces: list[tuple]) -> dict[str, np.ndarray]:
    """Global results in natural token order from every rank's pieces.

    Raises:
        ValueError: a (token, head) covered twice, or not at all, by the schedule's outputs.
    """
    w, g = prog.workload, prog.workload.gqa_group
    shapes = {"out": (w.batch, w.seq_len, w.n_heads, w.head_dim), "lse": (w.batch, w.n_heads, w.seq_len),
              "dq": (w.batch, w.seq_len, w.n_heads, w.head_dim), "dk": (w.batch, w.seq_len, w.n_kv_heads, w.head_dim),
              "dv": (w.batch, w.seq_len, w.n_kv_heads, w.head_dim)}
    res, seen = {}, {}
    for name, pos, h0, h1, x in pieces:
        if name not in res:
            res[name] = np.zeros(shapes[name], dtype=np.float32)
            seen[name] = np.zeros((w.seq_len, shapes[name][2 if name != "lse" else 1]), dtype=np.int32)
        heads = slice(h0 // g, -(-h1 // g)) if name in ("dk", "dv") else slice(h0, h1)
        if name == "lse":
            res[name][:, heads][:, :, pos] = x
        else:
            res[name][:, pos, heads] = x
        seen[name][pos, heads] += 1
    held = np.arange(w.seq_len) >= w.prefix_len      # query-side results exist outside a cached prefix
    for name, count in seen.items():
        expect = np.ones_like(count) if name in ("dk", "dv") else held[:, None].astype(count.dtype)
        if (count != expect).any():
            t, h = np.argwhere(count != expect)[0]
            raise ValueError(f"the schedule's outputs cover {name} of token {t}, head {h} {count[t, h]} times")
    return res


def judge(prog: Program, inputs: Inputs, results: dict[str, np.ndarray]) -> Numerics:
    """The criterion for every gathered tensor; ``passed`` only if all pass."""
    w = prog.workload
    backward = "dq" in results
    ref = reference(inputs, w, backward)
    one = single_process(inputs, w, backward)
    pos = np.arange(w.seq_len)
    keys, rows = w.is_real(pos), w.is_query(pos)
    wire = wire_epsilon(prog)
    tensors = {}
    for name, got in results.items():
        r, s = ref[name].numpy(), one[name].double().numpy()
        valid = keys if name in ("dk", "dv") else rows
        if name == "lse":
            r, s, got = r[:, :, valid], s[:, :, valid], got[:, :, valid]
        else:
            r, s, got = r[:, valid], s[:, valid], got[:, valid]
        floor = max(EPSILON[w.dtype], wire.get(name, 0.0)) * float(np.abs(r).max(initial=0.0))
        err = np.abs(got.astype(np.float64) - r)
        single = float(np.abs(s - r).max(initial=0.0))
        bound = max(floor, 3 * single)
        worst = float(err.max(initial=0.0)) if np.isfinite(err).all() else float("inf")
        tensors[name] = TensorError(max_abs_err=worst, mean_abs_err=float(err.mean()) if err.size else 0.0,
                                    single_process_err=single, floor=floor, bound=bound, passed=worst <= bound)
    return Numerics(checked=True, passed=all(t.passed for t in tensors.values()), tensors=tensors,
                    reference="float64 single-process attention on the dtype-rounded inputs (BUGCASES.md)")


def wire_epsilon(prog: Program) -> dict[str, float]:
    """Result name -> ε of the coarsest dtype that tensor's partials travel in (sends of ``out``, ``dq`` and
    ``dkv`` tensors; LSE always travels in fp32)."""
    got: dict[str, float] = {}
    for r in prog.doc.ranks:
        for op in r.ops:
            if op.kind != "send":
                continue
            for part in RESULT_PARTS.get(prog.tensors[op.tensor].kind, ()):
                if part != "lse":
                    got[NAMES[part]] = max(got.get(NAMES[part], 0.0), EPSILON[op.dtype])
    return got


def dump(path: str | Path, prog: Program, inputs: Inputs, results: dict[str, np.ndarray]) -> None:
    """``run --dump DIR``: inputs and results as float32 .npy in natural order, and meta.json; each file is
    written to a temporary directory first and moved into place, so a failure leaves no half-written file."""
    w = prog.workload
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=path, prefix=".dump-"))
    try:
        arrays = {"q": inputs.q, "k": inputs.k, "v": inputs.v, "dout": inputs.dout}
        for name, t in arrays.items():
            np.save(tmp / f"{name}.npy", t.float().cpu().numpy())
        for name, x in results.items():
            np.save(tmp / f"{name}.npy", x.astype(np.float32))
        meta = {"softmax_scale": softmax_scale(w), "mask": w.mask.spec(), "valid_len": w.n_valid,
                "seq_len": w.seq_len, "dtype": w.dtype, "layout": w.layout, "algorithm": prog.doc.algorithm,
                "shapes": "q, dout, out, dq: (B, S, H, D); k, v, dk, dv: (B, S, Hkv, D); lse: (B, H, S)",
                "order": "natural token order (the layout's permutation undone)", "schedule_sha256": prog.sha256}
        (tmp / "meta.json").write_text(json.dumps(meta, indent=1))
        for f in tmp.iterdir():
            os.replace(f, path / f.name)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
