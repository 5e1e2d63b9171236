#!/usr/bin/env bash
# Train on one GPU you name: its NVML index (as `python -m launcher gpus` and nvidia-smi show
# it), a MIG device such as 0.1, or a UUID. Output lines are prefixed GPU<id>:. The same on AMD GPUs
# (amd-smi's index, a partition such as 0.3); on a machine with both, add --gpu-vendor nvidia|amd.
#   ./train_gpu.sh 3 --debug
#   ./train_gpu.sh 3 --strict --config configs/single_gpu.json   # refuse GPU 3 if it is busy
set -euo pipefail
if [ $# -lt 1 ] || [[ $1 == -* ]]; then
  echo "usage: ./train_gpu.sh GPU [launcher options...]  (GPU: an id from \`python -m launcher gpus\`)" >&2
  exit 2
fi
gpu=$1; shift
for arg in "$@"; do  # a second --gpus would silently win over this script's
  [ "$arg" = "--" ] && break
  case $arg in --gpus|--gpus=*) echo "${0##*/}: error: the GPU is its first argument; drop --gpus" >&2; exit 2;; esac
done
exec bash "$(dirname "${BASH_SOURCE[0]}")/run_training.sh" --gpus "$gpu" "$@"
