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


def reference_rows(q, k, v, dout, w: Workload, sample: Sample, scale: float) -> dict[str, torch.Tensor]:
    """Float64 results of the sampled triples: out [P, D], lse [P], dq [P, D], and dk, dv [B, S, Hkv, D] (the
    sampled rows' contributions); no gradients without ``dout``. Inputs [B, S, H(kv), D] in the input dtype."""
    g, P, f64 = w.gqa_group, len(sample), torch.float64
    res = {"out": torch.zeros(P, w.head_dim, dtype=f64), "lse": torch.full((P,), float("-inf"), dtype=f64)}
    if dout is not None:
        res |= {"dq": torch.zeros(P, w.head_dim, dtype=f64), "dk": torch.zeros(k.shape, dtype=f64),
                "dv": torch.zeros(v.shape, dtype=f64)}
    for b, h in sorted(set(zip(sample.b.tolist(), sample.head.tolist()))):
        at = np.flatnonzero((sample.b == b) & (sample.head == h))
        idx, sel = torch.from_numpy(sample.pos[at]), torch.from_numpy(at)
        ok = key_ranges(w, sample.pos[at]).dense("cpu")                                 # [r, S]
        qh, kh, vh = q[b, idx, h].double(), k[b, :, h // g].double(), v[b, :, h // g].double()
        s = (qh @ kh.T * scale).masked_fill(~ok, float("-inf"))
        lse = torch.logsumexp(s, dim=-1)
        p = torch.exp(s - lse.nan_to_num(neginf=0.0)[:, None]).masked_fill(~ok, 0.0)
        res["out"][sel], res["lse"][sel] = p @ vh, lse
        if dout is not None:
            do = dout[b, idx, h].double()
            ds = p * (do @ vh.T - (do * res["out"][sel]).sum(-1, keepdim=True))
            res["dq"][sel] = ds @ kh * scale
            res["dk"][b, :, h // g] += ds.T @ qh * scale
            res["dv"][b, :, h // g] += p.T @ do
    return res


def one_process_rows(q, k, v, dout, w: Workload, sample: Sample, scale: float) -> dict[str, torch.Tensor]:
    """The one-process yardstick of :func:`reference_rows` (same keys and shapes, float64 holding the input
    dtype's values): each sampled row by the executor's kernels in the input dtype, one unmasked kernel over its
    run of keys; dK and dV summed in the input dtype, row after row in position order — as one kernel over
    many rows sums them, a running sum rounded to the input dtype per block of rows (timed against torch's CPU
    flash backward: that rounding, not the float64 difference of each row, is a half-precision run's dK/dV
    error), so the yardstick carries it."""
    g, P, f64 = w.gqa_group, len(sample), torch.float64
    res = {"out": torch.zeros(P, w.head_dim, dtype=f64), "lse": torch.full((P,), float("-inf"), dtype=f64)}
    if dout is not None:
        res |= {"dq": torch.zeros(P, w.head_dim, dtype=f64)}
        dk, dv = torch.zeros(k.shape, dtype=k.dtype), torch.zeros(v.shape, dtype=v.dtype)
    ranges = key_ranges(w, sample.pos)
    for i in np.argsort(sample.pos, kind="stable").tolist():
        lo, hi = int(ranges.lo[i]), int(ranges.hi[i])
        if hi <= lo:                                 # no permitted key: O = 0, LSE = −inf, nothing else
            continue
        b, pos, h = int(sample.b[i]), int(sample.pos[i]), int(sample.head[i])
        qi, ki, vi = q[b, pos, h][None, None, None], k[b, lo:hi, h // g][None, None], v[b, lo:hi, h // g][None, None]
        o, lse = block_forward(qi, ki, vi, scale, None)
        res["out"][i], res["lse"][i] = o[0, 0, 0].double(), lse[0, 0, 0].double()
        if dout is not None:
            dq, dk_i, dv_i = block_backward_from_out(qi, ki, vi, o, dout[b, pos, h][None, None, None], lse, scale, None)
            res["dq"][i] = dq[0, 0, 0].to(q.dtype).double()
            dk[b, lo:hi, h // g] += dk_i[0, 0].to(k.dtype)
            dv[b, lo:hi, h // g] += dv_i[0, 0].to(v.dtype)
    if dout is not None:
        res |= {"dk": dk.double(), "dv": dv.double()}
    return res
