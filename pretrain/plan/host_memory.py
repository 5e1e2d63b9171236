"""Host memory: what a run keeps in the memory of each host, and how checkpoints are written.

Per process: FSDP with CPU offload (training.cpu_offload) keeps the sharded weights, gradients
and AdamW state there (16P/W bytes per rank, the pinned shards rounded up by the caching host
allocator: PINNED_ROUNDING); on CPU workers the whole per-GPU estimate is host memory, less the
CUDA allowance plus a process's own. At the end of a run rank 0 also gathers its largest tensor
there, twice, to export the weights one tensor at a time when they are sharded
(export_copy_bytes). The local checkpoint tier in /dev/shm is memory too: one checkpoint kept
and one being written, per host (pretrain/plan/checkpoint_memory.py), counted once the rest is
planned (with_local_tier): it never costs recomputation or offload, the default one is given up
where it does not fit. An asynchronous checkpoint stages a copy of the state in host memory,
taken only where it fits beside all that (plan_checkpoints). A run plans on HOST_SHARE of the
host memory available when it starts, shared by the ranks on that host.

The launcher's plan (pretrain/plan/parallelism.py) reads these when it decides on CPU offload and
CPU workers. Torch-free: the launcher imports it.
"""

from __future__ import annotations

import dataclasses
import os

from pretrain.config import SHARDED_MODES, Config, ConfigError
from pretrain.plan.checkpoint_memory import local_tier_bytes, size, staged_bytes
from pretrain.plan.compile_prerequisites import compile_requested
from pretrain.plan.gpu_memory import (
    FP32,
    GIB,
    MemoryEstimate,
    block_parameter_count,
    ceil_div,
    embedding_parameter_count,
    estimate,
    gib,
    join_or,
    optimizer_state_bytes,
    parameter_count,
    with_training,
)

HOST_OVERHEAD_BYTES = GIB
"""Host memory of one training process besides its tensors: Python, torch's libraries, the data loader."""
HOST_SHARE = 0.9
"""A run may plan on this share of the host memory available when it starts (the rest: the OS,
the launcher, other processes' growth)."""
PINNED_ROUNDING = 8 / 7
"""Pinned host memory per byte asked for, at worst for Llama shapes (224 MiB rounded to 256 MiB)."""
HOST_MEMORY_ENV = "LAUNCHER_HOST_MEMORY_GIB"
"""Tests (and users who know better) set the host memory available, in GiB, instead of psutil's figure."""


def host_estimate(config: Config, world_size: int, mode: str, on_gpus: bool, shard_ranks: int | None = None) -> MemoryEstimate:
    """Host memory per process: on GPUs, FSDP with CPU offload's shards of the weights,
    gradients and AdamW state (mode "fsdp" only); on CPU workers, everything the GPU estimate
    counts but the CUDA allowance (shard_ranks: the ranks of a node, HSDP's shard group)."""
    if not on_gpus:  # compiled as a CPU run is (training.compile null: not), not as a GPU's estimate counts it
        on_cpu = with_training(config, compile=compile_requested(config, "cpu"))
        return dataclasses.replace(estimate(on_cpu, world_size, mode, shard_ranks=shard_ranks), overhead=HOST_OVERHEAD_BYTES)
    if mode != "fsdp":
        raise ValueError("on GPUs only FSDP with CPU offload keeps the model in host memory")
    shard = ceil_div(FP32 * parameter_count(config.model), world_size)
    # The weights' and gradients' shards are pinned, through the caching host allocator, which
    # rounds a block up to a power of two (a 224 MiB shard of a 14336 x 4096 matrix takes 256).
    pinned = int(shard * PINNED_ROUNDING)
    return MemoryEstimate(
        mode=mode,
        world_size=world_size,
        weights=pinned,
        gradients=pinned,
        optimizer=ceil_div(optimizer_state_bytes(config.training) * parameter_count(config.model), world_size),
        activations=0,
        logits=0,
        overhead=HOST_OVERHEAD_BYTES,
    )


