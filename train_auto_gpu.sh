#!/usr/bin/env bash
# Train on the single freest GPU (lowest utilization over a second, then most free memory),
# claimed so that a launch started at the same moment gets another one. Prints
# `Using GPU N (lowest utilization)` and the table behind the choice.
#   ./train_auto_gpu.sh --debug
set -euo pipefail
exec bash "$(dirname "${BASH_SOURCE[0]}")/run_training.sh" --gpus auto:1 "$@"
