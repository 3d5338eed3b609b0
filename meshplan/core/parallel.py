"""Two pieces of work at once on a 2-core machine: one in a forked child process, one here.

numpy releases the GIL only inside its loops, so two threads of array code still run mostly one at a time; a
forked child runs truly beside the parent and costs no copy (the parent's arrays are shared copy-on-write). Where
``fork`` is not offered (macOS and Windows start processes by ``spawn``), or ``MESHPLAN_FORK=0``, the side work runs
in a thread instead. The child only computes: it must not touch a GPU, a communicator or files.
"""

from __future__ import annotations

import multiprocessing as mp
import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

T = TypeVar("T")


def _child(fn: Callable[[], Any], conn) -> None:
    try:
        conn.send((True, fn()))
    except BaseException as err:            # handed to the parent, which raises it there
        conn.send((False, err))
    finally:
        conn.close()


def can_fork() -> bool:
    """Whether :func:`alongside` would fork (else it runs the side work in a thread: no faster for numpy code
    that holds the GIL between its loops, so callers with no other reason for a thread run it in turn)."""
    return os.environ.get("MESHPLAN_FORK", "1") != "0" and "fork" in mp.get_all_start_methods()


def alongside(side: Callable[[], Any], main: Callable[[], T], fork: bool = True) -> tuple[Any, T]:
    """(``side()``, ``main()``), ``side`` computed in a forked child (a thread where fork is unavailable, or with
    ``fork`` False: small work, where starting a process costs more than it saves) while ``main`` runs here.
    ``side``'s result must pickle; its exception is raised here after ``main`` has finished.

    Raises:
        whatever ``side`` or ``main`` raised; RuntimeError if the child died without an answer.
    """
    if not fork or not can_fork():
        with ThreadPoolExecutor(max_workers=1) as pool:
            job = pool.submit(side)
            out = main()
            return job.result(), out
    ctx = mp.get_context("fork")
    recv, send = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_child, args=(side, send))   # not daemonic: a side may fork again
    proc.start()
    send.close()
    try:
        out = main()
        try:
            ok, value = recv.recv()
        except EOFError:
            raise RuntimeError(f"the side computation's process died (exit code {proc.exitcode})") from None
    finally:
        recv.close()
        proc.join()
    if not ok:
        raise value
    return value, out
