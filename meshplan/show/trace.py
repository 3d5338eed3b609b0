"""Chrome-trace / Perfetto JSON of a timeline: one process per rank, one thread per stream.

Open the file at https://ui.perfetto.dev or chrome://tracing. Times in microseconds (the format's unit).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from meshplan.plan.schedule import OP_KINDS, PASS_NAMES, Schedule


def trace_events(sched: Schedule, start_s: np.ndarray, end_s: np.ndarray, label: str = "predicted",
                 pid_offset: int = 0) -> list[dict]:
    """Trace events for every op with a start and an end (NaN: left out).

    One process per rank (``pid = rank + pid_offset``, named "rank r (label)"), one thread per stream;
    ``start_s``/``end_s`` are [n_ops] seconds, written in microseconds.
    """
    o = sched.ops
    events = []
    for r in range(sched.n_ranks):
        pid = r + pid_offset
        events.append({"ph": "M", "name": "process_name", "pid": pid, "args": {"name": f"rank {r} ({label})"}})
        events.append({"ph": "M", "name": "process_sort_index", "pid": pid, "args": {"sort_index": pid}})
        for sid, name in enumerate(sched.streams.names):
            events.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": sid, "args": {"name": name}})
    ok = np.flatnonzero(np.isfinite(start_s) & np.isfinite(end_s))
    for i, r, k, st, ph, peer, size in zip(ok.tolist(), o.rank[ok].tolist(), o.kind[ok].tolist(),
                                            o.stream[ok].tolist(), o.phase[ok].tolist(), o.peer[ok].tolist(),
                                            o.size_bytes[ok].tolist()):
        name = OP_KINDS[k] + (f" {'->' if k == 1 else '<-'} {peer}" if k in (1, 2) else "")
        events.append({"ph": "X", "name": name, "cat": f"{OP_KINDS[k]},{PASS_NAMES[ph]}", "pid": r + pid_offset,
                       "tid": st, "ts": start_s[i] * 1e6, "dur": max(end_s[i] - start_s[i], 0.0) * 1e6,
                       "args": {"op": i, "bytes": size}})
    return events


def write_trace(path: str | Path, events: list[dict]) -> None:
    """Write ``{"traceEvents": [...]}`` atomically.

    Raises:
        UserError: ``path`` is a directory or not a ``.json`` name (``--trace``).
    """
    from meshplan.core.errors import UserError
    from meshplan.core.fileio import write_atomic
    if Path(path).is_dir() or not str(path).endswith(".json"):
        raise UserError("--trace", f"{str(path)!r} is not a .json file name", "name the trace file *.json")
    write_atomic(path, json.dumps({"traceEvents": events, "displayTimeUnit": "ms"}).encode())
