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
    """A rich console on stdout at :func:`out_width`; piped, without the spaces rich leaves at the end of a wrapped
    line or pads a table's title with (:class:`_Trimmed`)."""
    from rich.console import Console
    width = out_width()
    return Console(width=width) if width is None else Console(width=width, file=_Trimmed(sys.stdout))


class _Trimmed:
    """A text stream that writes whole lines to ``out`` with their trailing spaces dropped."""

    def __init__(self, out) -> None:
        self.out, self.pending = out, ""

    def write(self, text: str) -> int:
        lines = (self.pending + text).split("\n")
        self.pending = lines.pop()
        if lines:
            self.out.write("".join(line.rstrip(" ") + "\n" for line in lines))
        return len(text)

    def flush(self) -> None:
        if self.pending:
            self.out.write(self.pending)
            self.pending = ""
        self.out.flush()

    def isatty(self) -> bool:
        return False

    def fileno(self) -> int:
        return self.out.fileno()
