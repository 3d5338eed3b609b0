"""The work and the cluster, as data: workload, attention matrix, masks, kernels, topology, calibration files."""
