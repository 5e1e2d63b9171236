#!/usr/bin/env bash
# GPU acceptance: run every path of this project that needs an NVIDIA GPU and write one
# Markdown table to benchmarks/results/<date>-<gpu>.md (and the console).
#   bash scripts/gpu_check.sh            every check (about 50 minutes on one H100, estimated; in
#                                        --only groups of at most 8 minutes: docs/gpu-acceptance.md)
#   bash scripts/gpu_check.sh --quick --only syncs,nan
#   bash scripts/gpu_check.sh --help
# Without a GPU it says so in one line and exits 2.
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
source "$ROOT/scripts/setup.sh"
# requirements-float8.txt: torchao, for the float8 check (it declares no torch, so it never pulls a CUDA torch)
setup_python "$ROOT" "$ROOT/requirements.txt" "$ROOT/requirements-float8.txt"  # the NVML test row also needs pytest
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
cd "$ROOT"
exec "$PYTHON" -m benchmarks.gpu_acceptance "$@"
