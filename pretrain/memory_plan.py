"""Host memory, and the launcher's plan: which parallelism a run uses and whether it offloads.

plan_parallelism is the one decision, made by the launcher (launcher/cli.py) before any worker
starts and, run without it, by each worker (pretrain/build.py): it makes training.parallelism
and training.cpu_offload concrete from the per-GPU estimate (pretrain/memory.py) and the host
memory counted here, or refuses the run in one line that says what would help. Torch-free: the
launcher imports it.

Host memory per process: FSDP with CPU offload (training.cpu_offload) keeps the sharded
weights, gradients and AdamW state there (16P/W bytes per rank, the pinned shards rounded up by
the caching host allocator: PINNED_ROUNDING); on CPU workers the whole per-GPU estimate is host
memory, less the CUDA allowance plus a process's own. At the end of a run rank 0 also gathers
the whole model there to export it when the weights are sharded (export_copy_bytes). A run plans
on HOST_SHARE of the host memory available when it starts, shared by the ranks on that host.
An offload the config leaves open (null) is taken only when the run does not fit the GPUs
without it, fits them with it, training.parallelism is not ddp and the host has the memory.
"""

from __future__ import annotations

import dataclasses
import os

from pretrain.config import Config, ConfigError
from pretrain.memory import (
    FP32,
    GIB,
    MemoryEstimate,
    ceil_div,
    check_fits,
    choose_parallelism,
    estimate,
    fits_gpu,
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


# --- host memory ---------------------------------------------------------------------


def host_estimate(config: Config, world_size: int, mode: str, on_gpus: bool) -> MemoryEstimate:
    """Host memory per process: on GPUs, FSDP with CPU offload's shards of the weights,
    gradients and AdamW state (mode "fsdp" only); on CPU workers, everything the GPU estimate
    counts but the CUDA allowance."""
    if not on_gpus:
        return dataclasses.replace(estimate(config, world_size, mode), overhead=HOST_OVERHEAD_BYTES)
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
    per, needed = _host_need(config, world_size, mode, local_ranks, on_gpus)
    if needed <= HOST_SHARE * host_memory_bytes:
        return
    what = "GPU with CPU offload" if on_gpus else "CPU worker"
    ranks = "GPUs" if on_gpus else "workers"
    raise ConfigError(
        f"preset {config.preset} needs ~{gib(per.total)} GiB of host memory per {what} "
        f"({per.parts()}) x {local_ranks} {ranks}{_export_part(config, world_size, mode, on_gpus)} "
        f"= {gib(needed)} GiB but this machine has "
        f"{gib(host_memory_bytes)} GiB available (a run plans on {HOST_SHARE:.0%} of it); "
        + _host_hint(config, world_size, mode, host_memory_bytes, on_gpus)
    )


def _host_need(config: Config, world_size: int, mode: str, local_ranks: int, on_gpus: bool) -> tuple[MemoryEstimate, int]:
    """One process's host memory, and the host's: local_ranks processes, plus the export's copy."""
    per = host_estimate(config, world_size, mode, on_gpus)
    return per, per.total * local_ranks + export_copy_bytes(config, world_size, mode, offload=on_gpus)


def _export_part(config: Config, world_size: int, mode: str, offload: bool) -> str:
    copy = export_copy_bytes(config, world_size, mode, offload)
    return f" + {gib(copy)} for the export's whole copy" if copy else ""


def export_copy_bytes(config: Config, world_size: int, mode: str, offload: bool) -> int:
    """At the end of a run rank 0 gathers the whole model in fp32 into host memory to export it
    (pretrain/export.py), on top of its shards: 4P bytes, once per host, when the weights are
    sharded (FSDP over several ranks, or offloaded). A full replica (DDP, one process) is
    exported from the tensors it already holds."""
    sharded = mode == "fsdp" and (world_size > 1 or offload)
    return FP32 * parameter_count(config.model) if sharded else 0


def _host_hint(config: Config, world_size: int, mode: str, host_memory_bytes: int, on_gpus: bool) -> str:
    def fits(ranks: int, as_mode: str) -> bool:
        return _host_need(config, ranks, as_mode, ranks, on_gpus)[1] <= HOST_SHARE * host_memory_bytes

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


# --- the launcher's decision ------------------------------------------------------------


def plan_parallelism(
    config: Config,
    world_size: int,
    gpu_memory_bytes: int | None,
    host_memory_bytes: int | None = None,
    local_ranks: int | None = None,
) -> tuple[Config, str]:
    """config with training.parallelism ("ddp" or "fsdp") and training.cpu_offload (true or false)
    made concrete for the workers, and the launcher's line saying what was chosen.

    gpu_memory_bytes is the smallest GPU's memory, None on CPU workers (DDP unless the user chose
    FSDP). host_memory_bytes is the host memory available (None: no host check, and no automatic
    offload), shared by local_ranks processes (default world_size). ConfigError, one line, when
    the run fits neither the GPUs nor, with CPU offload, the GPUs and the host."""
    local_ranks = local_ranks or world_size
    on_gpus = gpu_memory_bytes is not None
    if gpu_memory_bytes is not None:
        mode, offload = _choose_on_gpus(config, world_size, gpu_memory_bytes, host_memory_bytes, local_ranks)
    else:
        mode, offload = choose_parallelism(config, world_size, None), bool(config.training.cpu_offload)
        if offload:
            mode = "fsdp"
        if host_memory_bytes is not None:
            check_host_fits(config, world_size, mode, host_memory_bytes, local_ranks, on_gpus=False)
    planned = with_training(config, parallelism=mode, cpu_offload=offload)
    unit = ("GPU" if on_gpus else "CPU worker") + ("" if world_size == 1 else "s")
    if offload:
        line = f"parallelism: FSDP with CPU offload over {world_size} {unit}"
    elif world_size == 1:
        line = f"parallelism: none, one {unit}"
    else:
        line = f"parallelism: {mode.upper()} over {world_size} {unit}"
    if gpu_memory_bytes is None:
        return planned, line
    detail = f"estimated {gib(estimate(config, world_size, mode, offload).total)} GiB of {gib(gpu_memory_bytes)} GiB per GPU"
    if offload:
        _, host_needed = _host_need(config, world_size, mode, local_ranks, on_gpus=True)
        detail += f" and {gib(host_needed)} GiB of host memory"
        if host_memory_bytes is not None:
            detail += f" of {gib(host_memory_bytes)} GiB available"
        without = estimate(config, world_size, choose_parallelism(config, world_size, gpu_memory_bytes))
        detail += f"; without offload ~{gib(without.total)} GiB per GPU"
    elif config.training.parallelism == "auto" and mode == "fsdp":
        detail += f"; DDP would need ~{gib(estimate(config, world_size, 'ddp').total)} GiB"
    return planned, f"{line} ({detail})"


def _choose_on_gpus(
    config: Config, world_size: int, gpu_memory_bytes: int, host_memory_bytes: int | None, local_ranks: int
) -> tuple[str, bool]:
    """(mode, offload): without offload when the run fits the GPUs or offload is off; with it
    when asked for, or (null) when only it fits, the host's memory permitting."""
    t = config.training
    mode = choose_parallelism(config, world_size, gpu_memory_bytes)
    if t.cpu_offload:
        if t.parallelism == "ddp":
            raise ConfigError(
                "training.cpu_offload=true needs FSDP but training.parallelism is ddp; set training.parallelism=fsdp or auto"
            )
        check_fits(config, world_size, gpu_memory_bytes, "fsdp", offload=True)
        if host_memory_bytes is not None:
            check_host_fits(config, world_size, "fsdp", host_memory_bytes, local_ranks, on_gpus=True)
        return "fsdp", True
    fits = fits_gpu(estimate(config, world_size, mode).total, gpu_memory_bytes)
    if fits or t.cpu_offload is False or t.parallelism == "ddp" or host_memory_bytes is None:
        check_fits(config, world_size, gpu_memory_bytes, mode)
        return mode, False
    if not fits_gpu(estimate(config, world_size, "fsdp", offload=True).total, gpu_memory_bytes):
        check_fits(config, world_size, gpu_memory_bytes, mode)  # offload would not fit either: say what does
    per, needed = _host_need(config, world_size, "fsdp", local_ranks, on_gpus=True)
    if needed <= HOST_SHARE * host_memory_bytes:
        return "fsdp", True
    check_fits(
        config,
        world_size,
        gpu_memory_bytes,
        mode,
        note=f", and CPU offload would need ~{gib(per.total)} GiB of host memory per GPU ({per.parts()}) "
        f"x {local_ranks}{_export_part(config, world_size, 'fsdp', True)} = {gib(needed)} GiB but this "
        f"machine has {gib(host_memory_bytes)} GiB available",
    )
    raise AssertionError("check_fits raises when the run does not fit")  # unreachable: fits was False
