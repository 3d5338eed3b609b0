"""Writes that cannot happen are refused in one line naming the path (exit 2 from the CLI), before the work where the
CLI can tell, and leave nothing behind; user errors raised in a forked process come back whole."""

from __future__ import annotations

import pickle
from pathlib import Path

import pytest
from typer.testing import CliRunner

from meshplan.cli.app import app
from meshplan.core.errors import SkipCandidate, UserError
from meshplan.core.fileio import check_writable, write_atomic
from meshplan.core.parallel import alongside, can_fork


def test_user_errors_pickle_whole():
    err = pickle.loads(pickle.dumps(UserError("--out", "cannot write it", "give another path")))
    assert (err.field, err.problem, err.fix, str(err)) == ("--out", "cannot write it", "give another path",
                                                          "--out: cannot write it; give another path")
    skip = pickle.loads(pickle.dumps(SkipCandidate("no fit", "heads")))
    assert (skip.reason, skip.detail) == ("no fit", "heads")


@pytest.mark.skipif(not can_fork(), reason="forks")
def test_a_user_error_in_a_forked_process_is_raised_here_as_itself():
    def side():
        raise UserError("--gpus", "too many", "fewer")
    with pytest.raises(UserError) as got:
        alongside(side, lambda: None)
    assert got.value.field == "--gpus" and got.value.fix == "fewer"


def test_a_path_under_a_file_is_refused_and_nothing_is_written(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    with pytest.raises(UserError, match="cannot write"):
        check_writable(blocker / "sub" / "x.json", "--out")
    with pytest.raises(UserError, match="is a file"):
        check_writable(blocker, "--out", directory=True)
    with pytest.raises(UserError, match="is a directory"):
        check_writable(tmp_path, "--out")
    check_writable(tmp_path / "new" / "x.json", "--out")                    # creatable: fine
    with pytest.raises(UserError, match="cannot write it"):
        write_atomic(blocker / "x.json", b"{}")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a-file"]


@pytest.mark.parametrize("args", [
    ["search", "--gpus", "8", "--topo", "h100x8", "--seq-len", "32K", "--out", "{f}"],
    ["simulate", "--algo", "ring", "--gpus", "8", "--topo", "h100x8", "--seq-len", "32K", "--out", "{f}/x.json"],
])
def test_the_cli_refuses_an_output_it_cannot_write_in_one_line(tmp_path, args):
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    out = CliRunner().invoke(app, [a.format(f=blocker) for a in args])
    assert out.exit_code == 2, out.output
    assert "Traceback" not in out.output and len(out.output.strip().splitlines()) == 1
    assert "--out" in out.output
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a-file"]


@pytest.mark.skipif(not Path("/proc/self").is_dir(), reason="no /proc here")
def test_a_directory_nothing_can_be_made_in_is_refused_before_the_work():
    """/proc allows root by its permission bits but no entry can be made there: refused at once, naming the flag
    (not after a search, when its schedule is written)."""
    with pytest.raises(UserError, match="cannot write under /proc") as err:
        check_writable("/proc/meshplan-out", "--out", directory=True)
    assert err.value.field == "--out"
