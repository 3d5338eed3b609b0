"""A few training steps on packed documents with a new plan per batch, against the same model in one process
(an example, not a timed benchmark; run in CI at a small size by ``tests/executor/test_autograd.py``).

``python benchmarks/train_docs.py [--ranks 2] [--steps 3] [--seq-len 256]`` spawns the ranks (gloo, loopback).
Every step each rank draws the same pack of documents (a new one per step: lengths from a mix of short and long
documents), plans it with ``meshplan.plan_batch`` (doc-place on ``cpu-local``; deterministic, so every rank
plans the same schedule without talking), moves its tokens to the plan's layout with ``shard`` and runs the tiny
block of ``train_step.py`` with ``meshplan.executor.attention`` — causal inside each document. Loss and gradients
are all-reduced and an SGD step taken. Rank 0 keeps a float64 copy of the model that trains on the whole pack in
one process (``scaled_dot_product_attention`` with the documents' causal mask) and takes the same steps; every
step's loss must agree within ``LOSS_RTOL`` relative and every gradient within ``GRAD_RTOL`` · max|its reference|.
"""

from __future__ import annotations

import argparse
import copy
import os
import sys
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

from train_step import Block  # noqa: E402

from meshplan.executor import attention, shard  # noqa: E402

LOSS_RTOL = 1e-5       # fp32 ranks against the float64 model
GRAD_RTOL = 1e-5
LR = 0.05


def pack(seq_len: int, step: int) -> list[int]:
    """Document lengths of step ``step``'s pack: short and long documents mixed, exactly ``seq_len`` tokens."""
    rng = np.random.default_rng(1000 + step)
    lens, used = [], 0
    while used < seq_len:
        n = int(rng.integers(4, 24)) if rng.random() < 0.7 else int(rng.integers(40, seq_len // 2))
        n = min(n, seq_len - used)
        lens.append(n)
        used += n
    return lens


def doc_causal(lens: list[int]):
    """Single-process attention causal inside each document, [B, S, H, D] in and out (GQA by repeating KV)."""
    doc = torch.repeat_interleave(torch.arange(len(lens)), torch.tensor(lens))
    pos = torch.arange(len(doc))
    allowed = (doc[:, None] == doc[None, :]) & (pos[:, None] >= pos[None, :])

    def attend(q, k, v):
        g = q.shape[2] // k.shape[2]
        q, k, v = q.transpose(1, 2), k.transpose(1, 2).repeat_interleave(g, 1), v.transpose(1, 2).repeat_interleave(
            g, 1)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=allowed).transpose(1, 2)
    return attend


def plan(lens: list[int], ranks: int, shape: dict):
    """This step's schedule: ``plan_batch`` on cpu-local (the doc-place plan), as a Program."""
    import meshplan
    from meshplan.executor.program import program_of

    topo = meshplan.Topology.load("cpu-local", gpus=ranks)
    cu = np.concatenate([[0], np.cumsum(lens)])
    w = meshplan.resolve(seq_len=int(cu[-1]), dtype="fp32", passes="fwd+bwd", **shape)
    got = meshplan.plan_batch(cu, topo, ranks, w, references=False)
    return program_of(got.candidates[0].schedule)


def rank_main(rank: int, world: int, payload: dict) -> dict | None:
    """``steps`` training steps; rank 0 returns each step's loss and gradient errors against float64."""
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    dist.init_process_group("gloo", init_method=payload["init"], rank=rank, world_size=world)
    try:
        seq_len, vocab, shape = payload["seq_len"], payload["vocab"], payload["shape"]
        torch.manual_seed(0)
        model = Block(vocab, seq_len, shape["heads"], shape["kv_heads"], shape["head_dim"])
        ref = copy.deepcopy(model).double() if rank == 0 else None
        steps = []
        for step in range(payload["steps"]):
            lens = pack(seq_len, step)
            prog = plan(lens, world, shape)
            g = torch.Generator().manual_seed(step)
            tokens = torch.randint(vocab, (shape["batch"], seq_len), generator=g)
            targets = torch.cat([tokens[:, 1:], torch.full((shape["batch"], 1), -100)], dim=1)
            ends = np.cumsum(lens) - 1
            targets[:, torch.as_tensor(ends)] = -100                 # no next token across a document's end
            positions = torch.arange(seq_len).expand(shape["batch"], -1)
            mine = [shard(x, prog, rank) for x in (tokens, targets, positions)]
            model.zero_grad()
            logits = model(mine[0], mine[2], lambda q, k, v, prog=prog: attention(q, k, v, prog))
            n_targets = int((targets != -100).sum())
            loss = F.cross_entropy(logits.flatten(0, 1), mine[1].flatten(), ignore_index=-100,
                                   reduction="sum") / n_targets
            loss.backward()
            total = loss.detach().clone()
            dist.all_reduce(total)
            for p in model.parameters():
                dist.all_reduce(p.grad)
            if rank == 0:
                ref.zero_grad()
                ref_loss = F.cross_entropy(ref(tokens, positions, doc_causal(lens)).flatten(0, 1), targets.flatten(),
                                           ignore_index=-100)
                ref_loss.backward()
                grads = {name: (float((p.grad.double() - r.grad).abs().max()), float(r.grad.abs().max()))
                         for (name, p), r in zip(model.named_parameters(), ref.parameters())}
                steps.append({"documents": len(lens), "loss": total.item(), "ref_loss": ref_loss.item(),
                              "grads": grads, "split": sum(1 for _, gsize in prog.workload.doc_ranks if gsize > 1)})
                with torch.no_grad():
                    for r in ref.parameters():
                        r -= LR * r.grad
            with torch.no_grad():
                for p in model.parameters():
                    p -= LR * p.grad
        dist.barrier()
        return {"steps": steps} if rank == 0 else None
    finally:
        dist.destroy_process_group()


def train_docs(ranks: int = 2, steps: int = 3, seq_len: int = 256, vocab: int = 64, batch: int = 1) -> dict:
    """Spawn the ranks and train; per step the loss error and ``ok`` (every step within tolerance)."""
    from meshplan.executor.launch import free_port, spawn_ranks

    shape = {"batch": batch, "heads": 4, "kv_heads": 2, "head_dim": 16}
    res = spawn_ranks(rank_main, ranks, {"init": f"tcp://127.0.0.1:{free_port()}", "steps": steps,
                                         "seq_len": seq_len, "vocab": vocab, "shape": shape},
                      prefix="meshplan-train-docs-")
    for s in res["steps"]:
        s["loss_rel_err"] = abs(s["loss"] - s["ref_loss"]) / abs(s["ref_loss"])
        s["ok"] = s["loss_rel_err"] <= LOSS_RTOL and all(e <= GRAD_RTOL * m for e, m in s["grads"].values())
    res["ok"] = all(s["ok"] for s in res["steps"])
    return res


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--seq-len", type=int, default=256)
    args = ap.parse_args()
    res = train_docs(args.ranks, args.steps, args.seq_len)
    for k, s in enumerate(res["steps"]):
        worst = max(e / m for e, m in s["grads"].values())
        print(f"step {k}: {s['documents']} documents ({s['split']} split), loss {s['loss']:.8f}, one process "
              f"(float64) {s['ref_loss']:.8f}, relative error {s['loss_rel_err']:.2e}; worst gradient error "
              f"{worst:.2e} x max|grad| (tolerance {GRAD_RTOL:g})")
    print("every step matches" if res["ok"] else "MISMATCH")
    return 0 if res["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
