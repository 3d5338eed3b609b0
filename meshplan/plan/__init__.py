"""The IR and the JSON contract: who computes what, as per-rank ops on streams, proved correct.

Modules, in pipeline order: :mod:`plan` (block owners, chunk homes, rank -> device), :mod:`schedule` (the
Schedule IR, struct-of-arrays) and :mod:`build` (the builder algorithms call), :mod:`job` (a CP group's schedule
inside a TP x CP x DP job), :mod:`dataflow` (items, precedence, the max-plus evaluation), :mod:`hazards` and
:mod:`verify` (the verifier); :mod:`meshplan.plan.json` holds the schedule and measurement file formats.
"""
