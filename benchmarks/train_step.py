"""One training step of a tiny transformer block with meshplan's drop-in attention on CPU ranks, against the
same model in one process (an example, not a timed benchmark).

``python benchmarks/train_step.py [--algo mesh] [--ranks 4] [--knob tile=2x2] [--seq-len 128]`` plans the
schedule in-process (``cpu-local``, causal, zigzag, fp32, fwd+bwd), spawns the ranks (gloo, loopback) and
runs embedding -> LayerNorm -> Q, K/V projections -> ``meshplan.executor.attention`` -> output projection
-> residual -> LM head -> next-token cross-entropy on each rank's chunk of the sequence. Each rank's loss is
its tokens' share of the global mean; the global loss and the parameter gradients are all-reduced (sum), as
data-parallel training would. Rank 0 compares them with the single-process model in float64 using torch's
``scaled_dot_product_attention(is_causal=True)`` and prints the errors; exit status 1 if the loss differs by
more than ``LOSS_RTOL`` relative or any gradient by more than ``GRAD_RTOL`` · max|its reference|.
"""

from __future__ import annotations

import argparse
import copy
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from meshplan.executor import attention, shard  # noqa: E402

LOSS_RTOL = 1e-5     # fp32 ranks against the float64 model
GRAD_RTOL = 1e-5


class Block(nn.Module):
    """A pre-norm attention block with token and position embeddings and an LM head; ``attend(q, k, v)``
    maps q [B, T, H, D], k, v [B, T, Hkv, D] to [B, T, H, D]."""

    def __init__(self, vocab: int, seq_len: int, heads: int, kv_heads: int, head_dim: int) -> None:
        super().__init__()
        width = heads * head_dim
        self.shape = (heads, kv_heads, head_dim)
        self.tok, self.pos = nn.Embedding(vocab, width), nn.Embedding(seq_len, width)
        self.norm = nn.LayerNorm(width)
        self.q, self.kv = nn.Linear(width, width), nn.Linear(width, 2 * kv_heads * head_dim)
        self.proj, self.head = nn.Linear(width, width), nn.Linear(width, vocab)

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, attend) -> torch.Tensor:
        """tokens, positions [B, T] -> logits [B, T, vocab]."""
        (b, t), (h, hkv, d) = tokens.shape, self.shape
        x = self.tok(tokens) + self.pos(positions)
        y = self.norm(x)
        q = self.q(y).view(b, t, h, d)
        k, v = self.kv(y).view(b, t, 2, hkv, d).unbind(2)
        return self.head(x + self.proj(attend(q, k, v).reshape(b, t, h * d)))


def sdpa_causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """Single-process causal attention (GQA by repeating KV heads), [B, S, H, D] in and out."""
    g = q.shape[2] // k.shape[2]
    q, k, v = q.transpose(1, 2), k.transpose(1, 2).repeat_interleave(g, 1), v.transpose(1, 2).repeat_interleave(g, 1)
    return F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2)


