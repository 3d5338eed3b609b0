"""User-facing errors: one line naming the field and the fix (the CLI prints it and exits with 2)."""

from __future__ import annotations


class UserError(ValueError):
    """Bad user input. ``str(err)`` is one line: ``<field>: <problem>[; <fix>]``.

    Args:
        field: the flag, YAML key or JSON field at fault (``--gpus``, ``node.fabric.port.usable_GBps``).
        problem: what is wrong, with the offending value.
        fix: what to do instead (valid choices, a padded length, ...); optional.
    """

    def __init__(self, field: str, problem: str, fix: str = "") -> None:
        self.field, self.problem, self.fix = field, problem, fix
        text = f"{field}: {problem}" + (f"; {fix}" if fix else "")
        super().__init__(" ".join(text.split()))

    def __reduce__(self):
        """Pickled by its three parts (raised in a forked process, it is re-raised in the parent)."""
        return type(self), (self.field, self.problem, self.fix)


class SkipCandidate(Exception):
    """An algorithm cannot handle this (workload, rank count, knobs): search skips and counts it.

    ``reason`` is a short stable phrase used as the key of ``counts.skipped``.
    """

    def __init__(self, reason: str, detail: str = "") -> None:
        self.reason, self.detail = reason, detail
        super().__init__(reason + (f": {detail}" if detail else ""))

    def __reduce__(self):
        """Pickled by its parts (raised in a forked process, it is re-raised in the parent)."""
        return type(self), (self.reason, self.detail)
