"""The build phase: from a config to a Trainer, what a run trains with.

It settles how the ranks share the model (parallel_mode: DDP, FSDP, HSDP or one process, CPU
offload, and whether the run fits the GPU at all), then builds the model on the meta
device, shards it, and adds the optimizer, the data and the metrics log."""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist

from pretrain.checkpoint.async_save import CheckpointWriter
from pretrain.checkpoint.tiers import base_of, run_tiers
from pretrain.plan import gpu_memory as memory, host_memory, parallelism as memory_plan
from pretrain.plan.checkpoint_memory import held_in_memory
from pretrain.plan.compile_prerequisites import compile_off_line, compile_requested, missing_compile_prerequisite
from pretrain.distributed import float8, parallel
from pretrain.plan import float8 as float8_plan
from pretrain import config as cfg
from pretrain.config import Config
from pretrain.data import DataError
from pretrain.data.loader import TokenIdError, TrainBatches, ValBatch, validation_batches
from pretrain.numerics.debug import FirstNonFinite
from pretrain.observe.metrics import MetricsLog
from pretrain.observe.progress import PROGRESS_VAR
from pretrain.observe.stragglers import StragglerWatch, watch_for
from pretrain.observe.wandb_log import WandbRun
from pretrain.model.transformer import Transformer
from pretrain.optim.optimizers import build_optimizer
from pretrain.distributed.runtime import Runtime
from pretrain.evaluation.hellaswag import TaskExamples
from pretrain.run.faults import Faults
from pretrain.run.stopping import StopRequest


@dataclass
class Trainer:
    config: Config
    runtime: Runtime
    model: torch.nn.Module
    """The model as trained: wrapped in DDP or sharded by FSDP (or HSDP) when there is more than one rank."""
    mode: str
    """How the ranks share the model: "single", "ddp", "fsdp" or "hsdp" (pretrain/distributed/parallel.py MODES)."""
    optimizer: torch.optim.Optimizer
    loader: TrainBatches
    batches: Iterator[tuple[torch.Tensor, torch.Tensor]]
    """Iterates loader; loader.state_dict() names the next batch it yields."""
    val_batches: list[ValBatch]
    log: logging.Logger
    run_dir: Path
    metrics: MetricsLog
    stop: StopRequest = field(default_factory=StopRequest)
    start_step: int = 0
    """The first step this process runs: 0, or the steps done by the checkpoint it resumed."""
    tokenizer_file: Path | None = None
    """The dataset's tokenizer.json, exported with the weights (None: a built-in tokenizer)."""
    losses: list[float] = field(default_factory=list)
    """Global mean loss of every logged step."""
    tracer: FirstNonFinite | None = None
    """With debug.trace_nonfinite: the hooks that name the first module to produce NaN or Inf."""
    skipped_steps: int = 0
    """Updates dropped for NaN or Inf (debug.on_nonfinite=skip)."""
    skips_in_a_row: int = 0
    aux_losses: dict[str, torch.Tensor] = field(default_factory=dict)
    """The last step's auxiliary losses (a mixture of experts' load balancing), this rank's, by name."""
    counts: dict[str, torch.Tensor] = field(default_factory=dict)
    """The last step's counts, this rank's, by name, summed over its micro-batches (a mixture of
    experts' dropped assignments: pretrain/model/loss.py Loss.counts)."""
    task: TaskExamples | None = None
    """With evaluation.data: the benchmark's examples, scored during training (pretrain/evaluation/task_eval.py)."""
    stragglers: StragglerWatch | None = None
    """With several ranks: this rank's compute time per step, compared across ranks every
    logging.straggler_window steps (pretrain/observe/stragglers.py)."""
    float8_scales: Callable[[torch.nn.Module], None] | None = None
    """Under FSDP2 with training.float8: what computes every float8 weight's scale for the next
    all-gather, right after each optimizer step (pretrain/distributed/float8.py); None otherwise."""
    faults: Faults | None = None
    """The faults PRETRAIN_FAULTS scripts for this rank and attempt (pretrain/run/faults.py, a
    testing aid); None in an ordinary run."""
    checkpoints: CheckpointWriter = field(init=False)
    """What fit() saves checkpoints through, synchronously or in the background
    (training.async_checkpoint: pretrain/checkpoint/async_save.py); set by build()."""

    @property
    def tokens_per_step(self) -> int:
        t = self.config.training
        return t.batch_size * self.config.data.context_length * cfg.grad_accum_nums(self.config) * self.runtime.world_size