def data(prog, vocab: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Random tokens [B, S] and next-token targets (the last position ignored: -100)."""
    w = prog.workload
    tokens = torch.randint(vocab, (w.batch, w.seq_len), generator=torch.Generator().manual_seed(seed))
    targets = torch.cat([tokens[:, 1:], torch.full((w.batch, 1), -100)], dim=1)
    return tokens, targets


def rank_step(rank: int, world: int, payload: dict) -> dict | None:
    """One forward/backward on this rank's chunk; rank 0 returns the loss and gradient errors."""
    prog, vocab, init = payload["program"], payload["vocab"], payload["init"]
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))      # the ranks share this host's cores
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    try:
        w = prog.workload
        torch.manual_seed(0)                       # the same initial parameters on every rank
        model = Block(vocab, w.seq_len, w.n_heads, w.n_kv_heads, w.head_dim)
        tokens, targets = data(prog, vocab)
        positions = torch.arange(w.seq_len).expand(w.batch, -1)
        mine = [shard(x, prog, rank) for x in (tokens, targets, positions)]
        logits = model(mine[0], mine[2], lambda q, k, v: attention(q, k, v, prog))
        n_targets = int((targets != -100).sum())
        loss = F.cross_entropy(logits.flatten(0, 1), mine[1].flatten(), ignore_index=-100, reduction="sum") / n_targets
        loss.backward()
        total = loss.detach().clone()
        dist.all_reduce(total)
        for p in model.parameters():
            dist.all_reduce(p.grad)
        result = None
        if rank == 0:
            ref = copy.deepcopy(model).double()
            ref.zero_grad()
            ref_loss = F.cross_entropy(ref(tokens, positions, sdpa_causal).flatten(0, 1), targets.flatten(),
                                       ignore_index=-100)
            ref_loss.backward()
            grads = {name: (float((p.grad.double() - r.grad).abs().max()), float(r.grad.abs().max()))
                     for (name, p), r in zip(model.named_parameters(), ref.parameters())}
            result = {"loss": total.item(), "ref_loss": ref_loss.item(), "grads": grads}
        dist.barrier()           # tear the process group down together, not while rank 0 still computes
        return result
    finally:
        dist.destroy_process_group()


def plan_program(algo: str, ranks: int, knobs: dict, seq_len: int = 128, batch: int = 2, heads: int = 4,
                 kv_heads: int = 2, head_dim: int = 16):
    """Plan and schedule ``algo`` on ``ranks`` CPU ranks (cpu-local; causal, zigzag, fp32, fwd+bwd)."""
    from meshplan import algorithms
    from meshplan.executor.program import program_of
    from meshplan.model.topology import Topology
    from meshplan.model.workload import resolve

    w = resolve(seq_len=seq_len, batch=batch, heads=heads, kv_heads=kv_heads, head_dim=head_dim, dtype="fp32",
                mask="causal", layout="zigzag", passes="fwd+bwd")
    topo = Topology.load("cpu-local", gpus=ranks)
    alg = algorithms.get(algo)
    return program_of(alg.schedule(alg.plan(w, topo, ranks, alg.normalize(knobs)), topo))


def train_step(algo: str = "mesh", ranks: int = 4, knobs: dict | None = None, vocab: int = 64, **sizes) -> dict:
    """Spawn the ranks and run one step; the result of :func:`rank_step` with ``ok`` (within tolerance)."""
    from meshplan.executor.launch import free_port, spawn_ranks

    knobs = {"tile": "2x2" if ranks == 4 else "auto"} if knobs is None and algo == "mesh" else (knobs or {})
    prog = plan_program(algo, ranks, knobs, **sizes)
    res = spawn_ranks(rank_step, ranks, {"program": prog, "vocab": vocab,
                                         "init": f"tcp://127.0.0.1:{free_port()}"}, prefix="meshplan-train-")
    res["loss_rel_err"] = abs(res["loss"] - res["ref_loss"]) / abs(res["ref_loss"])
    res["ok"] = res["loss_rel_err"] <= LOSS_RTOL and all(e <= GRAD_RTOL * m for e, m in res["grads"].values())
    return res


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--algo", default="mesh")
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--knob", action="append", default=[], help="NAME=VALUE (mesh: tile=2x2 by default)")
    ap.add_argument("--seq-len", type=int, default=128)
    args = ap.parse_args()
    knobs = dict(k.split("=", 1) for k in args.knob) or None
    res = train_step(args.algo, args.ranks, knobs, seq_len=args.seq_len)
    print(f"{args.algo} on {args.ranks} CPU ranks: loss {res['loss']:.8f}, one process (float64) "
          f"{res['ref_loss']:.8f}, relative error {res['loss_rel_err']:.2e} (tolerance {LOSS_RTOL:g})")
    for name, (err, scale) in res["grads"].items():
        print(f"  grad {name:14s} max |error| {err:.2e}  max |grad| {scale:.2e}  (tolerance {GRAD_RTOL:g} x max)")
    print("gradients and loss match" if res["ok"] else "MISMATCH")
    return 0 if res["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
