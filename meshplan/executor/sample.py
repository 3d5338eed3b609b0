"""The sampled numerics check: a few (batch, query row, head) triples per rank, recomputed in float64.

The full check (:func:`~meshplan.executor.data.reference`) costs O(S²) in float64 and memory, so a run above
``FULL_CHECK_FLOPS`` checks a sample instead, at a cost of O(P·S·D) for P triples, whatever the size:

* **rows**: for every rank, ``rows`` triples drawn uniformly from the query rows it returns (its output
  tensors' tokens and heads), a quarter more from its padding rows when it holds any; their O, LSE and dQ
  are recomputed in float64 against every key and value under the mask (O(S·D) each);
* **gradients** are linear in dO, so the run's check iteration takes dO = 0 everywhere but on the sampled
  triples (:meth:`Sample.masked_dout`): then its dK and dV are exactly the sampled rows' contributions, which
  the reference sums in O(P·S·D), and dQ of every other (row, head) is exactly 0;
* **padding** rows (and rows with no permitted key) must hold O = 0 and LSE = −inf: checked on every row,
  sampled or not (no reference needed).

The same criterion as the full check (BUGCASES.md): the ∞-norm error at most max(floor, 3 × the error of one
process in the same dtype on the same triples). A wrong KV chunk, a missing or doubled block, a bad merge or a
padding row computed as real moves the sampled rows' results (or their contributions) by orders of magnitude
more; a fault confined to rows outside the sample is caught only in dK/dV (every sampled row's contribution
is summed over every key) or not at all — the full check (``run --check``) has no such gap.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from meshplan.blockmask import KeyRanges
from meshplan.executor.kernels import block_backward_from_out, block_forward
from meshplan.executor.program import Program
from meshplan.workload import Workload

FULL_CHECK_FLOPS = 2e10          # the float64 reference of the whole sequence up to this: seconds on a CPU
SAMPLE_FLOPS = 2e10              # the sampled reference's budget (float64 FLOPs over all triples)
ROWS_PER_RANK = (4, 32)          # triples per rank: at least, at most (padding rows: a quarter more)


@dataclass(frozen=True)
class Sample:
    """Sampled triples, sorted: batch index ``b``, token position ``pos``, query head ``head`` (int64 [P])."""

    b: np.ndarray
    pos: np.ndarray
    head: np.ndarray

    def __len__(self) -> int:
        return len(self.pos)

    def masked_dout(self, dout: torch.Tensor) -> torch.Tensor:
        """dO [B, S, H, D] with every (batch, row, head) outside the sample set to 0."""
        keep = torch.zeros(dout.shape[:3], dtype=torch.bool)
        keep[torch.from_numpy(self.b), torch.from_numpy(self.pos), torch.from_numpy(self.head)] = True
        return dout * keep.to(dout.device)[..., None].to(dout.dtype)


def check_mode(w: Workload, requested: bool | str | None) -> str:
    """``full`` | ``sampled`` | ``off``: ``--check`` (True) is full, ``--no-check`` (False) off; by default full
    when the float64 reference of the whole sequence costs at most ``FULL_CHECK_FLOPS``, else sampled."""
    if requested in ("full", "sampled", "off"):
        return requested
    if requested is True:
        return "full"
    if requested is False:
        return "off"
    flops = 4.0 * w.batch * w.n_heads * w.head_dim * float(w.seq_len) ** 2 * (3.5 if "bwd" in w.pass_list else 1)
    return "full" if flops <= FULL_CHECK_FLOPS else "sampled"


def held_rows(prog: Program, rank: int) -> list[tuple[np.ndarray, int, int]]:
    """The query rows rank ``rank`` returns: (positions, h0, h1) per output tensor of O (else of dQ)."""
    for kind in ("out", "dq"):
        got = [(prog.tokens_of(t.kind, t.chunks), t.heads[0], t.heads[1]) for t in prog.doc.tensors
               if t.rank == rank and t.role == "output" and t.kind == kind]
        if got:
            return got
    return []


def pick_sample(prog: Program, seed: int) -> Sample:
    """Triples for every rank (the same on every rank: drawn from ``seed``), see the module docstring."""
    w = prog.workload
    rng = np.random.default_rng([seed, 2718])
    cost = 4.0 * (3.5 if "bwd" in w.pass_list else 1.0) * w.seq_len * w.head_dim
    lo, hi = ROWS_PER_RANK
    per_rank = int(np.clip(SAMPLE_FLOPS / (cost * prog.n_ranks), lo, hi))
    picks: list[tuple[int, int, int]] = []
    for rank in range(prog.n_ranks):
        held = held_rows(prog, rank)
        if not held:
            continue
        pos = np.concatenate([p for p, _, _ in held])
        h0 = np.concatenate([np.full(len(p), a) for p, a, _ in held])
        width = np.concatenate([np.full(len(p), b - a) for p, a, b in held])
        real = w.is_real(pos)
        for rows, k in ((np.flatnonzero(real), per_rank), (np.flatnonzero(~real), -(-per_rank // 4))):
            for i in rng.choice(rows, size=min(k, len(rows)), replace=False) if len(rows) else ():
                picks.append((int(rng.integers(w.batch)), int(pos[i]), int(h0[i] + rng.integers(width[i]))))
    arr = np.unique(np.asarray(picks, dtype=np.int64).reshape(-1, 3), axis=0)
    return Sample(arr[:, 0], arr[:, 1], arr[:, 2])


def key_ranges(w: Workload, rows: np.ndarray) -> KeyRanges:
    """Per query position in ``rows``, its run of permitted keys among all S positions: the mask, padding keys
    left out, none for a padding row or a row of a cached prefix."""
    lo, hi = w.mask.key_ranges(rows, np.arange(w.seq_len))
    hi = np.minimum(hi, w.n_valid)
    hi = np.where(w.is_query(rows), np.maximum(hi, lo), lo)
    return KeyRanges(lo, hi, w.seq_len)


def sampled_results(q, k, v, dout, w: Workload, sample: Sample, scale: float, reference: bool):
    """The sampled triples' results: out [P, D], lse [P], dq [P, D], and dk, dv [B, S, Hkv, D] (the sampled
    rows' contributions; None without dO). ``reference``: float64 attention; else the executor's kernels in the
    input dtype (the one-process yardstick). Inputs [B, S, H(kv), D] in the input dtype, ``dout`` the full one."""
    g, P = w.gqa_group, len(sample)
    f64 = torch.float64
    out = torch.zeros(P, w.head_dim, dtype=f64)
    lse = torch.full((P,), float("-inf"), dtype=f64)
    dq = torch.zeros(P, w.head_dim, dtype=f64)
    grads = dout is not None
    dk = torch.zeros(k.shape, dtype=f64) if grads else None
    dv = torch.zeros(v.shape, dtype=f64) if grads else None
    for b, h in sorted(set(zip(sample.b.tolist(), sample.head.tolist()))):
        at = np.flatnonzero((sample.b == b) & (sample.head == h))
        rows = sample.pos[at]
        ranges = key_ranges(w, rows)
        idx = torch.from_numpy(rows)
        qh, kh, vh = q[b, idx, h], k[b, :, h // g], v[b, :, h // g]                    # [r, D], [S, D]
        doh = dout[b, idx, h] if grads else None
        fn = _float64 if reference else _kernels
        o, l_, dqh, dkh, dvh = fn(qh, kh, vh, doh, ranges, scale)
        sel = torch.from_numpy(at)
        out[sel], lse[sel] = o.double(), l_.double()
        if grads:
            dq[sel] = dqh.double()
            dk[b, :, h // g] += dkh.double()
            dv[b, :, h // g] += dvh.double()
    if grads and not reference:                  # one process returns its summed gradients in the input dtype
        dk, dv = dk.to(k.dtype).double(), dv.to(v.dtype).double()
    return {"out": out, "lse": lse} | ({"dq": dq, "dk": dk, "dv": dv} if grads else {})


def _float64(q, k, v, do, ranges: KeyRanges, scale: float):
    """Float64 attention of rows q [r, D] against k, v [S, D] (and the rows' gradient contributions)."""
    q, k, v = q.double(), k.double(), v.double()
    ok = ranges.dense("cpu")
    s = (q @ k.T * scale).masked_fill(~ok, float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - lse.nan_to_num(neginf=0.0)[:, None]).masked_fill(~ok, 0.0)
    o = p @ v
    if do is None:
        return o, lse, None, None, None
    do = do.double()
    ds = p * (do @ v.T - (do * o).sum(-1, keepdim=True))
    return o, lse, ds @ k * scale, ds.T @ q * scale, p.T @ do


def _kernels(q, k, v, do, ranges: KeyRanges, scale: float):
    """The same with the executor's kernels in the input dtype (fp32 gradients)."""
    q4, k4, v4 = (x[None, None] for x in (q, k, v))
    o, lse = block_forward(q4, k4, v4, scale, ranges)
    if do is None:
        return o[0, 0], lse[0, 0], None, None, None
    dq, dk, dv = block_backward_from_out(q4, k4, v4, o, do[None, None], lse, scale, ranges)
    return o[0, 0], lse[0, 0], dq[0, 0].to(q.dtype), dk[0, 0], dv[0, 0]