def gpu_memory(config: Config, device: torch.device) -> int | None:
    """The GPU memory the run plans on: system.gpu_memory_gib (under the launcher, the figure it
    planned with), else torch's total for the device; None on CPU."""
    if device.type != "cuda":
        return None
    if config.system.gpu_memory_gib is not None:
        return int(config.system.gpu_memory_gib * memory.GIB)
    return torch.cuda.get_device_properties(device).total_memory


def parallel_mode(config: Config, runtime: Runtime, run_dir: Path | None = None) -> tuple[Config, str]:
    """The config as the launcher's plan makes it concrete (training.parallelism, cpu_offload,
    activation_checkpointing, loss_chunk_tokens, reshard_after_forward: pretrain/plan/parallelism.py),
    and the mode: fsdp with CPU offload (even for one process), else single for
    one process, else the planned mode. A run that cannot fit the GPU fails here, before the model is built.
    Under the launcher everything is decided already and this only checks it; run without it,
    this process decides as the launcher would, on the smallest GPU of the ranks and (offload
    null) the host memory available now, shared by LOCAL_WORLD_SIZE ranks."""
    config = without_unbuildable_compile(config, runtime.device)
    gpu = gpu_memory(config, runtime.device)
    host = None
    if gpu is not None and memory_plan.undecided(config):  # every rank must decide alike
        if config.training.cpu_offload is None:
            gpu, host = smallest_across_ranks(runtime, gpu, host_memory.host_memory_bytes())
        else:
            (gpu,) = smallest_across_ranks(runtime, gpu)
    local_ranks = runtime.ranks_per_node
    config, line = memory_plan.plan_parallelism(config, runtime.world_size, gpu, host, local_ranks)
    if "warning: " in line and runtime.is_main:  # run alone (under the launcher its line said it, and nothing is left to warn of)
        logging.getLogger("pretrain").warning(line.split("warning: ", 1)[1])
    config = asynchronous_checkpoints(config, runtime, local_ranks, run_dir)
    if config.training.cpu_offload:  # the plan offloads only with FSDP over every rank (hsdp with offload is refused)
        return config, "fsdp"
    return config, config.training.parallelism if runtime.distributed else "single"


def asynchronous_checkpoints(config: Config, runtime: Runtime, local_ranks: int, run_dir: Path | None = None) -> Config:
    """config with training.async_checkpoint true or false (host_memory.plan_checkpoints): "auto"
    on where this host has memory for the staged copy, the same on every rank (the smallest host
    figure decides); off, one warning line; true without room refused (one line, exit 2). Only a
    worker run alone decides: under the launcher (which names a progress marker to every worker
    it starts) it is decided already, and the memory the launched workers hold by now would be
    counted twice. The run's own local checkpoints in /dev/shm (a restart's) count as available."""
    launched = bool(os.environ.get(PROGRESS_VAR))
    if config.training.async_checkpoint is False or (launched and config.training.async_checkpoint is True):
        return config
    own = held_in_memory(base_of(config, run_dir)) if run_dir is not None else 0
    (host,) = smallest_across_ranks(runtime, host_memory.host_memory_bytes() + own)
    on_gpus = runtime.device.type == "cuda"
    config, line = host_memory.plan_checkpoints(config, runtime.world_size, host, local_ranks, on_gpus)
    if line.startswith("warning: ") and runtime.is_main:
        logging.getLogger("pretrain").warning(line.removeprefix("warning: "))
    return config


def without_unbuildable_compile(config: Config, device: torch.device) -> Config:
    """config with training.compile off (and one warning line) when the run asks for compile but
    torch.compile could not build its kernels here: decided before the memory plan, which plans a
    compiled run with less memory than an eager one (the launcher does the same before its plan)."""
    if not compile_requested(config, device.type) or not (missing := missing_compile_prerequisite(device.type)):
        return config
    logging.getLogger("pretrain").warning(compile_off_line(missing))
    return dataclasses.replace(config, training=dataclasses.replace(config.training, compile=False))


def smallest_across_ranks(runtime: Runtime, *values: int) -> tuple[int, ...]:
    """Each value's minimum over the ranks, so that every rank makes the same choice: ranks read
    the host's free memory at different moments, and GPUs may differ in size. (On the device:
    NCCL reduces no host tensor, and gloo is beside it only when offload may be chosen.)"""
    if not runtime.distributed:
        return values
    smallest = torch.tensor(values, dtype=torch.int64, device=runtime.device)
    dist.all_reduce(smallest, op=dist.ReduceOp.MIN)
    return tuple(int(v) for v in smallest.tolist())


