"""A run that cannot fit is refused before it starts (issue 22, part 5): the memory model's peak per rank times the
local ranks against the host's available memory, one line with the numbers and a smaller workload that fits (whose
command runs); a rank killed by the system is reported as such."""

from __future__ import annotations

import json
import shlex

import pytest
from helpers import one_line_error, run

from meshplan.core.errors import UserError
from meshplan.plan.json.io import read_schedule
from meshplan.search.run_memory import (
    HOST_SHARE,
    check_fits,
    executor_bytes,
    host_need_bytes,
    rank_peak_bytes,
    run_topology,
)


class Host:
    """A stand-in for :class:`meshplan.executor.host.HostMemory` (no torch)."""

    def __init__(self, available_bytes: float, local_ranks: int, base_bytes: float = 1e8, gpu: bool = False):
        self.available_bytes, self.local_ranks = available_bytes, local_ranks
        self.base_bytes, self.gpu = base_bytes, gpu


def _schedule(tmp_path, seq_len: str, name: str = "s.json"):
    path = tmp_path / name
    r = run("simulate", "--algo", "ring", "--gpus", 4, "--topo", "h100x8", "--seq-len", seq_len, "--heads", 8,
            "--kv-heads", 2, "--head-dim", 64, "--out", path)
    assert r.exit_code == 0, r.stderr
    return read_schedule(path)


def test_a_plan_too_big_for_the_host_is_refused_with_one_that_fits(tmp_path, monkeypatch):
    import meshplan.search.run_memory as rm
    monkeypatch.setattr(rm, "SUGGEST_ITERATION_MAX_S", float("inf"))        # memory alone here; time: below
    big, quarter = _schedule(tmp_path, "64K"), _schedule(tmp_path, "16K", "q.json")
    probe = Host(0, 4)                                                # CPU ranks, 4 on this host, 100 MB each
    need = lambda s: host_need_bytes(s, probe, rank_peak_bytes(s, run_topology(s, False)), False)  # noqa: E731
    assert need(big) > 4 * (executor_bytes(big.workload, 4, False)[0] + 1e8)      # the executor's own is in it
    host = Host(need(quarter) * 1.02 / HOST_SHARE, 4)
    assert need(big) > HOST_SHARE * host.available_bytes
    with pytest.raises(UserError) as e:
        check_fits(big, host, "s.json")
    line = str(e.value)
    assert "\n" not in line and line.startswith("s.json: 4 ranks need ") and "nothing was started" in line
    assert "plan 16384 tokens instead" in line                     # 32K does not fit, 16K does
    cmd = shlex.split(line.split("meshplan simulate ", 1)[1].split(" && ")[0])
    cmd[cmd.index("--out") + 1] = str(tmp_path / "smaller.json")
    r = run("simulate", *cmd)
    assert r.exit_code == 0, r.stderr
    smaller = read_schedule(tmp_path / "smaller.json")
    assert smaller.workload.seq_len == 16384 and smaller.knobs == big.knobs
    check_fits(smaller, host, "smaller.json")                       # the suggestion fits


def test_documents_get_the_numbers_without_a_command(tmp_path):
    path = tmp_path / "d.json"
    assert run("simulate", "--algo", "ring", "--gpus", 2, "--topo", "cpu-local", "--mask", "docs:1000,3096",
               "--heads", 2, "--kv-heads", 2, "--head-dim", 64, "--out", path).exit_code == 0
    with pytest.raises(UserError, match="available; nothing was started; run it on a host with more memory"):
        check_fits(read_schedule(path), Host(1e6, 2), "d.json")


def test_gpu_ranks_are_held_to_their_devices_free_memory(tmp_path):
    s = _schedule(tmp_path, "64K")
    need = rank_peak_bytes(s, run_topology(s, True)) + executor_bytes(s.workload, 4, False)[0]   # on the device
    check_fits(s, Host(need / HOST_SHARE * 1.01, 1, gpu=True), "s.json")
    with pytest.raises(UserError, match="each GPU rank needs .* the least free GPU has"):
        check_fits(s, Host(need / HOST_SHARE * 0.99, 1, gpu=True), "s.json")


def test_gathering_every_result_on_rank_0_is_counted(tmp_path):
    """The full check and --dump gather the whole results on rank 0: three copies of them, and the check's own."""
    s = _schedule(tmp_path, "16K")
    each, first = executor_bytes(s.workload, 4, True)
    w = s.workload
    results = w.batch * w.seq_len * w.head_dim * (2 * 8 + 2 * 2) * 4 + w.batch * 8 * w.seq_len * 4
    assert first > 3 * results and executor_bytes(s.workload, 4, False) == (each, 0.0)


