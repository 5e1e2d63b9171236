"""The training loop, top-down: setup -> build -> fit.

One process trains on one device. Under the launcher (or torchrun) the processes form a
DDP group; alone, the same code trains a single process."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import math
import os
import signal
import sys
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist

from pretrain import checkpoint, debug, export, memory, parallel
from pretrain import config as cfg
from pretrain.config import Config, TrainingConfig
from pretrain.data import DataError
from pretrain.data.loader import TrainBatches, validation_batches
from pretrain.data.fitting import fit_to_dataset
from pretrain.data.hub import choose_hub_files, follow_checkpoint
from pretrain.data.prepare import prepare
from pretrain.data.tokenizer import TOKENIZER_FILE
from pretrain.debug import FirstNonFinite, NonFinite, NumericalFailure
from pretrain.exit_codes import BAD_INPUT, ERROR, NUMERICAL_FAILURE
from pretrain.metrics import MetricsLog, flops_per_token, mfu, peak_bf16_flops, peak_memory_gib, reset_peak_memory
from pretrain.model import Transformer
from pretrain.model_state import whole_model_on_cpu
from pretrain.resume import ResumeError, resolve_resume
from pretrain.runfiles import PROJECT_ROOT, create_run_dir, new_run_id, os_error_message
from pretrain.runtime import Runtime, RuntimeSetupError, init_runtime, mean_across_ranks, setup_logging, shutdown
from pretrain.stopping import Stopped, StopRequest


def lr_at(step: int, training: TrainingConfig) -> float:
    """Linear warmup to the peak, then cosine decay to min_lr_ratio * peak at the last step."""
    peak = training.learning_rate
    if step < training.warmup_steps:
        return peak * (step + 1) / training.warmup_steps
    decay_steps = max(1, training.max_steps - 1 - training.warmup_steps)
    progress = min(1.0, (step - training.warmup_steps) / decay_steps)
    cosine = 0.5 * (1.0 + math.cos(math.pi * progress))
    return peak * (training.min_lr_ratio + (1.0 - training.min_lr_ratio) * cosine)


def format_eta(seconds: float) -> str:
    """5:30 under an hour, 2:05:30 above."""
    minutes, secs = divmod(int(max(0.0, seconds)), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes}:{secs:02d}"


@dataclass
class Trainer:
    config: Config
    runtime: Runtime
    model: torch.nn.Module
    """The model as trained: wrapped in DDP or sharded by FSDP when there is more than one rank."""
    mode: str
    """How the ranks share the model: "single", "ddp" or "fsdp"."""
    optimizer: torch.optim.Optimizer
    loader: TrainBatches
    batches: Iterator[tuple[torch.Tensor, torch.Tensor]]
    """Iterates loader; loader.state_dict() names the next batch it yields."""
    val_batches: list[tuple[torch.Tensor, torch.Tensor]]
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

    @property
    def tokens_per_step(self) -> int:
        t = self.config.training
        return t.batch_size * self.config.data.context_length * t.grad_accum_nums * self.runtime.world_size


# --- build ----------------------------------------------------------------------------

def build_optimizer(model: torch.nn.Module, training: TrainingConfig, device: torch.device) -> torch.optim.Optimizer:
    """AdamW with weight decay on matrices only (norm weights are not decayed). The fused
    kernel runs where the parameters are on the GPU; under CPU offload they are in host memory,
    where torch's plain per-tensor loop updates them (its foreach kernels are CUDA-only)."""
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [{"params": [p for p in params if p.ndim >= 2], "weight_decay": training.weight_decay},
              {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}]
    on_gpu = device.type == "cuda" and all(p.device.type == "cuda" for p in params)
    return torch.optim.AdamW(groups, lr=training.learning_rate, betas=(training.beta1, training.beta2),
                             fused=on_gpu)


def gpu_memory(device: torch.device) -> int | None:
    return torch.cuda.get_device_properties(device).total_memory if device.type == "cuda" else None


