"""The bottom layer, imported by every other package; imports nothing of meshplan.

Modules: :mod:`units` (unit suffixes, parsing and formatting at the edges), :mod:`errors` (one-line user errors,
exit 2), :mod:`fileio` (atomic writes), :mod:`csr` (ragged per-op lists as pointer arrays).
"""