def test_meshplan_run_refuses_before_spawning(tmp_path, monkeypatch):
    pytest.importorskip("torch")
    import meshplan.executor.launch as launch

    path = tmp_path / "r.json"
    assert run("simulate", "--algo", "ring", "--gpus", 2, "--topo", "cpu-local", "--seq-len", "4K", "--out",
               path).exit_code == 0
    monkeypatch.setattr(launch, "available_memory_bytes", lambda: 1e6)
    monkeypatch.setattr(launch, "spawn", lambda *a, **k: pytest.fail("ranks were started"))
    out = tmp_path / "m.json"
    one_line_error(run("run", path, "--out", out), "r.json: 2 ranks need", "this host has 1 MB available")
    assert not out.exists()


@pytest.mark.timeout(120)
def test_a_rank_killed_by_the_system_is_reported_as_such():
    pytest.importorskip("torch")
    import exec_cases

    from meshplan.executor.launch import RunFailed, spawn_ranks

    with pytest.raises(RunFailed, match=r"^rank 1 was killed by the system \(SIGKILL\), likely out of memory"):
        spawn_ranks(exec_cases.killed_by_the_system, 2, None)


def test_a_search_whose_block_arrays_exceed_the_host_is_refused_before_planning(monkeypatch, tmp_path):
    """8192 GPUs on a 24 GB host: ~36 GB of N x N arrays (4096 used to be killed by the system after minutes). One
    line with the numbers, exit 2, nothing written; the fix names a size that fits (a measured power of two) and the
    methods planned in one layout, whose estimate fits. 4096 GPUs (every method in zigzag, by bounds) fits; on a
    2.5 GB host the size named is 1024 (every layout there: a different rate)."""
    from meshplan.search.run_memory import ZIGZAG_ONLY, check_search_fits, search_bytes

    with pytest.raises(UserError) as err:
        check_search_fits(8192, None, 24e9)
    msg = str(err.value)
    assert "8192 GPUs" in msg and "at most 4096 GPUs" in msg
    with pytest.raises(UserError, match=f"--algos {','.join(ZIGZAG_ONLY)}"):     # they fit 30 GB
        check_search_fits(8192, None, 30e9)
    assert search_bytes(4096, None) <= HOST_SHARE * 24e9 and search_bytes(8192, ZIGZAG_ONLY) <= HOST_SHARE * 30e9
    check_search_fits(8192, ZIGZAG_ONLY, 30e9)                # the suggested methods pass
    check_search_fits(4096, None, 24e9)
    check_search_fits(256, None, 24e9)
    check_search_fits(8192, None, None)                       # unknown memory: nothing refused
    with pytest.raises(UserError, match="at most 1024 GPUs"):  # 2048 by bounds: 2.4 GB > 0.9 x 2.5 GB
        check_search_fits(4096, None, 2.5e9)
    monkeypatch.setattr("meshplan.core.host.available_memory_bytes", lambda: 24e9)
    monkeypatch.chdir(tmp_path)
    done = run("search", "--gpus", "8192", "--topo", "h100x32.yaml")
    assert done.exit_code == 2
    one_line_error(done, "--gpus")
    assert list(tmp_path.iterdir()) == []


def test_search_needs_no_torch(tmp_path):
    """The search (its memory check included) runs with torch made unimportable: planning never loads it (0.7 s
    and ~180 MB of the main job when it did)."""
    import subprocess
    import sys

    code = ("import sys; sys.modules['torch'] = None; from meshplan.cli.app import main; "
            f"main(['search', '--gpus', '8', '--topo', 'h100x8', '--seq-len', '16K', '--out', {str(tmp_path)!r}])")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    assert list(tmp_path.glob("01-*.json*"))


def test_a_suggested_cpu_run_is_also_short(tmp_path, monkeypatch):
    """A plan that fits but would take minutes an iteration on this host's cores is not suggested: the next halving
    is, with its predicted iteration time (16 ranks of 16K tokens fit 24 GB but take ~45 s an iteration on 2 cores)."""
    import meshplan.search.run_memory as rm
    from meshplan.cost.simulate import simulate

    big, quarter = _schedule(tmp_path, "64K"), _schedule(tmp_path, "16K", "q.json")
    probe = Host(0, 4)
    need = lambda s: host_need_bytes(s, probe, rank_peak_bytes(s, run_topology(s, False)), False)  # noqa: E731
    host = Host(need(quarter) * 1.02 / HOST_SHARE, 4)                 # 16K fits, as above
    quarter_s = sum(simulate(quarter, run_topology(quarter, False)).pass_makespan.values())
    monkeypatch.setattr(rm, "SUGGEST_ITERATION_MAX_S", quarter_s * 0.99)     # ... but 16K is now too slow
    with pytest.raises(UserError) as e:
        check_fits(big, host, "s.json")
    line = str(e.value)
    assert "plan 8192 tokens instead" in line and " s an iteration here)" in line


