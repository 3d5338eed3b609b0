#!/usr/bin/env bash
# One short GPU check (a few minutes on one GPU): the executor's kernels against float64, and a block-size
# sweep for the kernel efficiency table. Usage: bash benchmarks/gpu_check.sh [OUT_DIR]
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHONUNBUFFERED=1 python3 benchmarks/gpu_check.py --out "${1:-${OUT:-.}}"