def parallel_mode(config: Config, runtime: Runtime) -> tuple[Config, str]:
    """The config with training.parallelism and training.cpu_offload concrete, and the mode:
    fsdp with CPU offload (even for one process), else single for one process, else the
    configured mode ("auto" chooses by estimated memory). A run that cannot fit the GPU fails
    here, before the model is built. The launcher has already decided offload (true or false);
    run without it (null), this process decides as the launcher would, from the host memory
    available now, shared by LOCAL_WORLD_SIZE ranks."""
    gpu = gpu_memory(runtime.device)
    t = config.training
    if t.cpu_offload is None and gpu is not None:
        local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE") or runtime.world_size)
        gpu, host = smallest_across_ranks(runtime, gpu, memory.host_memory_bytes())
        config, _ = memory.plan_parallelism(config, runtime.world_size, gpu, host, local_ranks)
    else:
        offload = bool(t.cpu_offload)
        mode = "fsdp" if offload else memory.choose_parallelism(config, runtime.world_size, gpu)
        if gpu is not None:
            memory.check_fits(config, runtime.world_size, gpu, mode, offload=offload)
        config = dataclasses.replace(config, training=dataclasses.replace(t, parallelism=mode, cpu_offload=offload))
    if config.training.cpu_offload:
        return config, "fsdp"
    return config, config.training.parallelism if runtime.distributed else "single"


def smallest_across_ranks(runtime: Runtime, *values: int) -> tuple[int, ...]:
    """Each value's minimum over the ranks, so that every rank makes the same choice: ranks read
    the host's free memory at different moments, and GPUs may differ in size. (A CPU tensor: on
    GPUs the group has gloo beside NCCL whenever offload may be chosen, pretrain/runtime.py.)"""
    if not runtime.distributed:
        return values
    smallest = torch.tensor(values, dtype=torch.int64)
    dist.all_reduce(smallest, op=dist.ReduceOp.MIN)
    return tuple(int(v) for v in smallest.tolist())


def build(config: Config, runtime: Runtime, dataset_dir: Path, run_dir: Path, log: logging.Logger) -> Trainer:
    config, mode = parallel_mode(config, runtime)
    t = config.training
    torch.manual_seed(t.seed)
    # Built on the meta device (shapes, no storage): parallelize shards it and only then
    # allocates and initialises each rank's part from t.seed (the same weights whatever the
    # number of ranks), so no rank ever holds the whole model: an 8B model takes 32 GB in fp32.
    with torch.device("meta"):
        model = Transformer(config.model, max_seq_len=cfg.max_seq_len(config))
    log.info(f"Model: {model.num_params() / 1e6:.2f}M parameters, {config.model.n_layers} layers, "
             f"dim {config.model.dim}; device {runtime.device}; world size {runtime.world_size}"
             + (f"; {mode.upper()}" if mode != "single" else "")
             + ("; CPU offload (weights, gradients and optimizer state in host memory)" if t.cpu_offload else ""))
    model = parallel.parallelize(model, config, runtime, mode)
    optimizer = build_optimizer(model, t, runtime.device)  # after sharding: it holds the shards
    loader = TrainBatches(dataset_dir, config.data.context_length, t.batch_size, runtime.rank,
                          runtime.world_size, t.seed, t.num_workers, pin_memory=runtime.device.type == "cuda",
                          grad_accum=t.grad_accum_nums)
    try:
        val = validation_batches(dataset_dir, config.data.context_length, t.batch_size, runtime.rank,
                                 runtime.world_size, t.eval_batches)
    except DataError as error:
        # Every rank sees the same split, so every rank skips alike and collectives stay matched.
        log.warning(f"Validation skipped: {error}")
        val = []
    log.debug(f"Data: {dataset_dir}; {loader.batches_per_epoch} batches per epoch per rank; "
              f"{len(val)} validation batches per rank; {t.batch_size} x {config.data.context_length} "
              f"tokens per micro-batch, {t.grad_accum_nums} micro-batches per step")
    metrics = MetricsLog(run_dir, enabled=runtime.is_main, tensorboard=config.logging.tensorboard, logger=log)
    trainer = Trainer(config, runtime, model, mode, optimizer, loader, iter(loader), val, log, run_dir, metrics)
    if config.debug.trace_nonfinite:
        trainer.tracer = FirstNonFinite(parallel.unwrap(model))
        log.debug("debug.trace_nonfinite: hooks on every module watch for the first NaN or Inf")
        if t.activation_checkpointing or t.compile:
            log.warning("debug.trace_nonfinite turns off training.activation_checkpointing and training.compile "
                        "(the hooks must see every module); set debug.trace_nonfinite=false to keep them")
    return trainer


# --- fit ------------------------------------------------------------------------------

