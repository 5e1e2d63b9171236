"""Host memory, and the launcher's plan: which parallelism a run uses and whether it offloads.

plan_parallelism is the one decision, made by the launcher (launcher/prepare.py) before any worker
starts and, run without it, by each worker (pretrain/build.py): it makes training.parallelism
and training.cpu_offload concrete from the per-GPU estimate (pretrain/plan/gpu_memory.py) and the host
memory counted here, or refuses the run in one line that says what would help. On several nodes
HSDP shards over one node's ranks (local_ranks); CPU offload is FSDP's, over every rank. Torch-free: the
launcher imports it.

Host memory per process: FSDP with CPU offload (training.cpu_offload) keeps the sharded
weights, gradients and AdamW state there (16P/W bytes per rank, the pinned shards rounded up by
the caching host allocator: PINNED_ROUNDING); on CPU workers the whole per-GPU estimate is host
memory, less the CUDA allowance plus a process's own. At the end of a run rank 0 also gathers
its largest tensor there, twice, to export the weights one tensor at a time when they are sharded
(export_copy_bytes). The local checkpoint tier in /dev/shm is memory too: one checkpoint kept
and one being written, per host (pretrain/plan/checkpoint_memory.py), counted once the rest is
planned: it never costs recomputation or offload, the default one is given up where it does not
fit. An asynchronous checkpoint stages a copy of the state in host memory, taken only where it
fits beside all that (plan_checkpoints). A run plans
on HOST_SHARE of the host memory available when it starts, shared by the ranks on that host.
An offload the config leaves open (null) is taken only when the run does not fit the GPUs
without it, fits them with it, training.parallelism is not ddp and the host has the memory.
"""

from __future__ import annotations

import dataclasses
import os

from pretrain.model import recompute
from pretrain.config import (
    CHECKPOINTING_MODES,
    SHARDED_MODES,
    Config,
    ConfigError,
    activation_checkpointing,
    micro_batch_choices,
    with_micro_batch,
    without_gpu_memory,
)
from pretrain.plan.checkpoint_memory import local_tier_bytes, size, staged_bytes
from pretrain.plan.compile_prerequisites import compile_requested
from pretrain.plan.gpu_memory import (
    FP32,
    GIB,
    LOSS_CHUNK_TOKENS,
    MemoryEstimate,
    block_parameter_count,
    ceil_div,
    check_fits,
    choose_parallelism,
    embedding_parameter_count,
    estimate,
    fits_gpu,
    gib,
    join_or,
    loss_chunked,
    optimizer_state_bytes,
    parameter_count,
    several_nodes,
    with_training,
)
from pretrain.plan.gpu_memory import planned_gpu_memory as planned_gpu_memory  # the launcher's, from here as before
from pretrain.plan.gpu_memory import with_gpu_memory as with_gpu_memory

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
    per = host_estimate(config, world_size, mode, on_gpus, shard_ranks=local_ranks)
    return per, per.total * local_ranks + export_copy_bytes(config, world_size, mode, offload=on_gpus)


def _export_part(config: Config, world_size: int, mode: str, offload: bool) -> str:
    copy = export_copy_bytes(config, world_size, mode, offload)
    return f" + {gib(copy)} for the export's largest tensor" if copy else ""


def _host_use(config: Config, world_size: int, mode: str, local_ranks: int, on_gpus: bool) -> int:
    """What a planned run keeps in one host's memory before any checkpoint: its processes (CPU
    workers' or offload's tensors where they are there, else each process's overhead)."""
    if on_gpus and not config.training.cpu_offload:
        return HOST_OVERHEAD_BYTES * local_ranks
    return _host_need(config, world_size, "fsdp" if config.training.cpu_offload else mode, local_ranks, on_gpus)[1]


