"""The example schedules in ``schedules/examples`` are what their README's commands write today (byte for byte:
the same plan, the same topology hash — a stale one made ``simulate`` warn that cpu-local had changed)."""

from __future__ import annotations

import shlex
from pathlib import Path

import pytest
from helpers import run

EXAMPLES = Path(__file__).resolve().parents[2] / "schedules" / "examples"


def _commands() -> list[list[str]]:
    lines = (EXAMPLES / "README.md").read_text().splitlines()
    return [shlex.split(line.strip())[1:] for line in lines if line.strip().startswith("meshplan simulate")]


@pytest.mark.parametrize("args", _commands(), ids=lambda a: Path(a[-1]).name)
def test_an_example_schedule_is_what_its_command_writes(args, tmp_path):
    target = Path(args[-1])
    done = run(*args[:-1], str(tmp_path / target.name))
    assert done.exit_code == 0, done.stderr
    assert (tmp_path / target.name).read_bytes() == (EXAMPLES / target.name).read_bytes(), (
        f"{target} is stale: run the command in schedules/examples/README.md")
