#!/usr/bin/env bash
# Train on the single freest GPU (lowest utilization over a second, then most free memory),
# claimed so that a launch started at the same moment gets another one. Prints
# `Using GPU N (lowest utilization)` and the table behind the choice. NVIDIA or AMD GPUs, whichever
# the machine has (with both: add --gpu-vendor nvidia|amd).
#   ./train_auto_gpu.sh --debug
set -euo pipefail
for arg in "$@"; do  # a second --gpus would silently win over this script's
  [ "$arg" = "--" ] && break
  case $arg in --gpus|--gpus=*) echo "${0##*/}: error: it chooses the GPU itself; drop --gpus, or use run_training.sh --gpus" >&2; exit 2;; esac
done
exec bash "$(dirname "${BASH_SOURCE[0]}")/run_training.sh" --gpus auto:1 "$@"