def autocast(trainer: Trainer):
    return torch.autocast(trainer.runtime.device.type, dtype=torch.bfloat16,
                          enabled=trainer.config.training.use_amp)


def train_step(trainer: Trainer, step: int) -> tuple[torch.Tensor, torch.Tensor, float]:
    """One optimizer step over grad_accum_nums micro-batches: (local loss, grad norm, lr).
    A step whose loss or gradient norm is not finite on any rank updates nothing: it is
    skipped or stops the run (debug.on_nonfinite; see pretrain/debug.py)."""
    t, device = trainer.config.training, trainer.runtime.device
    lr = lr_at(step, t)
    for group in trainer.optimizer.param_groups:
        group["lr"] = lr
    position = trainer.loader.state_dict()  # where this step's batches start
    if trainer.tracer is not None:
        trainer.tracer.reset()
    loss_sum = torch.zeros((), device=device)
    for micro in range(t.grad_accum_nums):
        x, y = (tensor.to(device, non_blocking=True) for tensor in next(trainer.batches))
        # Under DDP only the last micro-batch all-reduces gradients; FSDP reduce-scatters on every
        # micro-batch, so no rank holds a whole model's gradients (see parallel.gradient_sync).
        with parallel.gradient_sync(trainer.model, enabled=micro == t.grad_accum_nums - 1):
            with autocast(trainer):
                loss = trainer.model(x, y, t.loss_chunk_tokens) / t.grad_accum_nums
            loss.backward()
        loss_sum += loss.detach()
    grad_norm = parallel.grad_norm(trainer.model)
    if trainer.config.debug.check_finite:
        seen = trainer.tracer is not None and trainer.tracer.first is not None
        # The step's one host synchronization: it also settles whether the ranks stop after it.
        agreement = debug.agree_on_step(step, loss_sum, grad_norm, trainer.runtime, seen, trainer.stop.signum)
        trainer.stop.settle(agreement.stop_signum)
        if agreement.nonfinite is not None:
            skip_or_stop(trainer, agreement.nonfinite, position)
            return loss_sum, grad_norm, lr
    trainer.skips_in_a_row = 0
    parallel.clip_gradients(trainer.model, t.max_grad_norm, grad_norm)
    trainer.optimizer.step()
    trainer.optimizer.zero_grad(set_to_none=True)
    return loss_sum, grad_norm, lr


def skip_or_stop(trainer: Trainer, event: NonFinite, position: dict[str, int]) -> None:
    """Drop the step's update (on_nonfinite=skip, within max_skips_in_a_row), else stop."""
    d = trainer.config.debug
    if d.on_nonfinite == "skip" and trainer.skips_in_a_row < d.max_skips_in_a_row:
        trainer.skips_in_a_row += 1
        trainer.skipped_steps += 1
        trainer.optimizer.zero_grad(set_to_none=True)
        first = trainer.tracer.first if trainer.tracer is not None else None
        trainer.log.warning(
            f"Step {event.step}: loss {event.loss:.4f}, gradient norm {event.grad_norm:.4f}: update skipped "
            f"({trainer.skips_in_a_row} in a row, {trainer.skipped_steps} in all; debug.max_skips_in_a_row "
            f"is {d.max_skips_in_a_row})" + (f"; first non-finite: {first}" if first else ""))
        return
    stop_for_nonfinite(trainer, event, position)