def host_memory_bytes() -> int:
    """The host memory available now (psutil), or LAUNCHER_HOST_MEMORY_GIB when set."""
    given = os.environ.get(HOST_MEMORY_ENV, "").strip()
    if given:
        try:
            value = float(given)
        except ValueError:
            value = -1.0
        if not 0 < value < float("inf"):
            raise ConfigError(f"{HOST_MEMORY_ENV}={given!r} is not a positive number of GiB; unset it or give one")
        return int(value * GIB)
    import psutil  # here: only the launcher's memory checks need it

    return psutil.virtual_memory().available


def check_host_fits(config: Config, world_size: int, mode: str, host_memory_bytes: int, local_ranks: int, on_gpus: bool) -> None:
    """ConfigError (one line: the estimate per process and for this machine, its memory, what
    would help) when local_ranks processes need more than HOST_SHARE of the host's memory: CPU
    workers (on_gpus False) or GPU ranks with CPU offload."""
    per, needed = host_need(config, world_size, mode, local_ranks, on_gpus)
    if needed <= HOST_SHARE * host_memory_bytes:
        return
    what = "GPU with CPU offload" if on_gpus else "CPU worker"
    ranks = "GPUs" if on_gpus else "workers"
    raise ConfigError(
        f"preset {config.preset} needs ~{gib(per.total)} GiB of host memory per {what} "
        f"({per.parts()}) x {local_ranks} {ranks}{export_part(config, world_size, mode, on_gpus)} "
        f"= {gib(needed)} GiB but this machine has "
        f"{gib(host_memory_bytes)} GiB available (a run plans on {HOST_SHARE:.0%} of it); "
        + _host_hint(config, world_size, mode, host_memory_bytes, on_gpus)
    )


def host_need(config: Config, world_size: int, mode: str, local_ranks: int, on_gpus: bool) -> tuple[MemoryEstimate, int]:
    """One process's host memory, and the host's: local_ranks processes, plus the export's copy."""
    per = host_estimate(config, world_size, mode, on_gpus, shard_ranks=local_ranks)
    return per, per.total * local_ranks + export_copy_bytes(config, world_size, mode, offload=on_gpus)


def export_part(config: Config, world_size: int, mode: str, offload: bool) -> str:
    """The clause that counts the export's copy of the largest tensor in a host's need, or nothing."""
    copy = export_copy_bytes(config, world_size, mode, offload)
    return f" + {gib(copy)} for the export's largest tensor" if copy else ""


def _host_use(config: Config, world_size: int, mode: str, local_ranks: int, on_gpus: bool) -> int:
    """What a planned run keeps in one host's memory before any checkpoint: its processes (CPU
    workers' or offload's tensors where they are there, else each process's overhead)."""
    if on_gpus and not config.training.cpu_offload:
        return HOST_OVERHEAD_BYTES * local_ranks
    return host_need(config, world_size, "fsdp" if config.training.cpu_offload else mode, local_ranks, on_gpus)[1]


def with_local_tier(
    config: Config, world_size: int, mode: str, host_memory_bytes: int | None, local_ranks: int, on_gpus: bool
) -> tuple[Config, str]:
    """The local checkpoint tier counted against host memory once the rest is planned (it never
    costs recomputation or offload): kept where its two checkpoints fit beside the run; where not,
    the default directory (/dev/shm) is given up, said on the plan's line, and a directory in
    /dev/shm the user named is refused in one line."""
    local = local_tier_bytes(config, world_size, mode, local_ranks)
    if not local or host_memory_bytes is None:
        return config, ""
    room = HOST_SHARE * host_memory_bytes - _host_use(config, world_size, mode, local_ranks, on_gpus)
    if local <= room:
        return config, ""
    short = f"two local checkpoints in /dev/shm need {size(local)} of host memory, {size(max(0.0, room))} is left"
    if config.training.local_checkpoint_dir:
        raise ConfigError(
            f"training.local_checkpoint_dir {config.training.local_checkpoint_dir}: {short} beside the run; name a "
            "directory on disk with --local-checkpoint-dir, or set training.local_checkpoint_interval=0"
        )
    return with_training(config, local_checkpoint_interval=0), f"; no local checkpoints ({short})"


