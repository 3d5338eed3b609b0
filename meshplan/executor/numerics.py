"""Gather the distributed results, judge them against the float64 reference, and dump them.

Criterion (docs/bugcases.md), per tensor (out, lse, dq, dk, dv): the ∞-norm error against the float64
reference, over every row the ranks return (padding rows included: their O must be 0, their LSE −inf, their
dQ 0; a cached prefix's rows are not returned) and every key for dk, dv, is at
most max(floor, 3 × the single-process error in the same dtype), floor = ε·max|reference| with ε = 2⁻⁸
(bf16), 2⁻¹¹ (fp16), 2⁻²⁰ (fp32). Runs whose float64 reference would be costly check a sample of rows
instead (:mod:`meshplan.executor.sample`). A lossy transport knob (partial outputs or dQ/dK/dV travelling in a dtype
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
from meshplan.executor.sample import RowStats, Sample, key_grads, row_stats
from meshplan.executor.tally import Tally
from meshplan.plan.json.measurement import Numerics

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


def judge(prog: Program, inputs: Inputs, results: dict[str, np.ndarray], mode: str = "full",
          sample: Sample | None = None) -> Numerics:
    """The criterion for every gathered tensor (whole-sequence arrays); ``passed`` only if all pass.

    ``mode`` ``full``: against the float64 reference of the whole sequence, on every row a rank returns (padding
    rows included: O = 0, LSE = −inf, dQ = 0) and every key. ``sampled``: :func:`sampled_tallies` over the whole
    arrays as one piece each (what the ranks do on their own pieces in a run).
    """
    w = prog.workload
    backward = "dq" in results
    held = np.arange(w.seq_len) >= w.prefix_len        # rows the ranks return (a cached prefix's are not)
    if mode == "sampled":
        pieces = [(name, np.arange(w.seq_len) if name in ("dk", "dv") else np.flatnonzero(held), 0, w.n_heads,
                   x if name in ("dk", "dv") else x[:, :, held] if name == "lse" else x[:, held])
                  for name, x in results.items()]
        ref, one = sample_stats(inputs, w, sample, backward)
        return numerics_of(prog, sampled_tallies(prog, pieces, inputs, sample, ref, one), "sampled", len(sample))
    ref, one = reference(inputs, w, backward), single_process(inputs, w, backward)
    tally = {name: Tally() for name in results}
    for name, got in results.items():
        r, s1 = ref[name].numpy(), one[name].double().numpy()
        if name == "lse":
            rows = (slice(None), slice(None), held)                # [B, H, S]
        else:
            rows = (slice(None), slice(None) if name in ("dk", "dv") else held)   # [B, S, H, D]: every key
        tally[name].add(got[rows], r[rows], s1[rows])
    return numerics_of(prog, tally, "full")


def numerics_of(prog: Program, tally: dict[str, Tally], mode: str, triples: int | None = None) -> Numerics:
    """The Numerics of merged tallies: each tensor's bound from its dtype's ε (or a coarser wire dtype's)."""
    eps, wire = EPSILON[prog.workload.dtype], wire_epsilon(prog)
    tensors = {name: t.error(max(eps, wire.get(name, 0.0))) for name, t in tally.items()}
    how = ("float64 single-process attention on the dtype-rounded inputs (docs/bugcases.md), every returned row"
           if mode == "full" else
           f"float64 attention of {triples} sampled (batch, row, head) triples against every key, with dO zero outside "
           "them (dK, dV: their contributions, on every key); padding rows O = 0, LSE = -inf; dQ = 0 elsewhere")
    return Numerics(checked=mode, passed=all(t.passed for t in tensors.values()), tensors=tensors, reference=how,
                    sampled_triples=triples if mode == "sampled" else None)


def sample_stats(inputs: Inputs, w, sample: Sample, backward: bool, which: np.ndarray | None = None):
    """(float64, one-process) :class:`RowStats` of the sampled rows ``which`` (default all)."""
    dout = inputs.dout if backward else None
    args = (inputs.q, inputs.k, inputs.v, dout, w, sample, softmax_scale(w))
    return row_stats(*args, reference=True, which=which), row_stats(*args, reference=False, which=which)


def sampled_tallies(prog: Program, pieces: list[tuple], inputs: Inputs, sample: Sample, ref: RowStats,
                    one: RowStats) -> dict[str, Tally]:
    """The sampled check on result pieces (name, positions, h0, h1, float32 array — a rank's own, from
    :func:`local_results`): the sampled triples they hold against ``ref`` (float64) and ``one`` (the yardstick);
    padding rows O = 0 and LSE = −inf; dQ = 0 outside the sample; dK, dV at every key they hold against the
    sampled rows' float64 contributions (:func:`~meshplan.executor.sample.key_grads`)."""
    w, g = prog.workload, prog.workload.gqa_group
    tally: dict[str, Tally] = {}
    grads: dict[bytes, tuple] = {}
    for name, pos, h0, h1, x in pieces:
        t = tally.setdefault(name, Tally())
        if name in ("dk", "dv"):
            order = np.argsort(pos, kind="stable")
            key = pos.tobytes()
            if key not in grads:
                args = (inputs.q, inputs.k, inputs.v, inputs.dout, w, sample)
                grads[key] = (key_grads(*args, ref, pos[order], softmax_scale(w), True),
                              key_grads(*args, one, pos[order], softmax_scale(w), False))
            (rk, rv), (ok, ov) = grads[key]
            k0, k1 = h0 // g, -(-h1 // g)
            r_, o_ = (rk, ok) if name == "dk" else (rv, ov)
            t.add(x[:, order], r_[:, :, k0:k1], o_[:, :, k0:k1])
            continue
        tri, rows = _triples_in(sample, pos, h0, h1)
        lse = name == "lse"
        at = (sample.b[tri], sample.head[tri] - h0, rows) if lse else (sample.b[tri], rows, sample.head[tri] - h0)
        t.add(x[at], getattr(ref, name)[tri], getattr(one, name)[tri])
        rest = x.copy()                                # every other returned row: its value without a reference
        rest[at] = -np.inf if lse else 0.0
        pad = ~w.is_query(pos)
        if name == "lse":
            t.add_constant(rest[:, :, pad], -np.inf)                 # padding rows: LSE = −inf
        elif name == "out":
            t.add_constant(rest[:, pad], 0.0)                       # padding rows: O = 0
        else:
            t.add_constant(rest, 0.0)                               # dO was 0 there: dQ = 0
    return tally


def _triples_in(sample: Sample, pos: np.ndarray, h0: int, h1: int) -> tuple[np.ndarray, np.ndarray]:
    """(triple indices, their row indices in ``pos``) of the sampled triples a piece holds."""
    order = np.argsort(pos, kind="stable")
    idx = np.minimum(np.searchsorted(pos[order], sample.pos), max(len(pos) - 1, 0))
    hit = (len(pos) > 0) & (pos[order][idx] == sample.pos) & (sample.head >= h0) & (sample.head < h1)
    tri = np.flatnonzero(hit)
    return tri, order[idx[tri]]


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
