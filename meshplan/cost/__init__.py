"""Durations, bounds and the simulator: what a schedule costs on a topology. Knows no algorithm.

Modules, in pipeline order: :mod:`cost` (op durations and uncontended transfers, level L0), :mod:`bounds`
(closed forms of a built schedule), :mod:`maxmin` (max-min fair sharing), :mod:`symmetry` (ranks simulated once per
orbit), :mod:`simulate` (the flow-level event simulator, level L1), :mod:`memory` (the memory model's peak),
:mod:`metrics` (the contract's predicted keys, typed: :class:`~meshplan.cost.metrics.Prediction`).
"""
