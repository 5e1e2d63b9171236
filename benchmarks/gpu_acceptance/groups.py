"""How long each GPU check takes, estimated (none has run on a GPU yet), and the limit a group of
checks (one `--only` run) must stay within: a device call is limited to 10 minutes, a group is
planned to 8 on one H100 with a cold compile cache. docs/gpu-acceptance.md lists the groups with
these estimates (tests/benchmarks/gpu_acceptance/test_gpu_check_decisions.py holds the two together).

The estimates are built from what each check runs: a cold torch.compile of `small`'s blocks
(forward and backward, and the compiled loss head) about COLD_COMPILE_S, the same graphs again from
inductor's cache WARM_COMPILE_S, a launch (the launcher, a worker importing torch, the built-in
corpus) START_S, and `small`'s compiled steps at 45% MFU about 0.13 s (65,536 tokens), twice that
uncompiled. Two-GPU checks are estimated on two GPUs; on one they end at once (n.a.)."""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping

GROUP_LIMIT_S = 480
"""A group's planned time: 8 minutes of a 10-minute device call."""
OVERHEAD_S = 30
"""What every run adds before its checks: scripts/gpu_check.sh's environment, reading the machine."""
CHECK_LIMIT_S = GROUP_LIMIT_S - OVERHEAD_S
"""The most a check's commands may run together (their timeouts add up to at most this)."""
COLD_COMPILE_S = 90
WARM_COMPILE_S = 30
START_S = 20

ESTIMATED_S: dict[str, int] = {
    "gpus": 30,  # a holder process with a CUDA context, NVML, the launcher's table
    "nvml-test": 20,  # one pytest test
    "train-gpu": 60,  # the debug preset (uncompiled: debug.trace_nonfinite), and preparing the corpus
    "train-auto": 45,
    "run-training": 45,
    "nan": 60,  # a CPU worker writes the checkpoint, then a launch that stops at step 0
    "small": START_S + COLD_COMPILE_S + 40 + 10 + START_S + 80,  # 300 steps compiled, 300 not
    "production-shape": 2 * START_S + COLD_COMPILE_S + WARM_COMPILE_S + 60,  # the 8B shape at 2 and 4 layers, 6 steps each
    "step-profile": START_S + WARM_COMPILE_S + 20,  # after `small`: its compile is warm; 16 steps, 3 profiled
    # uncompiled (the floor), then a cold and a warm compile, each to its first step
    "compile-cache": START_S + (START_S + 10) + (START_S + COLD_COMPILE_S) + (START_S + WARM_COMPILE_S) + 10,
    "compile-modes": 2 * (START_S + COLD_COMPILE_S + 20),  # default and reduce-overhead, each cold
    # max-autotune-no-cudagraphs cold (autotuning every matmul: about 3 cold compiles), then
    # max-autotune on the autotuning results it cached
    "compile-autotune": (START_S + 3 * COLD_COMPILE_S + 20) + (START_S + COLD_COMPILE_S + 20),
    "bf16": 60,  # the debug model, 20 steps in bf16 and in fp32
    "offload": 2 * START_S + 60,  # `small`, 10 steps with and without CPU offload (host AdamW)
    "nccl": 100,  # two GPUs: a rank killed at step 5; DDP and FSDP for 2 steps
    "syncs": 3 * START_S + COLD_COMPILE_S + 2 * WARM_COMPILE_S + 3 * 30,  # 3 processes, steps under the profiler
    # dense, MoE, Muon and MoE+Muon at once, each a cold compile (train and eval), 2x slower side by side
    "efficiency": 2 * START_S + 4 * (COLD_COMPILE_S + 40) // 2 + 10,
    "torchrun": 60,  # two GPUs, the debug model for 10 steps
    "nccl-timeout": 120,  # two GPUs: to step 5, then the 20 s timeout and NCCL's abort (up to 80 s)
    "nccl-error": 30,
    "nccl-transport": 90,  # two GPUs: two launches, each a tiny compile and 25 all-reduces of 256 MiB
    "alloc-conf": 20,
    "fp32-attention": 30,
    "flash-attention": 2 * (START_S + 35),  # one block of `small`, one of the 8B shape, each compiled cold
    "features": 2 * (START_S + COLD_COMPILE_S + 10) + 2 * (START_S + WARM_COMPILE_S + 10) + 30,  # 4 launches, Newton-Schulz
    "float8": 2 * (START_S + COLD_COMPILE_S + 40),  # the 8B shape at 4 layers, bf16 then float8, each compiled cold, 50 steps
    # the grouped kernel vs a loop; `small` 4x top-2, dropless then capacity 1.25, each compiled cold, 40 steps
    "moe": START_S + 10 + 2 * (START_S + COLD_COMPILE_S + 20),
    # `small` uncompiled, 40 steps and 4 saves of 1.7 GiB, sync then async (~60 s each beyond the
    # launch); the two checkpoints compared (20 s); a resumed run's 10 steps and 3 saves (30 s)
    "checkpoints": 3 * START_S + 2 * 60 + 20 + 30,
}
"""Seconds each check takes on one H100 (two for the two-GPU checks), cold compile cache, without --quick."""


def group_seconds(checks: Iterable[str], estimates: Mapping[str, int] = ESTIMATED_S) -> int:
    """A group's estimated time: its checks and the run's overhead."""
    return OVERHEAD_S + sum(estimates[name] for name in checks)


def minutes(seconds: int) -> float:
    """Seconds as minutes rounded up to the half minute, as the doc states them."""
    return math.ceil(seconds / 30) / 2
