"""One rank running one pass of a schedule, obeying the semantics of :mod:`meshplan.plan.schedule`.

Each stream runs in its own thread, its units (a P2P batch, or one op) in program order; a unit starts
when the previous unit of its stream and every dep of its members have ended (``threading.Event`` per
op). A batch posts all its isend/irecv as one group (``batch_isend_irecv``: one ``ncclGroupStart/End`` on
NCCL) on the stream's own process group (one communicator per comm stream, so FIFO matching never spans
streams; schedule rank r is rank r of that group) and ends when all have completed. Compute-type ops run on
their stream's thread (on CUDA, each stream on its own CUDA stream). With ``serialize`` one thread runs every
unit in program order, one at a time, so communication never overlaps computation.

Times: ``perf_counter_ns`` from the pass start on CPU; on CUDA each op's end is synchronised before its
dependants start and timed the same way. A transfer starts when it is posted and ends when its
completion is observed. Every wait is bounded by ``timeout_s``; a timeout names the rank, op and peer.
``MESHPLAN_EXEC_DROP_OP=<op id>`` never posts that send or recv (fault injection, for the tests).
"""

from __future__ import annotations

import os
import threading
import time
from contextlib import nullcontext
from datetime import timedelta

import torch
import torch.distributed as dist

from meshplan.executor.ops import OpRunner
from meshplan.executor.program import FP32_PARTS, Program
from meshplan.executor.store import Store, pack, unpack


def connect(groups, device: torch.device) -> None:
    """Set up every communicator now, all ranks together (a barrier on each group): NCCL creates one lazily at
    its first call, and a first call that is a batch among some ranks only is undefined (``batch_isend_irecv``'s
    documentation). Every rank of the groups must call this, in the same order."""
    for g in groups:
        dist.barrier(group=g, device_ids=[device.index]) if device.type == "cuda" else dist.barrier(group=g)


class RunError(RuntimeError):
    """A rank failed while running (a timeout or a broken transfer); the message names rank, op and peer."""