def test_above_the_build_limit_the_search_ranks_by_bounds_in_zigzag_and_says_so(monkeypatch, tmp_path):
    """Above SEARCH_BUILD_MAX_RANKS (lowered to 8 here; 1024 shipped: one Mesh build at 4096 ranks took minutes and
    10 GB) a search builds nothing: every method in the zigzag layout alone (the others counted as skipped), no
    candidate simulated, each left at its bound with the reason; the table says every row is a lower bound, the why
    line says it reads the closed forms, Ring's row is compared by bounds, and the pick is not written but named with
    the `simulate … --out` that writes it — a command that itself runs."""
    import meshplan.algorithms.base as base
    import meshplan.search as search
    import meshplan.search.pipeline as pipeline

    for module in (base, search, pipeline):
        monkeypatch.setattr(module, "SEARCH_BUILD_MAX_RANKS", 8)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("COLUMNS", "100")
    args = ["search", "--gpus", "16", "--topo", "h100x16", "--seq-len", "32K", "--heads", "8", "--kv-heads", "2",
            "--head-dim", "64"]
    done = run(*args, "--json")
    assert done.exit_code == 0, done.output
    body = json.loads(done.output)
    assert body["counts"]["simulated"] == 0 and body["candidates"]
    assert {c["layout"] for c in body["candidates"]} == {"zigzag"}
    zigzag_only = {k: v for k, v in body["counts"]["skipped"].items() if "only zigzag searched" in k}
    assert len(zigzag_only) == 1                          # one line, naming the methods (Ring, Mesh among them)
    (why, count), = zigzag_only.items()
    assert why.startswith("other layouts of ring, pass-q") and "mesh" in why and "above 8 ranks" in why
    assert count >= 4
    assert all(c["model_level"] == "closed-form" for c in body["candidates"])
    assert any("above 8 ranks" in k for k in body["counts"]["not_simulated"])
    done = run(*args)
    assert done.exit_code == 0, done.output
    text = " ".join(done.output.split())
    assert "nothing was simulated" in text and "every row is a closed-form lower bound" in text
    assert "why (by the closed forms: nothing was simulated)" in text
    assert "Ring's settings: the least of their lower bounds is" in text
    assert "what each framework offers (no setting timed at this size)" in text and "(simulated;" not in text
    assert "does not build its schedule above 8 ranks; write it alone: meshplan simulate" in text
    assert not (tmp_path / "schedules").exists() or not any((tmp_path / "schedules").iterdir())
    one_line_error(run(*args, "--algos", "tasp"), "--algos", "its closed form builds the schedule, which a "
                   "search does not above 8 ranks")                     # TASP's bound builds it: not when named
    one_line_error(run(*args, "--sensitivity", 10), "--sensitivity", "a search builds none above 8 GPUs")
    one_line_error(run(*args, "--tp", 2), "--tp", "a search builds none above 8 GPUs")
    command = text.split("write it alone: ")[1].split(".json.gz")[0] + ".json.gz"
    monkeypatch.undo()
    monkeypatch.chdir(tmp_path)
    made = run(*shlex.split(command)[1:])
    assert made.exit_code == 0, made.output
    assert read_schedule(str(tmp_path / command.split("--out ")[1])).n_ranks == 16


def test_a_search_of_forward_only_methods_prints_its_table(tmp_path, monkeypatch):
    """TASP alone: in a fwd+bwd search refused (its schedule has no backward: --pass fwd the fix), under --pass fwd
    ranked, its table and notes printed (the lead, why and Ring lines read the total)."""
    monkeypatch.chdir(tmp_path)
    args = ["search", "--gpus", 16, "--topo", "h100x16", "--seq-len", "32K", "--heads", 8, "--kv-heads", 2,
            "--head-dim", 64, "--algos", "tasp", "--write", 0]
    one_line_error(run(*args), "--algos", "tasp has no backward pass", "add --pass fwd")
    done = run(*args, "--pass", "fwd")
    assert done.exit_code == 0, done.stderr
    assert "tasp" in done.stdout and "Traceback" not in done.stderr
