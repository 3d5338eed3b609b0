"""Atomic file writes: a temporary file in the target directory, renamed into place.

A failed or interrupted write leaves no half-written file; the result gets the usual permissions
(0666 minus the umask), not mkstemp's 0600.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from meshplan.core.errors import UserError


def check_writable(path: str | Path, flag: str, directory: bool = False) -> None:
    """Refuse, before any work, a ``path`` (a file, or with ``directory`` a directory) that cannot be written: its
    nearest existing ancestor must be a directory this process may write into (its permissions, then an entry made
    there and removed at once), and the path itself, if it exists, a directory (``directory``) or a file (else).

    Raises:
        UserError: naming ``flag`` and the path.
    """
    path = Path(path)
    if path.exists() and path.is_dir() != directory:
        raise UserError(flag, f"{path} is {'a file' if directory else 'a directory'}",
                        f"give {'a directory' if directory else 'a file name'} to write to")
    base = path if directory and path.is_dir() else path.parent
    while not base.exists():
        base = base.parent
    if not base.is_dir() or not os.access(base, os.W_OK | os.X_OK):
        raise UserError(flag, f"cannot write under {base}", "give a path in a directory you can write to")
    try:                    # what the permission bits do not say (root under /proc, a read-only mount): try it
        os.rmdir(tempfile.mkdtemp(prefix=".meshplan-probe-", dir=base))
    except OSError as err:
        raise UserError(flag, f"cannot write under {base} ({err.strerror or type(err).__name__})",
                        "give a path in a directory you can write to") from None


def write_atomic(path: str | Path, data) -> Path:
    """Write ``data`` (bytes, or an iterable of bytes) to ``path`` atomically (parents created).

    Raises:
        UserError: the directory cannot be created or written, or the disk is full (nothing is left behind).
    """
    path = Path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    except OSError as err:
        raise UserError(str(path), f"cannot write it ({err.strerror or err or type(err).__name__})",
                        "give a path in a directory you can write to") from None
    try:
        with os.fdopen(fd, "wb") as fh:
            for piece in ([data] if isinstance(data, (bytes, bytearray)) else data):
                fh.write(piece)
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)
        os.replace(tmp, path)
    except OSError as err:
        Path(tmp).unlink(missing_ok=True)
        raise UserError(str(path), f"cannot write it ({err.strerror or err or type(err).__name__})",
                        "free space or give a path on another disk") from None
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path
