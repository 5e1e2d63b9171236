"""Which GPUs a run gets: NVML (or a scripted machine), the free criteria and the --gpus request,
GPU health (before the run and during it), the GPU table, claims between launchers, which GPUs
each worker sees, and the placement.

May import supervise/printer.py (placement's lines) and nothing else of the launcher."""
