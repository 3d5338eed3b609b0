"""Atomic file writes: a temporary file in the target directory, renamed into place.

A failed or interrupted write leaves no half-written file; the result gets the usual permissions
(0666 minus the umask), not mkstemp's 0600.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path


def write_atomic(path: str | Path, data) -> Path:
    """Write ``data`` (bytes, or an iterable of bytes) to ``path`` atomically (parents created)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as fh:
            for piece in ([data] if isinstance(data, (bytes, bytearray)) else data):
                fh.write(piece)
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path