def _with_local_tier(
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
    """config with everything the plan decides made concrete for the workers (training.parallelism
    "ddp", "fsdp" or "hsdp", cpu_offload, activation_checkpointing and grad_accum_nums never "auto",
    loss_chunk_tokens and reshard_after_forward never null), and the launcher's line saying what
    was chosen and what its recomputation costs.

    What is recomputed comes first: of the choices config leaves open (recompute_choices), the
    one with the fewest extra FLOPs that fits, each with the parallelism that fits it (DDP where
    it fits, else FSDP, for "auto"; on several nodes HSDP before FSDP whatever it recomputes:
    FSDP over every node sends each micro-batch's all-gathers and reduce-scatters across them);
    then, under grad_accum_nums "auto", the largest micro-batch
    that fits with it (batch_choices: a larger micro-batch never buys more recomputation, whose
    extra FLOPs cost more than the smaller matmuls of a smaller micro-batch); then, under FSDP,
    blocks stay gathered from their forward to their backward where that still fits (less
    traffic). gpu_memory_bytes is the smallest GPU's
    memory, None on CPU workers (DDP unless the user chose FSDP or HSDP; the least recomputation the
    host memory allows). host_memory_bytes is the host memory available (None: no host check,
    and no automatic offload), shared by local_ranks processes (default world_size), the ranks
    of one node: HSDP shards over them. "hsdp" on one node is FSDP, said in a warning clause.
    ConfigError, one line, when the run fits neither the GPUs nor, with CPU offload, the GPUs
    and the host, or "hsdp" on several nodes does not fit sharded within one."""
    local_ranks = local_ranks or world_size
    on_gpus = gpu_memory_bytes is not None
    alone = ""
    if config.training.parallelism == "hsdp" and not several_nodes(world_size, local_ranks):
        config = with_training(config, parallelism="fsdp")  # nothing to replicate across: the workers get FSDP
        alone = "; warning: training.parallelism=hsdp on one node is FSDP (no other node to replicate across)"
    original = config
    choices = [split for choice in recompute_choices(config) for split in batch_choices(choice, world_size, on_gpus)]
    if gpu_memory_bytes is not None:
        config, mode, offload = _choose_on_gpus(choices, world_size, gpu_memory_bytes, host_memory_bytes, local_ranks)
    else:
        config, mode, offload = _choose_on_cpus(choices, world_size, host_memory_bytes, local_ranks)
    planned = with_training(
        config,
        parallelism=mode,
        cpu_offload=offload,
        reshard_after_forward=_reshard_after_forward(config, world_size, mode, offload, gpu_memory_bytes, local_ranks),
    )
    planned, local = _with_local_tier(planned, world_size, mode, host_memory_bytes, local_ranks, on_gpus)
    local += alone
    unit = ("GPU" if on_gpus else "CPU worker") + ("" if world_size == 1 else "s")
    if offload:
        line = f"parallelism: FSDP with CPU offload over {world_size} {unit}"
    elif world_size == 1:
        line = f"parallelism: none, one {unit}"
    elif mode == "hsdp":
        nodes = f"{world_size // local_ranks} nodes x {local_ranks}"
        line = f"parallelism: HSDP over {world_size} {unit} ({nodes}, sharded within each node, replicated across nodes)"
    else:
        line = f"parallelism: {mode.upper()} over {world_size} {unit}"
    if gpu_memory_bytes is None:
        recomputes = activation_checkpointing(planned) != "none" or loss_chunked(planned)
        if recomputes:  # CPU lines say only what is recomputed, and a micro-batch chosen
            line += f"; {recomputation(planned)}"
        return planned, line + _micro_batch(original, planned) + local
    needed = estimate(planned, world_size, mode, offload, local_ranks).total
    detail = f"estimated {gib(needed)} GiB of {gib(gpu_memory_bytes)} GiB per GPU"
    if offload:
        _, host_needed = _host_need(planned, world_size, mode, local_ranks, on_gpus=True)
        detail += f" and {gib(host_needed)} GiB of host memory"
        if host_memory_bytes is not None:
            detail += f" of {gib(host_memory_bytes)} GiB available"
        least = choices[-1]  # what the run would need at least without offload: more recomputed
        least_mode = choose_parallelism(least, world_size, gpu_memory_bytes, local_ranks)
        without = estimate(least, world_size, least_mode, shard_ranks=local_ranks)
        detail += f"; without offload ~{gib(without.total)} GiB per GPU"
    elif mode in SHARDED_MODES and config.training.parallelism == "auto":
        detail += f"; DDP would need ~{gib(estimate(planned, world_size, 'ddp').total)} GiB"
        if mode == "hsdp":
            detail += f"; FSDP over all {world_size} would send every all-gather across nodes"
        elif several_nodes(world_size, local_ranks):
            hsdp = estimate(planned, world_size, "hsdp", shard_ranks=local_ranks).total
            detail += f", HSDP (sharded within a node) ~{gib(hsdp)} GiB"
    gathering = _gathering(planned, world_size, gpu_memory_bytes, local_ranks)
    return planned, f"{line} ({detail}); {recomputation(planned)}{gathering}{_micro_batch(original, planned)}{local}"


def batch_choices(config: Config, world_size: int, on_gpus: bool) -> list[Config]:
    """config with training.grad_accum_nums "auto" made concrete in every way the plan may try,
    largest micro-batch first: each divisor of the per-rank batch on GPUs, where the largest that
    fits is taken; on CPU workers, with no GPU memory to fill, one (without_gpu_memory: the
    largest at most training.batch_size). Any other config as it is."""
    if config.training.grad_accum_nums != "auto":
        return [config]
    if not on_gpus:
        return [without_gpu_memory(config, world_size)]
    return [with_micro_batch(config, world_size, batch) for batch in micro_batch_choices(config, world_size)]


def _micro_batch(config: Config, planned: Config) -> str:
    """What the launcher's line says of a micro-batch the plan chose (grad_accum_nums "auto")."""
    if config.training.grad_accum_nums != "auto":
        return ""
    t = planned.training
    return f"; micro-batch: {t.batch_size} sequences x {t.grad_accum_nums} per step (grad_accum_nums auto)"


def undecided(config: Config) -> bool:
    """Whether config leaves anything to plan_parallelism (a worker started by the launcher gets
    everything decided; one run alone decides for itself)."""
    t = config.training
    left = (t.cpu_offload, t.loss_chunk_tokens, t.reshard_after_forward)
    return t.parallelism == "auto" or "auto" in (t.activation_checkpointing, t.grad_accum_nums) or None in left


def recompute_choices(config: Config) -> list[Config]:
    """config with what it leaves to the plan made concrete in every way it may be: each activation
    checkpointing mode for "auto", a loss in one piece and in chunks of LOSS_CHUNK_TOKENS for a
    null training.loss_chunk_tokens. Fewest extra FLOPs first (pretrain/model/recompute.py); among
    equals (selective costs no matmul FLOPs, and under debug.trace_nonfinite no mode recomputes
    anything) less recomputed, then the loss in one piece. The last keeps the least memory."""
    t = config.training
    modes = CHECKPOINTING_MODES if t.activation_checkpointing == "auto" else (t.activation_checkpointing,)
    chunks = (0, LOSS_CHUNK_TOKENS) if t.loss_chunk_tokens is None else (t.loss_chunk_tokens,)
    choices = [
        with_training(config, activation_checkpointing=mode, loss_chunk_tokens=chunk) for mode in modes for chunk in chunks
    ]
    if config.model.vocab_size is None:  # no FLOPs to count yet (the plan before the dataset fixes it)
        return choices
    return sorted(choices, key=recompute.extra_flops_share)  # stable: ties keep the order above


def recomputation(config: Config) -> str:
    """What a planned config recomputes and its cost in FLOPs, as the parallelism line says it:
    "activation checkpointing: selective (+0% FLOPs); loss: one piece"."""
    mode = activation_checkpointing(config)
    share = recompute.checkpointing_flops_per_token(config) / recompute.model_flops_per_token(config)
    text = "activation checkpointing: " + (mode if mode == "none" else f"{mode} ({recompute.percent(share)} FLOPs)")
    if loss_chunked(config):
        loss = recompute.loss_flops_per_token(config) / recompute.model_flops_per_token(config)
        return text + f"; loss: chunks of {config.training.loss_chunk_tokens} tokens ({recompute.percent(loss)} FLOPs)"
    return text + "; loss: one piece"


def _gathering(config: Config, world_size: int, gpu_memory_bytes: int | None, local_ranks: int) -> str:
    """Under FSDP or HSDP over several GPUs, whether blocks stay gathered from forward to backward,
    and what keeping them would take where they do not."""
    t = config.training
    if t.parallelism not in SHARDED_MODES or world_size == 1 or t.cpu_offload:
        return ""
    if not t.reshard_after_forward:
        return "; blocks stay gathered from forward to backward (one all-gather fewer per micro-batch)"
    kept = estimate(with_training(config, reshard_after_forward=False), world_size, t.parallelism, shard_ranks=local_ranks).total
    return f"; blocks gathered again for the backward (keeping them would need ~{gib(kept)} GiB)"


def _reshard_after_forward(
    config: Config, world_size: int, mode: str, offload: bool, gpu_memory_bytes: int | None, local_ranks: int
) -> bool:
    """training.reshard_after_forward made concrete: as set, else false (keep the blocks gathered)
    under FSDP or HSDP on several GPUs without offload when that fits, else true."""
    chosen = config.training.reshard_after_forward
    if chosen is not None:
        return chosen
    if mode not in SHARDED_MODES or world_size == 1 or offload or gpu_memory_bytes is None:
        return True
    kept = with_training(config, reshard_after_forward=False)
    return not fits_gpu(estimate(kept, world_size, mode, shard_ranks=local_ranks).total, gpu_memory_bytes)


def _choose_on_cpus(
    choices: list[Config], world_size: int, host_memory_bytes: int | None, local_ranks: int
) -> tuple[Config, str, bool]:
    """(config, mode, offload) on CPU workers: DDP unless FSDP, HSDP or offload was chosen, and the
    first of choices whose workers fit the host (any, without a host figure)."""
    t = choices[0].training
    offload = bool(t.cpu_offload)
    mode = "fsdp" if offload else choose_parallelism(choices[0], world_size, None, local_ranks)
    if host_memory_bytes is None:
        return choices[0], mode, offload
    for config in choices:
        if _host_need(config, world_size, mode, local_ranks, on_gpus=False)[1] <= HOST_SHARE * host_memory_bytes:
            return config, mode, offload
    check_host_fits(choices[-1], world_size, mode, host_memory_bytes, local_ranks, on_gpus=False)
    raise AssertionError("check_host_fits raises when the run does not fit")  # unreachable


def _choose_on_gpus(
    choices: list[Config], world_size: int, gpu_memory_bytes: int, host_memory_bytes: int | None, local_ranks: int
) -> tuple[Config, str, bool]:
    """(config, mode, offload): the first of choices that fits the GPUs without offload, unless
    offload is asked for; with it (null) when only it fits, the host's memory permitting. A run
    that fits in no way is refused with the estimate of the last choice, which keeps the least.
    Offload is FSDP's over every rank: "hsdp" on several nodes never offloads."""
    t, least = choices[0].training, choices[-1]
    hsdp = t.parallelism == "hsdp"  # on several nodes: plan_parallelism made it "fsdp" on one
    if t.cpu_offload:
        if t.parallelism in ("ddp", "hsdp"):
            why = " (offload shards over every rank, not within a node)" if hsdp else ""
            raise ConfigError(
                f"training.cpu_offload=true needs FSDP but training.parallelism is {t.parallelism}{why}; "
                "set training.parallelism=fsdp or auto"
            )
        config = _first_fitting_offload(choices, world_size, gpu_memory_bytes) or least
        check_fits(config, world_size, gpu_memory_bytes, "fsdp", offload=True)
        if host_memory_bytes is not None:
            check_host_fits(config, world_size, "fsdp", host_memory_bytes, local_ranks, on_gpus=True)
        return config, "fsdp", True
    for modes in _mode_passes(choices[0], world_size, local_ranks):
        for config in choices:
            for mode in modes:
                if fits_gpu(estimate(config, world_size, mode, shard_ranks=local_ranks).total, gpu_memory_bytes):
                    return config, mode, False
    mode = choose_parallelism(least, world_size, gpu_memory_bytes, local_ranks)
    offloaded = _first_fitting_offload(choices, world_size, gpu_memory_bytes)
    if t.cpu_offload is False or t.parallelism == "ddp" or hsdp or host_memory_bytes is None or offloaded is None:
        check_fits(least, world_size, gpu_memory_bytes, mode, shard_ranks=local_ranks)  # raises: say what does fit
    assert offloaded is not None and host_memory_bytes is not None  # check_fits raised otherwise
    per, needed = _host_need(offloaded, world_size, "fsdp", local_ranks, on_gpus=True)
    if needed <= HOST_SHARE * host_memory_bytes:
        return offloaded, "fsdp", True
    check_fits(
        least,
        world_size,
        gpu_memory_bytes,
        mode,
        note=f", and CPU offload would need ~{gib(per.total)} GiB of host memory per GPU ({per.parts()}) "
        f"x {local_ranks}{_export_part(offloaded, world_size, 'fsdp', True)} = {gib(needed)} GiB but this "
        f"machine has {gib(host_memory_bytes)} GiB available",
        shard_ranks=local_ranks,
    )
    raise AssertionError("check_fits raises when the run does not fit")  # unreachable: nothing fitted


def _mode_passes(config: Config, world_size: int, local_ranks: int) -> list[tuple[str, ...]]:
    """The modes _choose_on_gpus tries for each choice, pass after pass: the one asked for; for
    "auto", DDP then FSDP, on several nodes DDP then HSDP for every choice before FSDP for any."""
    chosen = config.training.parallelism
    if chosen != "auto":
        return [(chosen,)]
    if world_size == 1:
        return [("ddp",)]
    if several_nodes(world_size, local_ranks):
        return [("ddp", "hsdp"), ("fsdp",)]
    return [("ddp", "fsdp")]


def _first_fitting_offload(choices: list[Config], world_size: int, gpu_memory_bytes: int) -> Config | None:
    """The first of choices whose GPU part fits with FSDP and CPU offload."""
    for config in choices:
        if fits_gpu(estimate(config, world_size, "fsdp", offload=True).total, gpu_memory_bytes):
            return config
    return None