def plan_checkpoints(
    config: Config, world_size: int, host_memory_bytes: int | None, local_ranks: int | None = None, on_gpus: bool = True
) -> tuple[Config, str]:
    """config with training.async_checkpoint made concrete from the planned config (parallelism
    decided), and the line saying how checkpoints are written. "auto" is asynchronous where the
    staged copy fits HOST_SHARE of host_memory_bytes beside what the run keeps there (its
    processes, CPU workers' or offload's tensors, the local tier), else synchronous, the line a
    warning; true where it does not fit: ConfigError, one line. host_memory_bytes None: no
    figure, "auto" stays for the workers to decide."""
    t = config.training
    local_ranks = local_ranks or world_size
    mode = "fsdp" if t.cpu_offload else t.parallelism  # planned: "ddp", "fsdp" or "hsdp" (a single process plans as ddp)
    staged = staged_bytes(config, world_size, mode, local_ranks)
    if t.async_checkpoint is False:
        return config, "checkpoints: synchronous (training.async_checkpoint=false)"
    if host_memory_bytes is None:
        return config, f"checkpoints: asynchronous, staged in {size(staged)} of host memory"
    used = _host_use(config, world_size, mode, local_ranks, on_gpus) + local_tier_bytes(config, world_size, mode, local_ranks)
    room = HOST_SHARE * host_memory_bytes - used
    if staged <= room:
        line = f"checkpoints: asynchronous, staged in {size(staged)} of host memory"
        return with_training(config, async_checkpoint=True), line
    short = (
        f"the staged copy needs {size(staged)} of host memory but {size(max(0.0, room))} is left of the "
        f"{gib(host_memory_bytes)} GiB available (a run plans on {HOST_SHARE:.0%} of it, less its own use)"
    )
    if t.async_checkpoint is True:
        raise ConfigError(
            f"training.async_checkpoint=true: {short}; set training.async_checkpoint=false (or auto), or free host memory"
        )
    return with_training(config, async_checkpoint=False), f"warning: checkpoints written synchronously: {short}"


def export_copy_bytes(config: Config, world_size: int, mode: str, offload: bool) -> int:
    """At the end of a run rank 0 exports the weights one tensor at a time (pretrain/hf/export.py):
    it gathers a tensor whole in fp32 into host memory and converts it (transformers' row order,
    the export's dtype, at most fp32 again) before the next, so at most two copies of the largest
    tensor are there on top of its shards, once per host, when the weights are sharded (FSDP or
    HSDP over several ranks, or offloaded). The largest is the embedding or the output projection, or for a
    wide block one of its weights, which a block's whole count bounds. A full replica (DDP, one
    process) converts from the tensors it already holds."""
    sharded = mode in SHARDED_MODES and (world_size > 1 or offload)
    largest = max(embedding_parameter_count(config.model), block_parameter_count(config.model))
    return 2 * FP32 * largest if sharded else 0


def _host_hint(config: Config, world_size: int, mode: str, host_memory_bytes: int, on_gpus: bool) -> str:
    def fits(ranks: int, as_mode: str) -> bool:
        return host_need(config, ranks, as_mode, ranks, on_gpus)[1] <= HOST_SHARE * host_memory_bytes

    found = []
    if on_gpus:
        found.append("--set training.cpu_offload=false with more GPUs")
    else:
        if mode == "ddp" and world_size > 1 and fits(world_size, "fsdp"):
            found.append("--set training.parallelism=fsdp")
        if world_size > 1 and fits(1, "ddp"):
            found.append("--nproc 1")
    if config.preset not in ("small", "debug"):
        found.append("--preset small or --debug")
    return "use " + join_or(found) if found else "use a smaller model or a machine with more memory"
