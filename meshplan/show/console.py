"""The console the CLI prints its human output on: the terminal's width, or ``COLUMNS``, or 100 columns when
the output goes to a pipe or a file (so no line runs past what a reader's terminal shows)."""

from __future__ import annotations

import os
import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from rich.console import Console

#: the width when stdout is not a terminal and ``COLUMNS`` does not say
PIPE_WIDTH = 100


def out_width() -> int | None:
    """Columns for stdout: None (rich asks the terminal) on a terminal, else ``COLUMNS`` or :data:`PIPE_WIDTH`."""
    if sys.stdout.isatty():
        return None
    try:
        cols = int(os.environ.get("COLUMNS", ""))
    except ValueError:
        cols = 0
    return cols if cols >= 40 else PIPE_WIDTH


def out_console() -> Console:
    """A rich console on stdout at :func:`out_width`."""
    from rich.console import Console
    return Console(width=out_width())
