"""Micro-benchmarks on this machine (kernels, transfers, overlap, memory) for `meshplan calibrate`."""
