"""Mesh-Attention (arXiv 2512.20968). Modules: :mod:`mesh` (the algorithm and its knobs), :mod:`grid` (tiles, KV
partition rotation, node-block mappings), :mod:`order` (the in-tile fetch order), :mod:`build` (lowering to ops),
:mod:`timing` (its closed form without building the schedule).
"""
