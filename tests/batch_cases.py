"""Spawned-rank side of tests/plan/test_batches.py: the executor's worker with torch.distributed's point-to-point calls
counted — every isend/irecv must be posted inside a ``batch_isend_irecv`` group."""

from __future__ import annotations

import torch.distributed as dist

from meshplan.executor.worker import rank_main


def counting_rank_main(rank: int, world: int, jobs: list) -> dict:
    """``rank_main`` with ``batch_isend_irecv``, ``isend`` and ``irecv`` counted; rank 0 returns its result with
    its counts: batches, ops posted in batches, and ops posted outside any batch."""
    import threading

    counts = {"batches": 0, "in_batch": 0, "outside": 0}
    inside = threading.local()           # each stream thread posts its own batches
    lock = threading.Lock()
    batch, isend, irecv = dist.batch_isend_irecv, dist.isend, dist.irecv

    def counted_batch(ops):
        with lock:
            counts["batches"] += 1
        inside.on = True
        try:
            return batch(ops)
        finally:
            inside.on = False

    def counted(fn):
        def call(*args, **kwargs):
            with lock:
                counts["in_batch" if getattr(inside, "on", False) else "outside"] += 1
            return fn(*args, **kwargs)
        return call

    from torch.distributed import distributed_c10d as c10d
    send, recv = counted(isend), counted(irecv)          # P2POp checks its op against c10d's own names
    dist.batch_isend_irecv, dist.isend, dist.irecv = counted_batch, send, recv
    c10d.batch_isend_irecv, c10d.isend, c10d.irecv = counted_batch, send, recv
    result = rank_main(rank, world, jobs)
    return {"result": result[0], "counts": counts} if rank == 0 else None