def stop_for_nonfinite(trainer: Trainer, event: NonFinite, position: dict[str, int]) -> None:
    """Every rank, in this order (the most useful evidence first): say so at once; report the
    tensors (the affected ranks); save checkpoint nan_grad_step_<N> with the state before the
    step; write the tensor dump (the reporting rank); raise NumericalFailure."""
    runtime, log, d = trainer.runtime, trainer.log, trainer.config.debug
    what = "gradient norm" if event.what == "GRADIENT" else "loss"
    log.error(f"Step {event.step}: {event.kind} {what} (loss here {event.loss:.4f}, gradient norm "
              f"{event.grad_norm:.4f}); no update made; writing the report, a checkpoint"
              + (" and a tensor dump" if d.dump_tensors else ""))
    findings = debug.inspect_all(trainer.model)
    reports = event.affected_here or runtime.rank == event.reporter
    if reports:
        first = trainer.tracer.first if trainer.tracer is not None else None
        log.error(debug.report(event, runtime.label, findings, first, tracing=trainer.tracer is not None))
    else:
        log.error(f"Step {event.step}: this rank's loss is finite; rank {event.reporter} reports the tensors")
    trainer.loader.load_state_dict(position)  # so that resuming the checkpoint replays this step
    path = checkpoint.save(trainer, event.step, trainer.run_dir, name=f"nan_grad_step_{event.step}")
    log.info(f"Checkpoint with the state before step {event.step}: {path} (resuming it replays the step)")
    dump_path = trainer.run_dir / "debug" / f"nan_debug_step_{event.step}.npz"
    dumped = d.dump_tensors and debug.write_dump(trainer.model, dump_path, runtime, event.reporter, log)
    if dumped:
        log.info(f"Tensor dump: {dump_path} (numpy.load(path, allow_pickle=False); README: NaN and Inf)")
    raise NumericalFailure(
        f"step {event.step}: {event.kind} {what}; stopped ("
        + ("the report above names the tensors" if reports else f"rank {event.reporter}'s report names the tensors")
        + f"; checkpoint {path}" + (f"; dump {dump_path}" if dumped else "")
        + "); README Troubleshooting and configs/config_stable.json say what to change")


@torch.no_grad()
def evaluate(trainer: Trainer) -> float | None:
    """Mean validation loss over the fixed validation windows of every rank (None: no windows)."""
    if not trainer.val_batches:
        return None
    trainer.model.eval()
    total = torch.zeros((), device=trainer.runtime.device)
    for x, y in trainer.val_batches:
        with autocast(trainer):
            total += trainer.model(x.to(trainer.runtime.device), y.to(trainer.runtime.device),
                                   trainer.config.training.loss_chunk_tokens)
    trainer.model.train()
    return mean_across_ranks(total / len(trainer.val_batches), trainer.runtime)


@dataclass
class Throughput:
    """Tokens/s, MFU and peak memory over the steps since the last step line."""
    tokens_per_step: int
    world_size: int
    flops_per_token: float
    peak_flops: float | None
    """The device's bf16 peak (None: unknown device or CPU, so no MFU)."""
    device: torch.device
    window_start: float = field(default_factory=time.perf_counter)
    window_steps: int = 0

    def step_done(self) -> None:
        self.window_steps += 1

    @contextmanager
    def paused(self, clock: Callable[[], float] = time.perf_counter) -> Iterator[None]:
        """Leave the block's time out of the window: evaluation and checkpoint saves are not
        training, and would make tokens/s and MFU look worse than training runs."""
        began = clock()
        try:
            yield
        finally:
            self.window_start += clock() - began

    def measure(self, now: float) -> tuple[float, float | None, float | None]:
        """(tokens/s over all ranks, MFU, peak memory GiB) of the window; starts the next one."""
        tokens_per_s = self.tokens_per_step * self.window_steps / max(now - self.window_start, 1e-9)
        utilization = mfu(tokens_per_s / self.world_size, self.flops_per_token, self.peak_flops)
        memory_gib = peak_memory_gib(self.device)
        reset_peak_memory(self.device)
        self.window_start, self.window_steps = now, 0
        return tokens_per_s, utilization, memory_gib


def throughput(trainer: Trainer) -> Throughput:
    device = trainer.runtime.device
    peak = peak_bf16_flops(torch.cuda.get_device_name(device)) if device.type == "cuda" else None
    if not trainer.config.training.use_amp:
        peak = None  # the table holds bf16 peaks; an fp32 run measured against them would mislead
    reset_peak_memory(device)  # the first window's peak is training's, not the build's (init draws whole tensors)
    return Throughput(trainer.tokens_per_step, trainer.runtime.world_size,
                      flops_per_token(trainer.config.model, trainer.config.data.context_length), peak, device)


def step_line(trainer: Trainer, step: int, loss: float, lr: float, grad_norm: float, eta_s: float,
              tokens_per_s: float, utilization: float | None, memory_gib: float | None) -> str:
    line = (f"Step [{step}/{trainer.config.training.max_steps}] | Loss: {loss:.4f} | LR: {lr:.2e} | "
            f"Grad Norm: {grad_norm:.4f} | ETA: {format_eta(eta_s)} | Tokens/s: {tokens_per_s:,.0f}")
    if utilization is not None:
        line += f" | MFU: {100 * utilization:.1f}%"
    if memory_gib is not None:
        line += f" | Mem: {memory_gib:.1f} GiB"
    return line


