"""The JSON text's compiled loops (``_text.c``: the reader's number scan, the writer's stores of literals and
integers), or None where they were not built: ``setup.py`` builds them where the install finds a C compiler, and
leaves them out, without failing, where it does not. Their callers (:mod:`meshplan.plan.json.number_scan`,
:mod:`meshplan.plan.json.text_rows`) then do the same work with numpy, with the same results."""

from __future__ import annotations

try:
    from meshplan.plan.json import _text as text
except ImportError:                                    # not built
    text = None


def built() -> bool:
    """Whether the compiled loops were built at install."""
    return text is not None
