"""CHARM+ (arXiv 2611.05906): ``merge``, ``rmplus`` and full ``charm``. Modules: :mod:`charm` (the algorithms,
their knobs and closed forms), :mod:`lists` (partner lists and domains, Algorithm 1), :mod:`build` (lowering to ops).
"""