def fit(trainer: Trainer) -> None:
    """Train from start_step to max_steps, or until trainer.stop is agreed: then save and raise
    Stopped. Saves a checkpoint every checkpoint_interval steps and after the last one."""
    t, log = trainer.config.training, trainer.log
    interval = trainer.config.logging.log_interval
    start = time.perf_counter()
    speed = throughput(trainer)
    first_step_done = None
    for step in range(trainer.start_step, t.max_steps):
        loss, grad_norm, lr = train_step(trainer, step)
        speed.step_done()
        steps_run = step - trainer.start_step
        last = step == t.max_steps - 1
        if steps_run == 0 or last or step % interval == 0:
            mean_loss = mean_across_ranks(loss, trainer.runtime)  # the global mean, the same on every rank
            trainer.losses.append(mean_loss)
            now = time.perf_counter()
            first_step_done = first_step_done or now
            # The first step includes warm-up costs; the ETA uses the steps after it.
            per_step = (now - first_step_done) / steps_run if steps_run > 0 else now - start
            tokens_per_s, utilization, memory_gib = speed.measure(now)
            log.info(step_line(trainer, step, mean_loss, lr, float(grad_norm), per_step * (t.max_steps - 1 - step),
                               tokens_per_s, utilization, memory_gib))
            trainer.metrics.log_train(step, mean_loss, lr, float(grad_norm), tokens_per_s, utilization,
                                      memory_gib, now - start)
        if t.eval_interval and step % t.eval_interval == 0 and step > 0 and not last:
            with speed.paused():
                log_validation(trainer, step)
        if (signum := trainer.stop.agreed(trainer.runtime)) is not None:  # settled by train_step's check, if on
            path = checkpoint.save(trainer, step + 1, trainer.run_dir)
            log.info(f"Stopped by {signal.Signals(signum).name} after step {step}; checkpoint saved to {path}")
            raise Stopped(signum)
        if t.checkpoint_interval and (step + 1) % t.checkpoint_interval == 0 and not last:
            with speed.paused():
                path = checkpoint.save(trainer, step + 1, trainer.run_dir)
            log.info(f"Checkpoint saved to {path}")
    val_loss = log_validation(trainer, t.max_steps - 1)
    path = checkpoint.save(trainer, t.max_steps, trainer.run_dir)
    exported = export_final(trainer)
    log.info(f"Training complete: {t.max_steps - trainer.start_step} steps in {time.perf_counter() - start:.1f}s, "
             + (f"final loss {trainer.losses[-1]:.4f}" if trainer.losses else "nothing left to train")
             + (f", validation loss {val_loss:.4f}" if val_loss is not None else "")
             + (f", {trainer.skipped_steps} update(s) skipped for NaN/Inf" if trainer.skipped_steps else "")
             + f"; checkpoint {path}" + (f"; weights exported to {exported}" if exported else ""))


def export_final(trainer: Trainer) -> Path | None:
    """Rank 0 writes <run dir>/export/: model.safetensors, config.json and the dataset's
    tokenizer.json. Under FSDP every rank takes part in gathering the shards."""
    state = whole_model_on_cpu(trainer.model, wanted_here=trainer.runtime.is_main)
    if state is None:
        return None
    return export.export(state, trainer.config, trainer.run_dir / "export", tokenizer_file=trainer.tokenizer_file)


def log_validation(trainer: Trainer, step: int) -> float | None:
    val_loss = evaluate(trainer)
    if val_loss is not None:
        trainer.log.info(f"Validation | Step [{step}/{trainer.config.training.max_steps}] | Loss: {val_loss:.4f}")
        trainer.metrics.log_val(step, val_loss)
    return val_loss


# --- entry point ----------------------------------------------------------------------

def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="pretrain_main.py",
        description="Run one training process (no supervisor). Under the launcher, or torchrun, "
                    "RANK/WORLD_SIZE/MASTER_* make the processes one DDP group.")
    cfg.add_arguments(parser)
    parser.add_argument("--run-dir", metavar="DIR", help="run directory (default: runs/<run-id>/)")
    return parser.parse_args(argv)


