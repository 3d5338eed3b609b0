"""Spawned-rank side of tests/executor/test_autograd.py: the drop-in attention on sharded inputs, gathered and
compared."""

from __future__ import annotations

import os
from datetime import timedelta

import numpy as np
import torch
import torch.distributed as dist

from meshplan.executor import as_program, attention, shard, unshard
from meshplan.executor.data import make_inputs, reference
from meshplan.executor.numerics import judge


def rank_main(rank: int, world: int, payload: dict) -> dict:
    """Run every case; rank 0 returns "name@first rank of its group" -> {"err": tensor -> max|got − ref|,
    "ref": tensor -> max|ref|, "passed": the ``meshplan run --check`` criterion, "vs_run", "shapes"}."""
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    dist.init_process_group("gloo", init_method=payload["init"], rank=rank, world_size=world,
                            timeout=timedelta(seconds=60))
    try:
        mine = {}
        for case in payload["cases"]:
            members = case.get("groups", [list(range(world))])
            groups = [dist.new_group(m) for m in members] if "groups" in case else [dist.group.WORLD]
            group = next(g for g, m in zip(groups, members) if rank in m)   # every rank made every group
            got = one_case(case["schedule"], group, case.get("seed", 0), case.get("vs_run", False))
            if got is not None:
                mine[f"{case['name']}@{rank}"] = got     # keyed by the group's first global rank
        every = [None] * world
        dist.all_gather_object(every, mine)
        return {k: v for d in every for k, v in d.items()}
    finally:
        dist.destroy_process_group()


def one_case(schedule, group, seed: int, vs_run: bool) -> dict | None:
    """attention() forward and backward on this rank's shard; the group's rank 0 compares the gathered
    whole-sequence results with the float64 reference (and, ``vs_run``, with the passes as ``meshplan run``
    runs them on the same inputs: ``"vs_run"``, tensor -> max |difference|)."""
    prog = as_program(schedule)
    w, r = prog.workload, dist.get_rank(group)
    inp = make_inputs(w, seed)
    q, k, v = (shard(x, prog, r).requires_grad_() for x in (inp.q, inp.k, inp.v))
    out = attention(q, k, v, schedule, group, timeout_s=30)
    out.backward(shard(inp.dout, prog, r))
    pieces = [None] * dist.get_world_size(group)
    dist.all_gather_object(pieces, [t.detach() for t in (out, q.grad, k.grad, v.grad)], group=group)
    ran = run_like_meshplan_run(prog, r, group, inp) if vs_run else None
    if r != 0:
        return None
    got = {name: unshard([p[i] for p in pieces], prog) for i, name in enumerate(("out", "dq", "dk", "dv"))}
    ref = reference(inp, w, backward=True)
    numerics = judge(prog, inp, {n: x.float().numpy() for n, x in got.items()})
    pad = torch.from_numpy(~w.is_real(np.arange(w.seq_len)))
    return {"err": {n: float((x.double() - ref[n]).abs().max()) for n, x in got.items()},
            "padding_out_max": float(got["out"][:, pad].abs().max()) if bool(pad.any()) else None,
            "ref": {n: float(ref[n].abs().max()) for n in got}, "passed": numerics.passed,
            "shapes": {"q": tuple(q.shape), "k": tuple(k.shape)},
            "vs_run": ran and {n: float(abs(got[n].float().numpy() - ran[n]).max()) for n in got}}


def run_like_meshplan_run(prog, rank: int, group, inp) -> dict | None:
    """Both passes as the worker of ``meshplan run`` runs them (its filler, its result pieces), gathered on
    the group's rank 0 in natural order."""
    from meshplan.executor.autograd import communicators
    from meshplan.executor.kernels import TORCH_DTYPE
    from meshplan.executor.numerics import assemble, local_results
    from meshplan.executor.runner import PassRunner
    from meshplan.executor.store import Store
    from meshplan.executor.worker import _Filler

    stores = {}
    for p in prog.passes:
        stores[p] = Store(torch.device("cpu"))
        runner = PassRunner(prog, rank, p, stores[p], communicators(prog, group), _Filler(prog, rank, stores, inp),
                            30.0, False)
        runner.prepare()
        runner.run()
    pieces = [None] * dist.get_world_size(group)
    dist.all_gather_object(pieces, local_results(prog, rank, stores, TORCH_DTYPE[prog.workload.dtype]), group=group)
    return assemble(prog, [x for p in pieces for x in p]) if rank == 0 else None
