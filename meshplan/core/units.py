"""Units and their conversions, done once at the YAML/CLI edges.

GB = 1e9 bytes and GiB = 2**30 bytes, never mixed. Token counts accept binary suffixes as the CLI
contract says: ``1M`` = 1,048,576 tokens, ``128K`` = 131,072.
"""

from __future__ import annotations

import re

from meshplan.core.errors import UserError

#: Bytes per element of each supported dtype.
DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}

_COUNT_SUFFIX = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30}
_BYTES_SUFFIX = {"": 1, "B": 1, "KB": 1e3, "MB": 1e6, "GB": 1e9, "TB": 1e12,
                 "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def parse_count(text: str | int, field: str) -> int:
    """Parse a token count such as ``4096``, ``128K`` or ``1M`` (binary suffixes) into an int > 0.

    Raises:
        UserError: not a positive whole number of tokens.
    """
    if isinstance(text, int):
        value = text
    else:
        m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMG]?)\s*", str(text), flags=re.IGNORECASE)
        if not m:
            raise UserError(field, f"cannot read {text!r} as a count", "write e.g. 4096, 128K or 1M")
        scaled = float(m.group(1)) * _COUNT_SUFFIX[m.group(2).upper()]
        if scaled != int(scaled):
            raise UserError(field, f"{text!r} is not a whole number of tokens", "use a whole count")
        value = int(scaled)
    if value <= 0:
        raise UserError(field, f"must be positive, got {value}", "give a count > 0")
    return value


def parse_bytes(text: str | int | float, field: str) -> int:
    """Parse a byte size such as ``80GiB``, ``64GB`` or ``1073741824`` into an int > 0.

    Raises:
        UserError: unreadable or not positive.
    """
    if isinstance(text, (int, float)):
        value = float(text)
    else:
        m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", str(text))
        unit = m.group(2).upper() if m else None
        if not m or unit not in _BYTES_SUFFIX:
            raise UserError(field, f"cannot read {text!r} as a size", "write e.g. 80GiB, 64GB or 1000000")
        value = float(m.group(1)) * _BYTES_SUFFIX[unit]
    if value <= 0:
        raise UserError(field, f"must be positive, got {text}", "give a size > 0")
    return int(value)


def fmt_count(n: int) -> str:
    """Format a token count with a binary suffix when exact (1048576 -> '1M')."""
    for suffix, scale in (("G", 2**30), ("M", 2**20), ("K", 2**10)):
        if n % scale == 0:
            return f"{n // scale}{suffix}"
    return str(n)


def fmt_bytes(n: float) -> str:
    """Human-readable decimal size (GB = 1e9)."""
    for suffix, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if abs(n) >= scale:
            return f"{n / scale:.3g} {suffix}"
    return f"{n:.0f} B"


def fmt_seconds(t: float) -> str:
    """Human-readable duration, 3 significant digits in s, ms or us (``999.96 ms`` reads ``1 s``, not
    ``1e+03 ms``); below a nanosecond (float round-off of a zero) ``0 us``."""
    t = float(t)
    if t != t:
        return "nan"
    if abs(t) < 1e-9:
        return "0 us"
    for scale, unit in ((1e-6, "us"), (1e-3, "ms")):
        text = f"{t / scale:.3g}"
        if abs(float(text)) < 1000:
            return f"{text} {unit}"
    text = f"{t:.3g}"
    return f"{text} s" if abs(float(text)) < 1000 else f"{t:,.0f} s"


def round_sig(x: float, digits: int = 4) -> float:
    """``x`` rounded to ``digits`` significant digits (fitted parameters as files store them)."""
    return float(f"{float(x):.{digits}g}")
