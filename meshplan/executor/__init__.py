"""The executor: runs a Schedule JSON on ``torch.distributed`` exactly as written, checks the numbers against
a float64 reference and measures every op (``meshplan run``; ``pip install meshplan[exec]``).

torch and flash-attn are imported only inside this package. Modules, in pipeline order:
:mod:`program` (the file, validated and indexed; torch-free), :mod:`kernels` (block attention, the LSE merge),
:mod:`store` (a rank's tensors and their wire images), :mod:`ops` (compute/merge/accumulate as written),
:mod:`runner` (one pass on one rank: a thread per stream), :mod:`data` (inputs and references),
:mod:`numerics` (gather, judge, dump), :mod:`worker` (one process: iterations, timing), :mod:`launch`
(checks, then torchrun or spawned ranks).
"""
