"""The executor: runs a Schedule JSON on ``torch.distributed`` exactly as written, checks the numbers against
a float64 reference and measures every op (``meshplan run``; ``pip install meshplan[exec]``).

torch and flash-attn are imported only inside this package. Modules, in pipeline order:
:mod:`program` (the file, validated and indexed; torch-free), :mod:`kernels` (block attention, the LSE merge),
:mod:`store` (a rank's tensors and their wire images), :mod:`ops` (compute/merge/accumulate as written),
:mod:`runner` (one pass on one rank: a thread per stream), :mod:`data` (inputs and references),
:mod:`numerics` (gather, judge, dump), :mod:`worker` (one process: iterations, timing), :mod:`launch`
(checks, then torchrun or spawned ranks). Beside the pipeline, :mod:`local` and :mod:`autograd`: the drop-in
``attention(q, k, v, schedule, group)`` for training with a schedule, and ``shard``/``unshard`` to cut a sequence
into the ranks' chunks (imported lazily, so ``import meshplan.executor.program`` stays torch-free).
"""

_LAZY = {"attention": "autograd", "communicators": "autograd", "shard": "local", "unshard": "local",
         "as_program": "local"}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f"meshplan.executor.{_LAZY[name]}"), name)
    raise AttributeError(f"module 'meshplan.executor' has no attribute {name!r}")


__all__ = list(_LAZY)
