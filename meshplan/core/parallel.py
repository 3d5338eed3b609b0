"""Two pieces of work at once on a 2-core machine: one in a forked child process, one here.

numpy releases the GIL only inside its loops, so two threads of array code still run mostly one at a time; a
forked child runs truly beside the parent and costs no copy (the parent's arrays are shared copy-on-write). Where
``fork`` is not offered (macOS and Windows start processes by ``spawn``), or ``MESHPLAN_FORK=0``, the side work runs
in a thread instead. The child must not touch a GPU or a communicator; the files it writes are its own (a schedule's
staging file: :mod:`meshplan.search.write`). :func:`alongside` runs one piece of work beside another;
:func:`start_beside` starts one now and collects it later (:class:`Beside`).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace
from typing import Any, TypeVar

T = TypeVar("T")


def _stopped(signum, frame) -> None:
    raise SystemExit(128 + signum)


#: the niceness a ``background`` side runs at (:func:`start_beside`): the lowest CPU priority (nice(2))
BACKGROUND_NICE = 19


def _child(fn: Callable[[], Any], conn, own_group: bool = False, background: bool = False) -> None:
    if own_group:           # before any file is made: SIGTERM unwinds (each staging or temporary file removed)
        signal.signal(signal.SIGTERM, _stopped)
        _set_group(0)
    if background:
        _lower_priority()
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


def _lower_priority() -> None:
    """This process (and what it forks) to :data:`BACKGROUND_NICE`: the scheduler runs it where a core would idle,
    and gives it little while the others want both. Nothing where the system does not offer it."""
    try:
        os.nice(BACKGROUND_NICE - os.nice(0))
    except (OSError, AttributeError):
        pass


def _set_group(pid: int) -> None:
    """Make ``pid`` (0: this process) the leader of its own process group — from both sides of the fork, so the group
    exists whichever runs first (ESRCH/EACCES/EPERM: the child has already ended or done it)."""
    try:
        os.setpgid(pid, 0)
    except OSError:
        pass


class Beside:
    """Work started in a forked child (:func:`start_beside`) whose result is collected later (:meth:`result`),
    waited for and dropped (:meth:`discard`) or, started with ``own_group``, stopped midway (:meth:`stop`) — for a
    caller that starts it before other work of its own begins and ends."""

    def __init__(self, side: Callable[[], Any], own_group: bool = False, background: bool = False) -> None:
        ctx = mp.get_context("fork")
        self._recv, send = ctx.Pipe(duplex=False)
        self._own_group, self._taken = own_group, False
        # not daemonic: a side may fork again
        self._proc = ctx.Process(target=_child, args=(side, send, own_group, background))
        self._proc.start()
        send.close()
        if own_group:
            _set_group(self._proc.pid)

    def result(self) -> Any:
        """The side's result (waiting for it).

        Raises:
            whatever the side raised; RuntimeError if the child died without an answer.
        """
        self._taken = True
        try:
            try:
                ok, value = self._recv.recv()
            except EOFError:
                raise RuntimeError(f"the side computation's process died (exit code {self._proc.exitcode})") from None
        finally:
            self._recv.close()
            self._proc.join()
        if not ok:
            raise value
        return value

    def discard(self) -> None:
        """Wait for the child to end, its result (or error) not wanted: it is not stopped midway — a side may have
        forked in turn, or be writing a file it removes when it fails."""
        try:
            self.result()
        except BaseException:      # noqa: BLE001 - not wanted, whatever it was
            pass

    def stop(self) -> None:
        """Stop the child and every process it forked (its process group: started with ``own_group``) by SIGTERM,
        which each turns into SystemExit — unwinding, so the files it was writing are removed as on any error —
        and wait for it (SIGKILL after 10 s). Its result is dropped. Without ``own_group``: :meth:`discard`. Once its
        result is taken (:meth:`result`), nothing: it has ended."""
        if self._taken:
            return
        if not self._own_group:
            self.discard()
            return
        try:
            os.killpg(self._proc.pid, signal.SIGTERM)
        except (ProcessLookupError, PermissionError):         # ended already (its group with it)
            pass
        self._proc.join(10.0)
        if self._proc.exitcode is None:
            self._proc.kill()
            self._proc.join()
        self._recv.close()


def start_beside(side: Callable[[], Any], own_group: bool = False, background: bool = False) -> Beside:
    """``side()`` started in a forked child now (:class:`Beside`); only where :func:`can_fork`. ``own_group``: the
    child leads a process group of its own, so :meth:`Beside.stop` can stop it and what it forks midway (Ctrl-C at
    the terminal no longer reaches them: the caller stops them on its way out). ``background``: the child (and what
    it forks) runs at the lowest CPU priority (:data:`BACKGROUND_NICE`) — for work whose result is wanted only after
    other work now running, so that work goes first and this one takes the cycles it leaves (the search's early
    write of its leader: the main job 4.6 → 3.9 s, docs/speed.md)."""
    return Beside(side, own_group, background)


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
    pending = start_beside(side)
    try:
        out = main()
    except BaseException:
        pending.discard()
        raise
    return pending.result(), out


def shared_counter(fork: bool = True) -> Callable[[], int]:
    """A function returning 0, 1, 2, … across both sides of :func:`alongside` (with the same ``fork``): whichever
    side asks gets the next number, so work handed out a piece at a time goes to the side that is free."""
    if fork and can_fork():
        value = mp.get_context("fork").Value("q", 0)

        def next_shared() -> int:
            with value.get_lock():
                got = value.value
                value.value = got + 1
            return got
        return next_shared
    lock, box = threading.Lock(), [0]

    def next_local() -> int:
        with lock:
            got = box[0]
            box[0] = got + 1
        return got
    return next_local


class SharedOnce:
    """A number one side of :func:`alongside` (with the same ``fork``) sets once (:meth:`set`) and the other waits
    for (:meth:`wait`): what the side finds first that this one needs later. The side sets it on every way out
    (a ``finally``); a side killed before it does is noticed by the waiting side within 50 ms."""

    def __init__(self, fork: bool = True) -> None:
        self._forked = fork and can_fork()
        if self._forked:
            ctx = mp.get_context("fork")
            self._value, self._ready = ctx.Value("q", 0, lock=False), ctx.Event()
        else:                                           # a thread: a plain box will do
            self._value, self._ready = SimpleNamespace(value=0), threading.Event()

    def set(self, value: int) -> None:
        """Set the number (once) and wake the waiting side."""
        self._value.value = value
        self._ready.set()

    def wait(self) -> int:
        """The number, once set.

        Raises:
            RuntimeError: the forked side ended without setting it (killed).
        """
        while not self._ready.wait(0.05):
            if self._forked and not mp.active_children():
                if self._ready.is_set():
                    break
                raise RuntimeError("the side computation's process died")
        return self._value.value
