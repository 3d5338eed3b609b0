"""What was measured, and fits to it: compare, plausibility, calibration and memory fits, nccl-tests, the CHARM+ reproduction."""