class PassRunner:
    """Runs one pass on one rank. ``init_tensor(tid)`` creates a tensor alive at the pass start."""

    def __init__(self, prog: Program, rank: int, pass_: str, store: Store, groups: dict[int, object],
                 init_tensor, timeout_s: float, serialize: bool) -> None:
        self.prog, self.rank, self.pass_, self.store = prog, rank, pass_, store
        self.groups, self.init_tensor, self.timeout_s, self.serialize = groups, init_tensor, timeout_s, serialize
        self.ops = OpRunner(prog, store, 1.0 / prog.workload.head_dim ** 0.5)
        self.units = prog.units(rank, pass_)
        self.start_tensors, self.alloc, self.frees = prog.lifetimes(rank, pass_)
        self.remaining = {t: len(prog.tensors[t].free_after) for ts in self.frees.values() for t in ts}
        self.by_id = {op.id: op for us in self.units.values() for u in us for op in u}
        self.done = {i: threading.Event() for i in self.by_id}
        self.times: dict[int, tuple[int, int]] = {}
        self.cpu_s: dict[str, float] = {}          # per stream thread: CPU seconds in this pass (thread_time)
        self.error: BaseException | None = None
        self._lock = threading.Lock()
        self._comm = {s.name: s.communicator for s in prog.doc.streams}
        self._drop = int(os.environ.get("MESHPLAN_EXEC_DROP_OP", -1))   # fault injection for tests: never post it
        self._cuda_streams = {}
        if store.device.type == "cuda":
            self._cuda_streams = {name: torch.cuda.Stream(device=store.device) for name in self.units}

    def prepare(self) -> None:
        """Create the tensors alive at the pass start (inputs filled), before the barrier that starts the pass."""
        for tid in self.start_tensors:
            self.init_tensor(tid)

    def run(self) -> dict[int, tuple[int, int]]:
        """Run the pass (after :meth:`prepare`); returns op id -> (start_ns, end_ns) from the pass start.

        Raises:
            RunError: a timeout or a failed op, naming rank, op and peer.
        """
        self.t0 = time.perf_counter_ns()
        if self.serialize:
            order = self.prog.ordered_units(self.rank, self.pass_)
            threads = [threading.Thread(target=self._worker, args=("*", order), daemon=True)]
        else:
            threads = [threading.Thread(target=self._worker, args=(name, us), daemon=True)
                       for name, us in self.units.items()]
        for t in threads:
            t.start()
        for t in threads:
            while t.is_alive():
                t.join(0.05)
                if self.error is not None:
                    raise self.error
        if self.error is not None:
            raise self.error
        return self.times

    def _worker(self, stream: str, units: list[list]) -> None:
        cpu0 = time.thread_time()
        try:
            for unit in units:
                self._wait_deps(unit)
                name = unit[0].stream
                ctx = torch.cuda.stream(self._cuda_streams[name]) if self._cuda_streams else nullcontext()
                with ctx:
                    start = time.perf_counter_ns()
                    for op in unit:
                        for tid in self.alloc.get(op.id, ()):
                            self.store.alloc(tid, self.prog.layout(tid), self.prog.tensors[tid].dtype)
                    self._execute(unit)
                    if self._cuda_streams:
                        torch.cuda.current_stream().synchronize()
                    end = time.perf_counter_ns()
                for op in unit:
                    self.times[op.id] = (start - self.t0, end - self.t0)
                    self._ended(op.id)
            self.cpu_s[stream] = time.thread_time() - cpu0
        except BaseException as err:  # noqa: BLE001 - reported by run() in the main thread
            with self._lock:
                if self.error is None:
                    self.error = err if isinstance(err, RunError) else RunError(
                        f"rank {self.rank}, stream {stream}: {type(err).__name__}: {err}")

    def _wait_deps(self, unit: list) -> None:
        deadline = time.monotonic() + self.timeout_s
        for op in unit:
            for d in op.deps:
                while not self.done[d].wait(0.05):
                    if self.error is not None:
                        raise RunError("stopped: another stream failed")
                    if time.monotonic() > deadline:
                        raise self._stalled(op, d)

    def _stalled(self, op, dep: int) -> RunError:
        """The error for ``op`` waiting too long on ``dep``: names the op that holds the chain up (the
        transfer and its peer when it is one), not just the waiter, whichever thread's clock ran out first."""
        while (pending := [x for x in self.by_id[dep].deps if not self.done[x].is_set()]):
            dep = pending[0]
        held = self.by_id[dep]
        if held.kind in ("send", "recv"):
            return self._transfer_error(held, f" (op {op.id} waits on it)")
        return RunError(f"rank {self.rank}: op {op.id} ({op.kind}) waited {self.timeout_s:g} s for op {held.id} "
                        f"({held.kind}); raise --timeout-s or check the schedule")

    def _transfer_error(self, op, why: str) -> RunError:
        return RunError(f"rank {self.rank}: {op.kind} op {op.id} with peer {op.peer} did not complete in "
                        f"{self.timeout_s:g} s{why}; check that rank {op.peer} posts its match, or raise "
                        "--timeout-s")

    def _execute(self, unit: list) -> None:
        op = unit[0]
        if op.kind in ("send", "recv"):
            self._transfer(unit)
        elif op.kind == "compute":
            self.ops.compute(op)
        elif op.kind in ("merge", "accumulate"):
            self.ops.fold(op)
        elif op.kind == "collective":
            raise RunError(f"op {op.id}: collective ops arrive with the baseline library (issue 5)")

    def _transfer(self, batch: list) -> None:
        """Post the batch as one group (``batch_isend_irecv``: ``ncclGroupStart/End`` on NCCL, so sends and
        receives between the same two ranks cannot hang each other), then wait for every member (each wait
        bounded by the timeout). Every member's time is the batch's: the group completes as one."""
        group = self.groups[self._comm[batch[0].stream]]
        ops, bufs = [], []
        for op in batch:
            if op.id == self._drop:
                continue
            peer = dist.get_global_rank(group, op.peer)       # schedule rank r is rank r of the group
            if op.kind == "send":
                buf = pack(self._payload(op), self.prog.tensors[op.tensor].kind, op.dtype)
                ops.append(dist.P2POp(dist.isend, buf, peer, group))
            else:
                buf = torch.empty(op.size_bytes, dtype=torch.uint8, device=self.store.device)
                ops.append(dist.P2POp(dist.irecv, buf, peer, group))
            bufs.append((op, buf))
        works = dist.batch_isend_irecv(ops) if ops else []
        # one work per op (gloo), or one for the whole group (NCCL's coalescing): a failed wait names the op
        # whose wait it was, or the batch's first op
        for i, work in enumerate(works):
            op = bufs[i][0] if len(works) == len(bufs) else bufs[0][0]
            try:
                work.wait(timeout=timedelta(milliseconds=max(1.0, self.timeout_s * 1e3)))
            except RuntimeError as err:
                why = "" if "timed out" in str(err).lower() else f" ({str(err).splitlines()[0][:100]})"
                raise self._transfer_error(op, why) from None
        for op, buf in bufs:
            if op.kind == "recv":
                unpack(buf, self.store.get(op.tensor), self.prog.tensors[op.tensor].kind, op.dtype)

    def _payload(self, op) -> dict:
        """What a send moves: its tensor's parts, or a packed send's tensors concatenated along tokens."""
        if not op.parts:
            return self.store.get(op.tensor)
        held = [self.store.get(t) for t in op.parts]
        return {part: torch.cat([h[part] for h in held], dim=2 if part in FP32_PARTS else 1) for part in held[0]}

    def _ended(self, op_id: int) -> None:
        for tid in self.frees.get(op_id, ()):
            with self._lock:
                self.remaining[tid] -= 1
                last = self.remaining[tid] == 0
            if last:
                self.store.free(tid)
        self.done[op_id].set()

