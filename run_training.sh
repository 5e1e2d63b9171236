#!/usr/bin/env bash
# Train: set up what is missing, prepare the dataset once, run one process per device.
#   bash run_training.sh --debug          debug preset (CPU workers when there is no GPU)
#   bash run_training.sh --help           every option
set -euo pipefail
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
source "$ROOT/scripts/setup.sh"
setup_python "$ROOT" "$ROOT/requirements.txt"
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"  # the launcher's own; its -- COMMAND workers do not get it
# Runs and caches stay in the clone, from whichever directory this is started, unless set
# (--runs-dir and --cache-dir win over both). The installed pretrain-launch uses ./runs and ./cache.
export PRETRAIN_RUNS_DIR="${PRETRAIN_RUNS_DIR:-$ROOT/runs}"
export PRETRAIN_CACHE_DIR="${PRETRAIN_CACHE_DIR:-$ROOT/cache}"
# exec: signals (Ctrl-C, SIGTERM from a scheduler) reach the launcher directly.
exec "$PYTHON" -m launcher "$@"
