"""Micro-benchmarks on this host for ``meshplan calibrate`` (the fit is :mod:`meshplan.truth.calibration_fit`):
:mod:`common` (the sweep, log, sync), :mod:`bench` (kernels, merges, memory samples of schedules it is handed),
:mod:`ranks` (transfers, overlap and core sharing on spawned ranks), :mod:`memory` (each op's memory rise).
"""
