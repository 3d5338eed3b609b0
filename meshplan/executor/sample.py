"""The sampled numerics check: a few (batch, query row, head) triples per rank, recomputed in float64.

The full check (:func:`~meshplan.executor.data.reference`) costs O(S²) in float64 and memory and gathers every
result on rank 0, so a run above ``FULL_CHECK_FLOPS`` checks a sample instead, on every rank at once and with
nothing gathered but the errors, at O(P·S·D / N) per rank for P triples on N ranks, whatever the size:

* **rows**: for every rank, up to ``ROWS_PER_RANK`` triples drawn uniformly from the query rows it returns (its
  output tensors' tokens and heads), a quarter more from its padding rows when it holds any; the rank that
  returns a row recomputes its O, LSE and dQ in float64 against every key and value under the mask (O(S·D)
  each, :func:`row_stats`), and the ranks exchange each row's LSE and D = rowsum(dO ∘ O);
* **gradients** are linear in dO, so the run's check iteration takes dO = 0 everywhere but on the sampled
  triples (:meth:`Sample.masked_dout`): then its dK and dV are exactly the sampled rows' contributions, which
  each rank recomputes at the keys it returns from the rows' LSE and D (O(P·S·D / N), :func:`key_grads`), and
  dQ of every other (row, head) is exactly 0;
* **padding** rows (and rows with no permitted key) must hold O = 0 and LSE = −inf: checked on every row,
  sampled or not (no reference needed).

The same criterion as the full check (docs/bugcases.md): the ∞-norm error at most max(floor, 3 × the error of one
process in the same dtype on the same triples). A wrong KV chunk, a missing or doubled block, a bad merge or a
padding row computed as real moves the sampled rows' results (or their contributions) by orders of magnitude
more; a fault confined to rows outside the sample is caught only in dK/dV (every sampled row's contribution
is summed over every key) or not at all — the full check (``run --check``) has no such gap.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from meshplan.executor.kernels import block_backward, block_backward_from_out, block_forward
from meshplan.executor.program import Program
from meshplan.model.blockmask import KeyRanges
from meshplan.model.workload import Workload

FULL_CHECK_FLOPS = 2e10          # the float64 reference of the whole sequence up to this: seconds on a CPU
SAMPLE_FLOPS = 2e10              # the sampled reference's budget (float64 FLOPs over all triples)
ROWS_PER_RANK = (4, 32)          # triples per rank: at least, at most (padding rows: a quarter more)


@dataclass(frozen=True)
class Sample:
    """Sampled triples, sorted: batch index ``b``, token position ``pos``, query head ``head``, and the rank that
    returns that row (``owner``; it computes the row's reference), each int64 [P]."""

    b: np.ndarray
    pos: np.ndarray
    head: np.ndarray
    owner: np.ndarray

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
                picks.append((int(rng.integers(w.batch)), int(pos[i]), int(h0[i] + rng.integers(width[i])), rank))
    arr = np.unique(np.asarray(picks, dtype=np.int64).reshape(-1, 4), axis=0)
    return Sample(arr[:, 0], arr[:, 1], arr[:, 2], arr[:, 3])


def key_ranges(w: Workload, rows: np.ndarray) -> KeyRanges:
    """Per query position in ``rows``, its run of permitted keys among all S positions: the mask, padding keys
    left out, none for a padding row or a row of a cached prefix."""
    lo, hi = w.mask.key_ranges(rows, np.arange(w.seq_len))
    hi = np.minimum(hi, w.n_valid)
    hi = np.where(w.is_query(rows), np.maximum(hi, lo), lo)
    return KeyRanges(lo, hi, w.seq_len)


@dataclass
class RowStats:
    """What every rank needs of the sampled rows (float64, one entry per triple, NaN where not computed): out
    [P, D], lse [P], and with a backward dq [P, D] and delta [P] (D = rowsum(dO ∘ O))."""

    out: np.ndarray
    lse: np.ndarray
    dq: np.ndarray | None
    delta: np.ndarray | None

    @classmethod
    def empty(cls, P: int, D: int, backward: bool) -> RowStats:
        nan = lambda *shape: np.full(shape, np.nan)  # noqa: E731
        return cls(nan(P, D), nan(P), nan(P, D) if backward else None, nan(P) if backward else None)

    def fill(self, other: RowStats, which: np.ndarray) -> None:
        """Take ``other``'s entries of the triples ``which`` (bool [P])."""
        for name in ("out", "lse", "dq", "delta"):
            mine, theirs = getattr(self, name), getattr(other, name)
            if mine is not None:
                mine[which] = theirs[which]


def row_stats(q, k, v, dout, w: Workload, sample: Sample, scale: float, reference: bool,
              which: np.ndarray | None = None) -> RowStats:
    """The sampled rows' results against every key (O(S·D) each), for the triples ``which`` (default all).

    ``reference``: float64 attention. Otherwise the one-process yardstick: each row by the executor's kernels in
    the input dtype, one unmasked kernel over its run of keys, results rounded to the input dtype. Inputs
    [B, S, H(kv), D] in the input dtype; ``dout`` None for a forward only."""
    g, P = w.gqa_group, len(sample)
    res = RowStats.empty(P, w.head_dim, dout is not None)
    which = np.ones(P, dtype=bool) if which is None else which
    ranges = key_ranges(w, sample.pos)
    for i in np.flatnonzero(which).tolist():
        b, pos, h = int(sample.b[i]), int(sample.pos[i]), int(sample.head[i])
        lo, hi = int(ranges.lo[i]), int(ranges.hi[i])
        if hi <= lo:                                 # no permitted key: O = 0, LSE = −inf, nothing else
            res.out[i], res.lse[i] = 0.0, -np.inf
            if dout is not None:
                res.dq[i], res.delta[i] = 0.0, 0.0
            continue
        qi, ki, vi = q[b, pos, h][None, None, None], k[b, lo:hi, h // g][None, None], v[b, lo:hi, h // g][None, None]
        do = None if dout is None else dout[b, pos, h][None, None, None]
        o, lse, dq = (_float64_row if reference else _kernel_row)(qi, ki, vi, do, scale)
        res.out[i], res.lse[i] = o.numpy(), float(lse)
        if dout is not None:
            res.dq[i] = dq.numpy()
            res.delta[i] = float((do.double() * o).sum())
    return res


def _float64_row(q, k, v, do, scale: float):
    """One row [1, 1, 1, D] against its keys [1, 1, n, D] in float64: (O [D], LSE, dQ [D] or None)."""
    q, k, v = q[0, 0].double(), k[0, 0].double(), v[0, 0].double()
    s = q @ k.T * scale                                                          # [1, n]
    lse = torch.logsumexp(s, dim=-1)
    p = torch.exp(s - lse[:, None])
    o = p @ v
    if do is None:
        return o[0], lse[0], None
    do = do[0, 0].double()
    ds = p * (do @ v.T - (do * o).sum(-1, keepdim=True))
    return o[0], lse[0], (ds @ k * scale)[0]


def _kernel_row(q, k, v, do, scale: float):
    """The same by the executor's kernels in the input dtype (O and dQ rounded to it)."""
    o, lse = block_forward(q, k, v, scale, None)
    if do is None:
        return o[0, 0, 0].double(), lse[0, 0, 0].double(), None
    dq, _, _ = block_backward_from_out(q, k, v, o, do, lse, scale, None)
    return o[0, 0, 0].double(), lse[0, 0, 0].double(), dq[0, 0, 0].to(q.dtype).double()


def key_grads(q, k, v, dout, w: Workload, sample: Sample, stats: RowStats, keys: np.ndarray, scale: float,
              reference: bool) -> tuple[np.ndarray, np.ndarray]:
    """dK and dV [B, K, Hkv, D] (float64 holding the values) at the key positions ``keys`` (ascending): the sampled
    rows' contributions (dO is zero elsewhere), from each row's final LSE and D (``stats``), in O(P·K·D).

    ``reference``: float64. Otherwise the one-process yardstick: each row's contribution by the executor's
    kernels (the backward from D), summed in the input dtype row after row in position order — as one kernel
    over many rows sums them, a running sum rounded to the input dtype per block of rows (timed against torch's
    CPU flash backward: that rounding, not each row's own error, is a half-precision run's dK/dV error)."""
    g = w.gqa_group
    shape = (w.batch, len(keys), w.n_kv_heads, w.head_dim)
    dk = np.zeros(shape) if reference else torch.zeros(shape, dtype=k.dtype)
    dv = np.zeros(shape) if reference else torch.zeros(shape, dtype=v.dtype)
    ranges = key_ranges(w, sample.pos)
    first = np.searchsorted(keys, ranges.lo)                 # the permitted keys among ``keys``: one run each
    last = np.searchsorted(keys, ranges.hi)
    kpos = torch.from_numpy(keys)
    for i in np.argsort(sample.pos, kind="stable").tolist():
        a, z = int(first[i]), int(last[i])
        if z <= a or not np.isfinite(stats.lse[i]):
            continue
        b, pos, h = int(sample.b[i]), int(sample.pos[i]), int(sample.head[i])
        kk, vv = k[b, kpos[a:z], h // g], v[b, kpos[a:z], h // g]                  # [n, D]
        if reference:
            qi, do, kk, vv = q[b, pos, h].double(), dout[b, pos, h].double(), kk.double(), vv.double()
            p = torch.exp(kk @ qi * scale - stats.lse[i])                           # [n]
            ds = p * (vv @ do - stats.delta[i])
            dk[b, a:z, h // g] += (ds[:, None] * qi[None, :] * scale).numpy()
            dv[b, a:z, h // g] += (p[:, None] * do[None, :]).numpy()
            continue
        lse = torch.tensor([[[stats.lse[i]]]], dtype=torch.float32)
        delta = torch.tensor([[[stats.delta[i]]]], dtype=torch.float32)
        _, dk_i, dv_i = block_backward(q[b, pos, h][None, None, None], kk[None, None], vv[None, None],
                                       dout[b, pos, h][None, None, None], lse, delta, scale, None)
        dk[b, a:z, h // g] += dk_i[0, 0].to(k.dtype)
        dv[b, a:z, h // g] += dv_i[0, 0].to(v.dtype)
    return (dk, dv) if reference else (dk.double().numpy(), dv.double().numpy())
