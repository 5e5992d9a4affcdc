#!/usr/bin/env bash
# The GPU kit: benchmarks/gpu_check.py with this machine's own PyTorch (no install, no download).
#   bash scripts/gpu_check.sh            # on a CUDA machine: report in benchmarks/results/gpu_<device>_<date>.*
#   bash scripts/gpu_check.sh --cpu      # the kit's plumbing on tiny models, on any machine
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
exec "${PYTHON:-python3}" benchmarks/gpu_check.py "$@"