def shared_run_dir(run_dir: Path | None, runtime: Runtime) -> Path:
    """The run directory every rank writes to: the given one, else a new runs/<run-id>/ that
    rank 0 names for all (started without the launcher, say by torchrun, each rank would
    otherwise invent its own)."""
    if run_dir is not None:
        return run_dir
    chosen = [str(PROJECT_ROOT / "runs" / new_run_id())]
    if runtime.distributed:
        dist.broadcast_object_list(chosen, src=0)  # a str from rank 0 of this very job
    return Path(chosen[0])


def train(config: Config, runtime: Runtime, run_dir_arg: str | None, log: logging.Logger) -> None:
    """Set up the run directory and data, build, fit. Everything it built, the DDP wrapper
    included, is released when it returns: a process group destroyed while DDP still holds
    it is torn down at interpreter exit instead, where gloo's threads abort the process."""
    resume_run_dir, resume_from = resolve_resume(config.training.resume, run_dir_arg, PROJECT_ROOT / "runs")
    run_dir = create_run_dir(shared_run_dir(resume_run_dir, runtime))
    # Under the launcher the dataset is already prepared and this is a cache hit, and the
    # config already fits it (the same values again).
    if resume_from is not None:  # the Hub files the checkpoint was trained on
        config = follow_checkpoint(dataclasses.replace(config, training=dataclasses.replace(
            config.training, resume=str(resume_from))))
    config = choose_hub_files(config, runtime.world_size, log.info)
    dataset_dir = prepare(config.data, log=log.debug if runtime.distributed else log.info)
    config, length = fit_to_dataset(config, dataset_dir, runtime.world_size)
    log.debug(f"Run length: {length.describe()}")
    if runtime.is_main and not (run_dir / "config.json").exists():
        cfg.save(config, run_dir / "config.json")
    torch.autograd.set_detect_anomaly(config.debug.detect_anomaly)
    trainer = build(config, runtime, dataset_dir, run_dir, log)
    if (dataset_dir / TOKENIZER_FILE).exists():
        trainer.tokenizer_file = dataset_dir / TOKENIZER_FILE
    log.debug(f"Run directory: {run_dir}")
    if resume_from is not None:
        trainer.start_step = checkpoint.restore(trainer, resume_from)
        trainer.batches = iter(trainer.loader)  # from the restored position
        log.info(f"Resumed from {resume_from} at step {trainer.start_step}")
    elif config.training.resume == "auto":
        log.info("No checkpoint to resume from; starting at step 0")
    with trainer.stop.installed(), trainer.metrics:  # SIGTERM or SIGINT: finish the step, save, stop
        fit(trainer)


def unexpected_error() -> int:
    """Print the exception being handled with its traceback, now, and return ERROR. Printed
    before shutdown: leaving a process group after a failure can block on peers that never come
    (NCCL), and a traceback left to the interpreter's exit would then never appear, so an
    out-of-memory error on one rank would look like a hang of them all."""
    traceback.print_exc()
    sys.stderr.flush()
    return ERROR


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        config = cfg.from_args(args)
        runtime = init_runtime(config)
    except (cfg.ConfigError, RuntimeSetupError) as error:
        print(f"pretrain: error: {error}", file=sys.stderr)
        return 2
    log = setup_logging(runtime.label, config.logging.level)
    peers_alive = False  # whether every rank reaches shutdown() together
    try:
        train(config, runtime, args.run_dir, log)
        peers_alive = True
    except Stopped as stop:
        peers_alive = True
        return 128 + stop.signum
    except NumericalFailure as error:
        peers_alive = True  # every rank agreed on the step and stops there
        log.error(str(error))
        return NUMERICAL_FAILURE
    except RuntimeError as error:
        if not (runtime.distributed and "timed out" in str(error).lower()):
            return unexpected_error()
        # gloo's message says only which operation timed out; say what it means.
        log.error(f"a collective waited longer than system.collective_timeout "
                  f"({config.system.collective_timeout:g} s) for the other ranks: one of them is frozen or "
                  f"gone (its log says which); {str(error).splitlines()[0]}")
        return ERROR
    except (DataError, cfg.ConfigError, ResumeError, checkpoint.CheckpointError) as error:
        log.error(str(error))
        return BAD_INPUT
    except OSError as error:  # an unwritable run or cache directory, a full disk
        log.error(os_error_message(error))
        return BAD_INPUT
    except Exception:
        return unexpected_error()
    finally:
        shutdown(runtime, peers_alive)
    return 0
