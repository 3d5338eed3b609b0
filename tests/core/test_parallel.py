"""Two pieces of work at once: the side work's result (or its error) comes back, forked or threaded."""

from __future__ import annotations

import os
import time

import numpy as np
import pytest

from meshplan.core.parallel import BACKGROUND_NICE, SharedOnce, alongside, shared_counter, start_beside


@pytest.mark.parametrize("fork", ["1", "0"])
def test_both_results_come_back_and_the_side_sees_the_parents_arrays(fork, monkeypatch):
    monkeypatch.setenv("MESHPLAN_FORK", fork)
    data = np.arange(1_000_000, dtype=np.int64)          # shared copy-on-write with a forked child
    side, main = alongside(lambda: (int(data.sum()), os.getpid()), lambda: int(data[::2].sum()))
    assert side[0] == 499999500000 and main == 249999500000
    assert (side[1] != os.getpid()) == (fork == "1")       # forked: another process; else this one


@pytest.mark.parametrize("fork", ["1", "0"])
def test_the_side_works_error_is_raised_here_after_main(fork, monkeypatch):
    monkeypatch.setenv("MESHPLAN_FORK", fork)
    ran = []

    def side():
        raise ValueError("bad schedule")

    with pytest.raises(ValueError, match="bad schedule"):
        alongside(side, lambda: ran.append(1))
    assert ran == [1]


def test_a_forked_side_may_fork_again(monkeypatch):
    """The search writes its schedules in a forked process, which verifies each beside its encoding in another."""
    monkeypatch.setenv("MESHPLAN_FORK", "1")
    inner = lambda: alongside(lambda: os.getpid(), lambda: os.getpid())   # noqa: E731
    (side_pid, side_main_pid), main_pid = alongside(inner, lambda: os.getpid())
    assert len({side_pid, side_main_pid, main_pid}) == 3


@pytest.mark.parametrize("fork", ["1", "0"])
def test_a_shared_counter_hands_each_number_to_one_side(fork, monkeypatch):
    """Both sides take numbers until 200: every number once, whichever side took it."""
    monkeypatch.setenv("MESHPLAN_FORK", fork)
    take = shared_counter()

    def drain():
        got = []
        while (k := take()) < 200:
            got.append(k)
        return got

    side, main = alongside(drain, drain)
    assert sorted(side + main) == list(range(200))


@pytest.mark.parametrize("fork", ["1", "0"])
def test_a_number_the_side_finds_first_reaches_main(fork, monkeypatch):
    """The side sets a number after a while; main waits for it, then goes on."""
    monkeypatch.setenv("MESHPLAN_FORK", fork)
    found = SharedOnce()

    def side():
        time.sleep(0.2)
        found.set(12345)
        return "side done"

    assert alongside(side, found.wait) == ("side done", 12345)


@pytest.mark.timeout(30)
def test_a_side_killed_before_it_sets_the_number_is_an_error_not_a_hang(monkeypatch):
    monkeypatch.setenv("MESHPLAN_FORK", "1")
    found = SharedOnce()
    with pytest.raises(RuntimeError, match="died"):
        alongside(lambda: os._exit(9), found.wait)


def test_a_side_in_its_own_group_is_stopped_midway_with_what_it_forked_and_its_files_removed(tmp_path, monkeypatch):
    """``start_beside(own_group=True).stop()``: the child and the process it forked stop (SIGTERM unwinds each, so a
    file being written is removed as on any error), long before they would have ended; what they wrote is gone."""
    import time

    from meshplan.core.fileio import write_atomic
    from meshplan.core.parallel import can_fork, start_beside

    if not can_fork():
        pytest.skip("no fork here")
    monkeypatch.setenv("MESHPLAN_FORK", "1")

    def slow_pieces(name):
        (tmp_path / f"{name}.started").touch()
        for _ in range(600):                      # 60 s unless stopped
            time.sleep(0.1)
            yield b"x"

    def side():
        return alongside(lambda: write_atomic(tmp_path / "inner.bin", slow_pieces("inner")),
                         lambda: write_atomic(tmp_path / "outer.bin", slow_pieces("outer")))

    job = start_beside(side, own_group=True)
    deadline = time.monotonic() + 30
    while len(list(tmp_path.glob("*.started"))) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert len(list(tmp_path.glob("*.started"))) == 2       # both the child and its own child are writing
    t0 = time.monotonic()
    job.stop()
    assert time.monotonic() - t0 < 8                         # stopped, not waited for (60 s)
    time.sleep(0.5)                                          # the inner one ends with the group too
    assert sorted(p.name for p in tmp_path.iterdir()) == ["inner.started", "outer.started"]   # no .tmp left


@pytest.mark.skipif(not hasattr(os, "nice"), reason="no nice(2) here")
def test_a_background_side_and_what_it_forks_run_at_the_lowest_priority_the_caller_keeps_its_own():
    here = os.nice(0)
    if here >= BACKGROUND_NICE:
        pytest.skip("this process runs at the lowest priority already")

    def niceness_and_forked():
        return os.nice(0), start_beside(lambda: os.nice(0)).result()

    assert start_beside(niceness_and_forked, background=True).result() == (BACKGROUND_NICE, BACKGROUND_NICE)
    assert start_beside(lambda: os.nice(0)).result() == here          # a side in the foreground: as the caller
    assert os.nice(0) == here
