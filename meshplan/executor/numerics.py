"""Gather the distributed results, judge them against the float64 reference, and dump them.

Criterion (BUGCASES.md), per tensor (out, lse, dq, dk, dv): the ∞-norm error against the float64
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
from meshplan.executor.sample import Sample, one_process_rows, reference_rows
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


def judge(prog: Program, inputs: Inputs, results: dict[str, np.ndarray], mode: str = "full",
          sample: Sample | None = None) -> Numerics:
    """The criterion for every gathered tensor; ``passed`` only if all pass.

    ``mode`` ``full``: against the float64 reference of the whole sequence, on every row a rank returns (padding
    rows included: O = 0, LSE = −inf, dQ = 0) and every key. ``sampled``: the triples of ``sample``, the run's
    results taken with dO zero outside them (:mod:`meshplan.executor.sample`); every other returned row is held
    to what needs no reference (padding rows O = 0 and LSE = −inf; dQ = 0 wherever dO was 0).
    """
    w = prog.workload
    backward = "dq" in results
    held = np.arange(w.seq_len) >= w.prefix_len        # rows the ranks return (a cached prefix's are not)
    if mode == "full":
        ref, one = reference(inputs, w, backward), single_process(inputs, w, backward)
        tally = {name: _Tally() for name in results}
        for name, got in results.items():
            r, s1 = ref[name].numpy(), one[name].double().numpy()
            if name == "lse":
                rows = (slice(None), slice(None), held)                # [B, H, S]
            else:
                rows = (slice(None), slice(None) if name in ("dk", "dv") else held)   # [B, S, H, D]: every key
            tally[name].add(got[rows], r[rows], s1[rows])
        how = "float64 single-process attention on the dtype-rounded inputs (BUGCASES.md), every returned row"
    else:
        tally = _sampled(prog, inputs, results, sample, held)
        how = (f"float64 attention of {len(sample)} sampled (batch, row, head) triples against every key, with dO "
               "zero outside them (dK, dV: their contributions); padding rows O = 0, LSE = -inf; dQ = 0 elsewhere")
    eps = EPSILON[w.dtype]
    wire = wire_epsilon(prog)
    tensors = {name: t.error(max(eps, wire.get(name, 0.0))) for name, t in tally.items()}
    return Numerics(checked=mode, passed=all(t.passed for t in tensors.values()), tensors=tensors, reference=how,
                    sampled_triples=len(sample) if mode == "sampled" else None)


def _sampled(prog: Program, inputs: Inputs, results: dict[str, np.ndarray], sample: Sample,
             held: np.ndarray) -> dict[str, _Tally]:
    """Per tensor, the sampled triples against the float64 reference and what holds without one."""
    w = prog.workload
    scale = softmax_scale(w)
    dout = inputs.dout if "dq" in results else None
    ref = reference_rows(inputs.q, inputs.k, inputs.v, dout, w, sample, scale)
    one = one_process_rows(inputs.q, inputs.k, inputs.v, dout, w, sample, scale)
    at = (sample.b, sample.pos, sample.head)
    empty = held & ~w.is_query(np.arange(w.seq_len))    # returned rows with no permitted key: padding
    tally = {name: _Tally() for name in results}
    for name in ("out", "lse", "dq"):
        if name not in results:
            continue
        got = results[name]
        pick = got[at[0], at[2], at[1]] if name == "lse" else got[at]
        tally[name].add(pick, ref[name].numpy(), one[name].numpy())
        rest = got.copy()                                # every other returned row: its value without a reference
        if name == "lse":
            rest[at[0], at[2], at[1]] = -np.inf
            rows = rest[:, :, empty]
            tally[name].add(rows, np.full_like(rows, -np.inf, dtype=np.float64), None)
            continue
        rest[at] = 0.0
        rows = rest[:, empty] if name == "out" else rest[:, held]   # O on padding rows, dQ everywhere else: 0
        tally[name].add(rows, np.zeros_like(rows, dtype=np.float64), None)
    for name in ("dk", "dv"):
        if name in results:
            tally[name].add(results[name], ref[name].numpy(), one[name].numpy())
    return tally


class _Tally:
    """The errors of one tensor over several comparisons: max and mean |error|, max |reference|, and the
    one-process error (where a comparison has a one-process result). Equal infinities (LSE = −inf on a row
    with no permitted key) are no error; a NaN is an infinite one."""

    def __init__(self) -> None:
        self.worst, self.total, self.count, self.ref_max, self.single = 0.0, 0.0, 0, 0.0, 0.0

    def add(self, got: np.ndarray, ref: np.ndarray, single: np.ndarray | None) -> None:
        err = _abs_err(got, ref)
        self.worst = max(self.worst, float(err.max(initial=0.0)))
        self.total += float(err[np.isfinite(err)].sum()) if err.size else 0.0
        self.count += err.size
        finite = ref[np.isfinite(ref)]
        self.ref_max = max(self.ref_max, float(np.abs(finite).max(initial=0.0)))
        if single is not None:
            self.single = max(self.single, float(_abs_err(single, ref).max(initial=0.0)))

    def error(self, eps: float) -> TensorError:
        floor = eps * self.ref_max
        bound = max(floor, 3 * self.single)
        return TensorError(max_abs_err=self.worst, mean_abs_err=self.total / max(self.count, 1),
                           single_process_err=self.single, floor=floor, bound=bound, passed=self.worst <= bound)


def _abs_err(got: np.ndarray, ref: np.ndarray) -> np.ndarray:
    """|got − ref| in float64; 0 where both are the same infinity, ∞ where either is NaN or one is infinite."""
    g = np.asarray(got, dtype=np.float64)
    with np.errstate(invalid="ignore"):
        err = np.abs(g - ref)
    err[g == ref] = 0.0
    err[np.isnan(err)] = np.inf
    return err


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
