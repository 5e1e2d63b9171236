"""Preparing a training launch, once per node and before any worker starts: the weights to start
from, the dataset (prepared and cached), the run length, and the plan (DDP, FSDP or HSDP, what is
recomputed, offload), each refused in one line while nothing is spawned or written; then the
resolved config written into the run directory as the workers' command reads it.
This is where the launcher imports most of its `pretrain` modules (docs/design.md names them)."""

from __future__ import annotations

import dataclasses
import os
import sys
from pathlib import Path

from launcher import address_space
from launcher.errors import UsageError
from launcher.gpus.placement import Placement
from launcher.nodes.rendezvous import Node
from launcher.supervise.printer import Printer
from pretrain import config as cfg
from pretrain.plan import float8
from pretrain.run import faults


def prepare_training(
    config: cfg.Config,
    placement: Placement,
    printer: Printer,
    node: Node | None = None,
    first_attempt: bool = True,
    run_dir: Path | None = None,
) -> cfg.Config:
    """Prepare the dataset once (per node), check one global batch fits the data and the model
    fits the GPUs, and choose DDP, FSDP or HSDP and what is recomputed (pretrain/plan/parallelism.py), before
    anything is spawned or written; return the config as the workers will run it (training.parallelism
    "ddp", "fsdp" or "hsdp", activation_checkpointing never "auto", loss_chunk_tokens never null).
    In a job of several nodes, the whole job's worker count and smallest GPU decide, and a node's
    workers (node.nproc) are HSDP's shard group. The first
    attempt (first_attempt) also checks the ranks PRETRAIN_FAULTS names against the world size.
    run_dir: the run's directory, whose own local checkpoints in /dev/shm (a restart's) count as
    available host memory."""
    with address_space.loading_numpy():  # its first import: a limit on address space is one line
        from pretrain.data.fitting import fit_to_dataset
    world_size = node.world_size if node is not None else placement.world_size
    if problem := address_space.too_small_for_workers(world_size):  # `ulimit -v`: one line, not their tracebacks
        raise UsageError(problem)
    if first_attempt:  # the largest world size of the run: a rank beyond it never fires
        faults.check_ranks(faults.parse(os.environ.get(faults.FAULTS_VAR, "")), world_size)
    if config.training.grad_accum_nums == "auto":  # a global batch the ranks cannot share: refused before the data
        cfg.per_rank_batch(config, world_size)
    from pretrain.data.cache import sigterm_as_exit
    from pretrain.data.hub import choose_hub_files, follow_checkpoint
    from pretrain.data.prepare import prepare
    from pretrain.plan.host_memory import host_memory_bytes
    from pretrain.plan.parallelism import plan_parallelism, planned_gpu_memory, with_gpu_memory
    from pretrain.checkpoint.tiers import base_of
    from pretrain.plan.checkpoint_memory import held_in_memory
    from pretrain.plan.host_memory import plan_checkpoints

    from pretrain.evaluation import hellaswag
    from pretrain.observe import wandb_log
    from pretrain.plan.compile_prerequisites import (
        compile_off_line,
        compile_requested,
        dropless_cuda_graph_problem,
        missing_compile_prerequisite,
    )
    from pretrain.hf.init_checkpoint import check_fits, for_workers
    from pretrain.hf.init_tokenizer import check_tokenizer

    if config.logging.wandb and not wandb_log.is_installed():
        raise UsageError(wandb_log.MISSING)
    # Before the data: weights that cannot be found, or do not fit the model, stop the launch at once.
    config, init = for_workers(config, printer.launcher_line)
    if config.evaluation.data:  # a damaged benchmark file is found now, not after the first interval
        data = hellaswag.checked_data(config.evaluation.data, config.evaluation.max_examples)
        config = dataclasses.replace(config, evaluation=dataclasses.replace(config.evaluation, data=data))
    config = dataclasses.replace(config, system=dataclasses.replace(config.system, device=placement.device))
    # training.float8: torchao missing or too new for this torch, float8 matmuls on a CPU or on a
    # GPU below compute capability 8.9: one line here, not one per worker (which check again)
    float8.check_launch(config, placement.device, [(gpu.name, gpu.compute_capability) for gpu in placement.gpus])
    # Dropless experts' grouped matmul syncs with the host on some GPUs: no CUDA graph can capture it.
    gpus = [(gpu.name, gpu.vendor, gpu.compute_capability) for gpu in placement.gpus]
    if problem := dropless_cuda_graph_problem(config, placement.device, gpus):
        raise UsageError(problem)
    if compile_requested(config, placement.device) and (missing := missing_compile_prerequisite(placement.device)):
        # Said once here, not once per worker, and the workers get compile off in their config.
        printer.launcher_line(f"warning: {compile_off_line(missing)}")
        config = dataclasses.replace(config, training=dataclasses.replace(config.training, compile=False))
    if line := float8.uncompiled_line(config, compile_requested(config, placement.device)):
        printer.launcher_line(f"warning: {line}")
    # Every rank must agree on the mode, and the smallest GPU decides whether it fits.
    gpu_memory = min(gpu.memory_total for gpu in placement.gpus) if placement.device == "cuda" else None
    if node is not None:
        gpu_memory = node.smallest_gpu_memory
    gpu_memory = planned_gpu_memory(config, gpu_memory)
    if gpu_memory is not None:  # the workers plan on this very figure (pretrain/build.py)
        config = with_gpu_memory(config, gpu_memory)
    # Counted per host: this node's workers (its staged shards, its local tier, its processes).
    local_ranks = node.nproc if node is not None else placement.world_size
    host_memory = host_memory_bytes()
    if run_dir is not None:  # a restart: the run's own local checkpoints are the tier's, not another's use
        host_memory += held_in_memory(base_of(config, run_dir))
    if config.model.vocab_size is not None:
        # The model's size is known before the data: a run that fits neither the GPUs nor this
        # machine's memory is refused now, not after a long download or tokenization.
        plan_parallelism(config, world_size, gpu_memory, host_memory, local_ranks)
    # A Hub dataset's file count is fixed here, for this world size, and written into the config
    # the workers get: every rank then prepares (finds) exactly these files.
    config = choose_hub_files(follow_checkpoint(config), world_size, printer.launcher_line)
    with sigterm_as_exit():
        dataset_dir = prepare(config.data, log=printer.launcher_line)
    config, length = fit_to_dataset(config, dataset_dir, world_size)
    if init is not None:  # again, with the vocabulary the tokenizer has set, and its tokens
        check_tokenizer(init, config, dataset_dir, printer.launcher_line)
        check_fits(init, config)
    config, line = plan_parallelism(config, world_size, gpu_memory, host_memory, local_ranks)
    on_gpus = gpu_memory is not None
    config, checkpoints_line = plan_checkpoints(config, world_size, host_memory, local_ranks, on_gpus)
    # The run's length counts the global batch, which grad_accum_nums "auto" keeps; its split is the plan's.
    split = {"batch_size": config.training.batch_size, "grad_accum": cfg.grad_accum_nums(config)}
    printer.launcher_line(f"run length: {dataclasses.replace(length, **split).describe()}")
    printer.launcher_line(line)
    printer.launcher_line(checkpoints_line)  # asynchronous or not (training.async_checkpoint)
    return config


def training_command(config: cfg.Config, run_dir: Path, printer: Printer) -> list[str]:
    """Write the resolved config into the run directory; return the worker command."""
    config_path = run_dir / "config.json"
    cfg.save(config, config_path)
    printer.launcher_line(f"run directory: {run_dir}")
    return [sys.executable, "-m", "pretrain", "--config", str(config_path), "--run-dir", str(run_dir)]