def build(config: Config, runtime: Runtime, dataset_dir: Path, run_dir: Path, log: logging.Logger) -> Trainer:
    config, mode = parallel_mode(config, runtime, run_dir)
    t = config.training
    torch.manual_seed(t.seed)
    # Built on the meta device (shapes, no storage): parallelize shards it and only then
    # allocates and initialises each rank's part from t.seed (the same weights whatever the
    # number of ranks), so no rank ever holds the whole model: an 8B model takes 32 GB in fp32.
    with torch.device("meta"):
        transformer = Transformer(config.model, max_seq_len=cfg.max_seq_len(config))
    log.info(
        f"Model: {transformer.num_params() / 1e6:.2f}M parameters, {config.model.n_layers} layers, "
        f"dim {config.model.dim}; device {runtime.device}; world size {runtime.world_size}"
        + (f"; {mode.upper()}" if mode != "single" else "")
        + ("; CPU offload (weights, gradients and optimizer state in host memory)" if t.cpu_offload else "")
    )
    model = parallel.parallelize(transformer, config, runtime, mode)  # as trained: under DDP a wrapper, not a Transformer
    optimizer = build_optimizer(model, t, runtime.device)  # after sharding: it holds the shards
    loader = TrainBatches(
        dataset_dir,
        config.data.context_length,
        t.batch_size,
        runtime.rank,
        runtime.world_size,
        t.seed,
        t.num_workers,
        pin_memory=runtime.device.type == "cuda",
        grad_accum=cfg.grad_accum_nums(config),
        vocab_size=config.model.vocab_size,
    )
    try:
        val = validation_batches(
            dataset_dir,
            config.data.context_length,
            t.batch_size,
            runtime.rank,
            runtime.world_size,
            t.eval_batches,
            vocab_size=config.model.vocab_size,
            grad_accum=cfg.grad_accum_nums(config),
        )
    except TokenIdError:
        raise  # damaged data stops the run; only a val split too small to use is skipped
    except DataError as error:
        # Every rank sees the same split, so every rank skips alike and collectives stay matched.
        log.warning(f"Validation skipped: {error}")
        val = []
    log.debug(
        f"Data: {dataset_dir}; {loader.batches_per_epoch} batches per epoch per rank; validation: "
        f"{sum(batch.windows for batch in val)} windows on this rank in {len(val)} batches; "
        f"{t.batch_size} x {config.data.context_length} tokens per micro-batch, {t.grad_accum_nums} micro-batches per step"
    )
    wandb = WandbRun(run_dir, config, log) if config.logging.wandb and runtime.is_main else None
    metrics = MetricsLog(run_dir, enabled=runtime.is_main, tensorboard=config.logging.tensorboard, logger=log, wandb=wandb)
    trainer = Trainer(config, runtime, model, mode, optimizer, loader, iter(loader), val, log, run_dir, metrics)
    asynchronous = bool(t.async_checkpoint)
    # DCP's background save runs its collectives on a gloo group of its own, made here by every
    # rank alike, so that they never interleave with training's on the default group.
    sharded = mode in cfg.SHARDED_MODES
    group = dist.new_group(backend="gloo") if asynchronous and sharded and runtime.distributed else None
    say = log.warning if runtime.is_main else None  # the local tier off (no room in /dev/shm): one line
    # Without the launcher the ranks agree on the local tier (one rank without room turns it off for all).
    tiers = run_tiers(config, run_dir, sharded, say, lambda usable: smallest_across_ranks(runtime, int(usable))[0] == 1)
    trainer.checkpoints = CheckpointWriter(trainer, asynchronous, group, tiers)
    trainer.stragglers = watch_for(config, runtime, model)  # under FSDP and HSDP: hooks that leave the all-gathers out
    if float8_plan.requested(config):
        converted = [name for name, module in parallel.unwrap(model).named_modules() if float8.is_float8(module)]
        log.info(f"Float8: {float8.describe(converted, config)}")
        trainer.float8_scales = float8.scale_precompute(model, config, parallel.has_fsdp(model))
    if config.debug.trace_nonfinite:
        trainer.tracer = FirstNonFinite(parallel.unwrap(model))
        log.debug("debug.trace_nonfinite: hooks on every module watch for the first NaN or Inf")
        if t.activation_checkpointing != "none" or t.compile:
            log.warning(
                "debug.trace_nonfinite turns off training.activation_checkpointing and training.compile "
                "(the hooks must see every module); set debug.trace_nonfinite=false to keep them"
            )
    return trainer
