"""The GPU acceptance: every path of this project that needs an NVIDIA GPU, run once, in one
Markdown table (docs/gpu-acceptance.md). `bash scripts/gpu_check.sh` runs it as
`python -m benchmarks.gpu_acceptance`.

It owns the command and the report (cli), the checks (checks, whose CHECKS registers the
others: checks_gpus, checks_runtime, checks_nccl, checks_efficiency, checks_flash,
checks_features), what a check is given and returns (context), each check's estimated time
(groups), the child processes the checks start (procs), the code that runs inside them (workers,
workers_runtime, workers_flash) and the reading of NCCL's log and NVML's processes
(nccl_transport).
"""
