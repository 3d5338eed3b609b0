"""What was measured, and fits to it: the layer that holds the model to evidence.

Modules: :mod:`compare` and :mod:`plausible` (predicted against measured; rates the hardware cannot reach),
:mod:`fit` (the fitted forms), :mod:`calibration_fit`, :mod:`calibration_kernel` and :mod:`calibration_merge`
(``meshplan calibrate``'s fit), :mod:`nccl_tests` and :mod:`nccl_fit` (nccl-tests output), :mod:`memory_fit` (the
memory model's fit), :mod:`published`, :mod:`reproduce` and :mod:`reproduce_fit` (the CHARM+ tables).
"""
