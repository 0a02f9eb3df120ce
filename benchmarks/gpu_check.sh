#!/usr/bin/env bash
# The CUDA paths of geoloco in one run (benchmarks/gpu_check.py says what each row checks):
#   bash benchmarks/gpu_check.sh           on a GPU machine, at most about 8 minutes
#   bash benchmarks/gpu_check.sh --quick   small sizes; without CUDA it checks the CPU paths
set -euo pipefail
cd "$(dirname "$0")/.."
exec python benchmarks/gpu_check.py "$@"
