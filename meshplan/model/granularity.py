"""The refusal of a workload that a layout cannot cut evenly, with the padding that fixes it as complete flags.

Every suggestion is a set of flags that plans and runs as written (tests/model/test_padding.py runs each): pad the
sequence and mark the padding (``--valid-len``), pad each document (``docs:L+P``) or pack them, pad the cache or
the new tokens of an inference step.
"""

from __future__ import annotations

from meshplan.core.errors import UserError
from meshplan.model.workload import Workload


def granularity_error(workload: Workload, n: int, unit: int, bad: list[tuple[int, int]]) -> UserError:
    """The one-line error for regions that the layout cannot cut evenly, with the padding that fixes it."""
    w, layout = workload, workload.layout
    what = f"2·N = {unit}" if layout == "zigzag" else f"N = {unit}"
    pad = lambda x: -(-x // unit) * unit  # noqa: E731
    if w.mask.kind == "docs" and w.doc_layout == "per-doc":
        real = w.mask.doc_real_lens()
        spec = ",".join(f"{r}+{pad(sl) - r}" if pad(sl) != r else str(r) for r, sl in zip(real, w.mask.doc_lens))
        k, size = bad[0]
        tokens = f"{size} token{'s' if size != 1 else ''}"
        return UserError("--mask", f"document {k + 1} has {tokens}, not a multiple of {what} for the per-document "
                         f"{layout} layout", f"pad each document: --mask docs:{spec} --seq-len "
                         f"{sum(pad(sl) for sl in w.mask.doc_lens)}, or pack them: --doc-layout packed "
                         f"{_packed_docs(w, unit)}")
    if w.prefix_len:
        k, size = bad[0]
        if k == 0:
            return UserError("--prefix-len", f"{size} cached tokens are not a multiple of {what} for the {layout} "
                             "layout", f"pad the cache: --prefix-len {pad(size)} --seq-len {pad(size) + w.n_queries}")
        return UserError("--seq-len", f"{size} new tokens are not a multiple of {what} (nor fewer than N = {n}, "
                         "a decode step)", f"pad the new tokens: --seq-len {w.prefix_len + pad(size)} --valid-len "
                         f"{w.n_valid}, or decode fewer than {n} new tokens")
    S = w.seq_len
    if w.mask.kind == "docs":                # packed: pad the last document, whose padding never contributes
        return UserError("--seq-len", f"{S} is not a multiple of {what} for the {layout} layout",
                         f"pad the last document: {_packed_docs(w, unit)}")
    return UserError("--seq-len", f"{S} is not a multiple of {what} for the {layout} layout",
                     f"pad to {pad(S)} and mask the padding: --seq-len {pad(S)} --valid-len {w.n_valid}")


def _packed_docs(w: Workload, unit: int) -> str:
    """The flags of the packed layout for these documents: the last one padded so that the sequence is a multiple
    of ``unit`` (padding never contributes), ``--mask docs:... --seq-len S``."""
    real, slots = w.mask.doc_real_lens(), list(w.mask.doc_lens)
    S = sum(slots)
    extra = -(-S // unit) * unit - S
    pads = [sl - r for r, sl in zip(real, slots)]
    pads[-1] += extra
    spec = ",".join(f"{r}+{p}" if p else str(r) for r, p in zip(real, pads))
    return f"--mask docs:{spec} --seq-len {S + extra}"
