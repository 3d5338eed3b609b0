"""The work and the cluster, as data (the first stage of the pipeline: Topology + Workload -> AttnMatrix).

Modules, in pipeline order: :mod:`workload` (shapes, dtype, mask, layout, pass), :mod:`granularity` (refusing a
workload a layout cannot cut, with the padding that fixes it), :mod:`matrix` (the chunk grid and every block's
exact work) with :mod:`pair_counts` (the closed-form pair counts it sums), :mod:`blockmask` (a block's mask as
key runs and dense kernels), :mod:`kernel_tables` (kernel efficiency tables), :mod:`topology_spec` and
:mod:`topo_files` (the topology YAML format, finding files), :mod:`topology` (the cluster as a graph of links),
:mod:`calibration_file`, :mod:`nccl_calibration_file` and :mod:`memory_spec` (calibration files and the memory
model's coefficients, as a topology takes them; their fits are in :mod:`meshplan.truth`).
"""
