"""The launcher's plan: which parallelism a run uses, what it recomputes, and whether it offloads.

plan_parallelism is the one decision, made by the launcher (launcher/prepare.py) before any worker
starts and, run without it, by each worker (pretrain/build.py): it makes training.parallelism
and training.cpu_offload concrete from the per-GPU estimate (pretrain/plan/gpu_memory.py) and the host
memory (pretrain/plan/host_memory.py), or refuses the run in one line that says what would help. On
several nodes HSDP shards over one node's ranks (local_ranks); CPU offload is FSDP's, over every
rank. An offload the config leaves open (null) is taken only when the run does not fit the GPUs
without it, fits them with it, training.parallelism is not ddp and the host has the memory.
Torch-free: the launcher imports it.
"""

from __future__ import annotations

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
from pretrain.plan.gpu_memory import (
    LOSS_CHUNK_TOKENS,
    check_fits,
    choose_parallelism,
    estimate,
    fits_gpu,
    gib,
    loss_chunked,
    several_nodes,
    with_training,
)
from pretrain.plan.gpu_memory import planned_gpu_memory as planned_gpu_memory  # the launcher's, from here as before
from pretrain.plan.gpu_memory import with_gpu_memory as with_gpu_memory

from pretrain.plan.host_memory import HOST_SHARE, check_host_fits, export_part, host_need, with_local_tier


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
    planned, local = with_local_tier(planned, world_size, mode, host_memory_bytes, local_ranks, on_gpus)
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
        _, host_needed = host_need(planned, world_size, mode, local_ranks, on_gpus=True)
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
        if host_need(config, world_size, mode, local_ranks, on_gpus=False)[1] <= HOST_SHARE * host_memory_bytes:
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
    per, needed = host_need(offloaded, world_size, "fsdp", local_ranks, on_gpus=True)
    if needed <= HOST_SHARE * host_memory_bytes:
        return offloaded, "fsdp", True
    check_fits(
        least,
        world_size,
        gpu_memory_bytes,
        mode,
        note=f", and CPU offload would need ~{gib(per.total)} GiB of host memory per GPU ({per.parts()}) "
        f"x {local_ranks}{export_part(offloaded, world_size, 'fsdp', True)} = {gib(needed)} GiB but this "
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
