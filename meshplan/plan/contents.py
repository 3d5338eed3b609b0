"""What a transfer or a fold carries (part of the verifier, :mod:`meshplan.plan.verify`).

A recv's tensor must hold what its send moves — the same kind and heads, the same chunks in the same order (a
packed send's parts concatenated) — and a ``merge``/``accumulate`` with several outputs must give each output its
own chunks of the one input. Chunk sequences are compared by a polynomial hash of their ids (mod 2^64), one
number per tensor, so the check is a few array operations however many transfers there are.
"""

from __future__ import annotations

import numpy as np

from meshplan.plan.schedule import KIND, SEND, Schedule


def check_contents(s: Schedule, partner: np.ndarray) -> list[str]:
    """What lands is what was sent, and a fold writes what it reads: a recv's tensor has the kind, heads and chunks
    (in order) of its send's payload — the tensor, or a packed send's parts concatenated (parts of one kind and
    heads, ``tensor`` the first) — and a merge's or accumulate's outputs, their chunks in order, are its input's
    chunks, of its kind, holding its heads (the first output's heads are checked; a multi-output fold's outputs
    share them). Chunk sequences are compared by a polynomial hash (mod 2^64)."""
    o, t = s.ops, s.tensors
    out: list[str] = []
    h, n_ch = _chunk_hashes(t)
    sig = lambda a, b: (t.kind[a] != t.kind[b]) | (t.h0[a] != t.h0[b]) | (t.h1[a] != t.h1[b])  # noqa: E731
    sends = np.flatnonzero((o.kind == SEND) & (partner >= 0))
    payload = h[o.tensor[sends]].copy()
    n_parts = np.diff(o.in_ptr)[sends]
    for k in np.flatnonzero(n_parts > 0):
        op = sends[k]
        parts = o.inputs[o.in_ptr[op]:o.in_ptr[op + 1]]
        if parts[0] != o.tensor[op] or sig(parts[0], parts[1:]).any():
            out.append(f"op {op}: a packed send's parts must start with its tensor and share its kind and heads")
    if (n_parts > 0).any():                              # fold the parts' hashes: H(A‖B) = H(A)·P^|B| + H(B)
        payload[n_parts > 0] = _concat_hash(o.in_ptr, o.inputs, sends[n_parts > 0], h, n_ch)
    landed = o.tensor[partner[sends]]
    bad = sig(o.tensor[sends], landed) | (payload != h[landed])
    out += [f"op {partner[sends[k]]}: lands tensor {landed[k]}, which is not what send op {sends[k]} moves (kind, "
            "heads or chunks differ)" for k in np.flatnonzero(bad)]
    folds = np.flatnonzero(((o.kind == KIND["merge"]) | (o.kind == KIND["accumulate"])) & (np.diff(o.in_ptr) == 1)
                           & (np.diff(o.out_ptr) >= 1))
    src = o.inputs[o.in_ptr[folds]]
    first = o.outputs[o.out_ptr[folds]]
    outside = (t.h0[src] < t.h0[first]) | (t.h1[src] > t.h1[first])      # a fold touches its input's heads
    bad = (t.kind[src] != t.kind[first]) | outside | (_concat_hash(o.out_ptr, o.outputs, folds, h, n_ch) != h[src])
    out += [f"op {folds[k]}: its outputs are not its input's chunks (in order), or not its kind, or lack its heads"
            for k in np.flatnonzero(bad)]
    odd = np.flatnonzero(((o.kind == KIND["merge"]) | (o.kind == KIND["accumulate"])) &
                         ((np.diff(o.in_ptr) != 1) | (np.diff(o.out_ptr) < 1)))
    out += [f"op {k}: a merge or accumulate reads one tensor into one or more" for k in odd]
    return out


_HASH_P = np.uint64(1_000_003)


def _chunk_hashes(t) -> tuple[np.ndarray, np.ndarray]:
    """([n_tensors] uint64 hash of each tensor's chunk sequence, [n_tensors] its length):
    H = Σ (c_i + 1)·P^(n−1−i) mod 2^64."""
    n_ch = np.diff(t.chunk_ptr)
    owner = np.repeat(np.arange(len(n_ch)), n_ch)
    pos = np.arange(len(t.chunks)) - t.chunk_ptr[owner]
    expo = n_ch[owner] - 1 - pos
    pw = _powers(int(n_ch.max(initial=1)))
    with np.errstate(over="ignore"):
        terms = (t.chunks.astype(np.uint64) + np.uint64(1)) * pw[expo]
    h = np.zeros(len(n_ch), dtype=np.uint64)
    np.add.at(h, owner, terms)
    return h, n_ch


def _powers(n: int) -> np.ndarray:
    pw = np.ones(max(n, 1) + 1, dtype=np.uint64)
    with np.errstate(over="ignore"):
        for i in range(1, len(pw)):
            pw[i] = pw[i - 1] * _HASH_P
    return pw


def _concat_hash(ptr: np.ndarray, ids: np.ndarray, ops: np.ndarray, h: np.ndarray, n_ch: np.ndarray) -> np.ndarray:
    """The hash of the chunk sequence of each op's listed tensors (CSR ``ptr``/``ids``) concatenated in order:
    H(A‖B) = H(A)·P^|B| + H(B)."""
    count = ptr[ops + 1] - ptr[ops]
    acc = np.zeros(len(ops), dtype=np.uint64)
    pw = _powers(int(n_ch.max(initial=1)))
    for k in range(int(count.max(initial=0))):
        on = count > k
        tid = ids[ptr[ops[on]] + k]
        with np.errstate(over="ignore"):
            acc[on] = acc[on] * pw[n_ch[tid]] + h[tid]
    return acc
