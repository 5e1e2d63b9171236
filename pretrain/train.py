"""The training loop, top-down: setup -> build -> fit.

One process trains on one device. Under the launcher (or torchrun) the processes form a
DDP group; alone, the same code trains a single process. The build phase (the Trainer, and
how the ranks share the model) is pretrain/build.py; one optimizer step (train_step, which fit
calls through this module's namespace) is pretrain/step.py; the step line's measurements are
pretrain/observe/step_line.py; checkpoints are written through trainer.checkpoints
(pretrain/checkpoint/async_save.py)."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import math
import signal
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
import torch.distributed as dist

from pretrain.checkpoint import save_restore as checkpoint, tiers
from pretrain.hf import export
from pretrain.distributed import float8, peer_loss
from pretrain.evaluation import task_eval
from pretrain import config as cfg
from pretrain.build import Trainer, build
from pretrain.config import Config
from pretrain.data.fitting import fit_to_dataset
from pretrain.data.hub import choose_hub_files, follow_checkpoint
from pretrain.data.prepare import prepare, sigterm_as_exit, stop_signal
from pretrain.data.tokenizer import TOKENIZER_FILE
from pretrain.numerics.debug import NumericalFailure
from pretrain.run.exit_codes import BAD_INPUT, ERROR, NUMERICAL_FAILURE, PEER_LOST, by_signal
from pretrain.hf.init_checkpoint import HfCheckpoint, check_fits, find_checkpoint, for_workers
from pretrain.model.loss import next_token_loss
from pretrain.run import faults
from pretrain.run.refusal import Refusal
from pretrain.checkpoint.resume import resolve_resume
from pretrain.run.files import create_run_dir, new_run_id, os_error_message, runs_root
from pretrain.distributed.runtime import Runtime, init_runtime, mean_across_ranks, setup_logging, shutdown
from pretrain.hf.init_from import load_weights
from pretrain.hf.init_tokenizer import check_tokenizer
from pretrain.observe import goodput, progress
from pretrain.observe.step_line import step_line, throughput
from pretrain.run.stopping import Stopped
from pretrain.step import aux_means, autocast, train_step
from pretrain.train_args import parse_args


# --- fit ------------------------------------------------------------------------------


@torch.no_grad()
def evaluate(trainer: Trainer) -> float | None:
    """Mean validation loss over the validation windows of all ranks, each window weighing the same
    (pretrain/data/loader.py validation_batches: the same windows whatever the number of ranks);
    None: no windows."""
    if not trainer.val_batches:
        return None
    trainer.model.eval()
    totals = torch.zeros(2, device=trainer.runtime.device)  # the windows' summed loss, and their count
    for x, y, windows in trainer.val_batches:
        with autocast(trainer):
            loss = next_token_loss(
                trainer.model,
                x.to(trainer.runtime.device),
                y.to(trainer.runtime.device),
                cfg.loss_chunk_tokens(trainer.config),
            ).cross_entropy
        if windows:  # a stand-in batch only keeps the ranks' forward passes matched
            totals[0] += loss * windows
            totals[1] += windows
    trainer.model.train()
    if trainer.runtime.distributed:
        dist.all_reduce(totals, op=dist.ReduceOp.SUM)
    return float(totals[0] / totals[1])


def fit(trainer: Trainer) -> None:
    """Train from start_step to max_steps, or until trainer.stop is agreed: then save and raise
    Stopped. Saves a checkpoint every checkpoint_interval steps and after the last one."""
    t, log = trainer.config.training, trainer.log
    clock = goodput.clock_for(trainer)  # this attempt's part of <run dir>/goodput.json (rank 0), from now
    if trainer.start_step == 0 < t.max_steps:  # a fresh run: where the curves start (untrained, or init_from's weights)
        with clock.evaluating():
            log_evaluations(trainer, 0)
    interval = trainer.config.logging.log_interval
    start = time.perf_counter()
    speed = throughput(trainer)
    first_step_done = None
    steps_per_epoch = max(1, trainer.loader.batches_per_epoch // cfg.grad_accum_nums(trainer.config))
    report_progress = progress.reporter()  # None unless the launcher asks for it
    for step in range(trainer.start_step, t.max_steps):
        trainer.checkpoints.poll()  # a background write that failed stops the run here (no collective)
        loss, grad_norm, lr = train_step(trainer, step)
        if report_progress is not None:  # the step reached, which step lines show only every log_interval
            report_progress(step)
        speed.step_done()
        steps_run = step - trainer.start_step
        last = step == t.max_steps - 1
        if steps_run == 0 or last or step % interval == 0:
            mean_loss = mean_across_ranks(loss, trainer.runtime)  # the global mean, the same on every rank
            clock.step_time(step + 1)  # the read waited for the step's device work: step time (its logging is not)
            aux, counts = aux_means(trainer)
            trainer.losses.append(mean_loss)
            now = time.perf_counter()
            first_step_done = first_step_done or now
            # The first step includes warm-up costs; the ETA uses the steps after it.
            per_step = (now - first_step_done) / steps_run if steps_run > 0 else now - start
            tokens_per_s, utilization, memory_gib = speed.measure(now)
            log.info(
                step_line(
                    trainer,
                    step,
                    mean_loss,
                    lr,
                    float(grad_norm),
                    per_step * (t.max_steps - 1 - step),
                    tokens_per_s,
                    utilization,
                    memory_gib,
                    sum(aux.values()) if aux else None,
                    (step + 1) / steps_per_epoch if t.by_epoch else None,
                    dropped=sum(counts.values()) if counts else None,
                )
            )
            trainer.metrics.log_train(
                step, mean_loss, lr, float(grad_norm), tokens_per_s, utilization, memory_gib, now - start, aux | counts
            )
            trainer.metrics.log_goodput(step, clock.record(step + 1))
            if trainer.stragglers is not None:  # after the step line's sync: a window's exchange, when one is full
                trainer.stragglers.at_logging_step(trainer.runtime, log.warning)
        if trainer.faults is not None:  # PRETRAIN_FAULTS: a kill or exit after this step, its line printed
            trainer.faults.after_step(step, log.warning)
        if not last:  # the last step's are the final ones, below
            with speed.paused(), clock.evaluating():
                log_evaluations(trainer, step + 1)
        if (signum := trainer.stop.agreed(trainer.runtime)) is not None:  # settled by train_step's check, if on
            if trainer.stop.signum:  # every rank stops at this step: the launcher names this one (summary.py SIGNAL_CAME)
                log.info(f"{signal.Signals(trainer.stop.signum).name} came to this rank: every rank stops after step {step}")
            path = trainer.checkpoints.save(step + 1, trainer.checkpoints.tiers["durable"], wait=True, quiet=True)
            log.info(f"Stopped by {signal.Signals(signum).name} after step {step}; checkpoint saved to {path}")  # its one line
            clock.record(step + 1, final=True)
            raise Stopped(signum)
        epoch_end = t.by_epoch and (step + 1) % steps_per_epoch == 0
        due = "durable" if epoch_end else tiers.due(step + 1, trainer.config)
        if due in trainer.checkpoints.tiers and not last:  # its line comes when it is complete
            epoch = f"Epoch {(step + 1) // steps_per_epoch} of {math.ceil(t.max_steps / steps_per_epoch)} done"
            with speed.paused():  # asynchronous: blocked only while the state is staged
                trainer.checkpoints.save(step + 1, trainer.checkpoints.tiers[due], note=epoch if epoch_end else "")
        clock.step_time(step + 1, done=True)  # the stop agreement's read waits for the device too
    with clock.evaluating():
        val_loss = log_validation(trainer, t.max_steps)
        task_eval.log_task(trainer, t.max_steps)
    path = trainer.checkpoints.save(t.max_steps, trainer.checkpoints.tiers["durable"], wait=True)
    trainer.checkpoints.close()  # the staged copy's memory back before the export
    exported = export_final(trainer, path)
    ledger = clock.record(t.max_steps, final=True)
    log.info(
        f"Training complete: {t.max_steps - trainer.start_step} steps in {time.perf_counter() - start:.1f}s, "
        + (f"final loss {trainer.losses[-1]:.4f}" if trainer.losses else "nothing left to train")
        + (f", validation loss {val_loss:.4f}" if val_loss is not None else "")
        + (f", {trainer.skipped_steps} update(s) skipped for NaN/Inf" if trainer.skipped_steps else "")
        + f"; checkpoint {path}"
        + (f"; weights exported to {exported}" if exported else "")
        + (f"; goodput {100 * ledger['goodput']:.1f}% so far (goodput.json)" if ledger else "")
    )
    if clock.standalone and (line := clock.summary()) is not None:  # the launcher prints its own, at its end
        log.info(line)


def export_final(trainer: Trainer, final_checkpoint: Path) -> Path | None:
    """Rank 0 writes <run dir>/export/ in Hugging Face form (pretrain/hf/export.py): the weights in
    bf16, config.json (exported_from: the final checkpoint), generation_config.json and the
    tokenizer's files. Under FSDP every rank takes part in gathering each weight in turn; no rank
    holds the whole model."""
    return export.export_model(
        trainer.model,
        trainer.config,
        trainer.run_dir / "export",
        trainer.tokenizer_file,
        writes=trainer.runtime.is_main,
        warn=trainer.log.warning,
        source={"checkpoint": str(final_checkpoint), "steps_done": trainer.config.training.max_steps},
    )


def log_evaluations(trainer: Trainer, steps_done: int) -> None:
    """The validation loss and the benchmark task, each where its interval falls due (step 0
    included), scored on the weights after steps_done steps: those checkpoint step_<steps_done>
    holds, so a curve's point N and that checkpoint evaluated afterwards give the same number."""
    eval_interval = trainer.config.training.eval_interval
    if eval_interval and steps_done % eval_interval == 0:
        log_validation(trainer, steps_done)
    if task_eval.is_due(trainer.config, steps_done):
        task_eval.log_task(trainer, steps_done)


def log_validation(trainer: Trainer, steps_done: int) -> float | None:
    """The validation loss of the weights after steps_done steps, logged at that step."""
    val_loss = evaluate(trainer)
    if val_loss is not None:
        trainer.log.info(f"Validation | Step [{steps_done}/{trainer.config.training.max_steps}] | Loss: {val_loss:.4f}")
        trainer.metrics.log_val(steps_done, val_loss)
    return val_loss


# --- entry point ----------------------------------------------------------------------


def shared_run_dir(run_dir: Path | None, runtime: Runtime) -> Path:
    """The run directory every rank writes to: the given one, else a new runs/<run-id>/ that
    rank 0 names for all (started without the launcher, say by torchrun, each rank would
    otherwise invent its own)."""
    if run_dir is not None:
        return run_dir
    chosen = [str(runs_root() / new_run_id())]
    if runtime.distributed:
        dist.broadcast_object_list(chosen, src=0)  # a str from rank 0 of this very job
    return Path(chosen[0])


def train(
    config: Config, runtime: Runtime, run_dir_arg: str | None, log: logging.Logger, injected: faults.Faults | None = None
) -> None:
    """Set up the run directory and data, build, fit. Everything it built, the DDP wrapper
    included, is released when it returns: a process group destroyed while DDP still holds
    it is torn down at interpreter exit instead, where gloo's threads abort the process.
    injected: the faults PRETRAIN_FAULTS scripts for this rank (pretrain/run/faults.py)."""
    say = log.warning if runtime.is_main else None  # a damaged local checkpoint passed over (pretrain/checkpoint/tiers.py)
    world_size = runtime.world_size
    resume_run_dir, resume_from = resolve_resume(config.training.resume, run_dir_arg, runs_root(), world_size, config, say)
    run_dir = create_run_dir(shared_run_dir(resume_run_dir, runtime))
    # Under the launcher the dataset is already prepared and this is a cache hit, and the
    # config already fits it (the same values again).
    if resume_from is not None:  # the Hub files the checkpoint was trained on
        config = follow_checkpoint(
            dataclasses.replace(config, training=dataclasses.replace(config.training, resume=str(resume_from)))
        )
    # Before the data: a checkpoint that cannot be found, or does not fit, stops the run at once.
    init = starting_weights(config, log.info) if resume_from is None else None
    config = choose_hub_files(config, runtime.world_size, log.info)
    with sigterm_as_exit():  # a stop signal ends a build at once, its temporary files removed (main: by_signal(signal))
        dataset_dir = prepare(config.data, log=log.debug if runtime.distributed else log.info)
    config, length = fit_to_dataset(config, dataset_dir, runtime.world_size)
    log.debug(f"Run length: {length.describe()}")
    if init is not None:  # again, with the vocabulary the tokenizer has set, and its tokens
        check_tokenizer(init, config, dataset_dir, log.debug)  # a warning: the launcher's line says it
        check_fits(init, config)
    torch.autograd.set_detect_anomaly(config.debug.detect_anomaly)
    trainer = build(config, runtime, dataset_dir, run_dir, log)
    if runtime.is_main and not (run_dir / "config.json").exists():  # as planned: grad_accum_nums "auto" a number
        cfg.save(trainer.config, run_dir / "config.json")
    trainer.faults = injected
    if (dataset_dir / TOKENIZER_FILE).exists():
        trainer.tokenizer_file = dataset_dir / TOKENIZER_FILE
    trainer.task = task_eval.load_task(config, trainer.tokenizer_file)
    log.debug(f"Run directory: {run_dir}")
    if resume_from is not None:
        trainer.start_step = checkpoint.restore(trainer, resume_from)
        trainer.batches = iter(trainer.loader)  # from the restored position
        init_from = config.training.init_from
        unused = f" (training.init_from {init_from} is not used: a resume wins)" if init_from else ""
        log.info(f"Resumed from {resume_from} at step {trainer.start_step}{unused}")
    elif init is not None:
        load_weights(trainer.model, init, log)
    elif config.training.resume == "auto":
        log.info("No checkpoint to resume from; starting at step 0")
    try:
        with trainer.stop.installed(), trainer.metrics:  # SIGTERM, SIGINT or SIGHUP: finish the step, save, stop
            fit(trainer)
    finally:  # whatever ended fit: a save in flight dropped, the staging memory released
        trainer.checkpoints.close()
    if runtime.rank % tiers.this_node().per_node == 0:  # each node's first rank: the finished run's local tier has served
        tiers.remove_run_local(trainer.config, run_dir)


def starting_weights(config: Config, say: Callable[[str], None]) -> HfCheckpoint | None:
    """The Hugging Face checkpoint training.init_from names, found and checked against the model
    (None without one). Under the launcher the workers get it already pinned and checked (a
    directory, or a Hub id at a commit in the Hub cache), and this finds it again, offline."""
    if not config.training.init_from:
        return None
    init = find_checkpoint(config.training.init_from, say)
    check_fits(init, config)
    return init


def unexpected_error() -> int:
    """Print the exception being handled with its traceback, now, and return ERROR. Printed
    before shutdown: leaving a process group after a failure can block on peers that never come
    (NCCL), and a traceback left to the interpreter's exit would then never appear, so an
    out-of-memory error on one rank would look like a hang of them all."""
    traceback.print_exc()
    sys.stderr.flush()
    return ERROR


def lost_peer(error: BaseException, words: str, log: logging.Logger) -> int:
    """A collective broke because another rank went away: a consequence of that rank's failure,
    said in one line (the traceback goes to this worker's log), and PEER_LOST, on which the
    launcher waits for the cause instead of blaming this rank (pretrain/distributed/peer_loss.py)."""
    peer_loss.report(error, words, log)
    return PEER_LOST


def main(argv: Sequence[str] | None = None) -> int:
    return run_command(parse_args(sys.argv[1:] if argv is None else argv))


def run_command(args: argparse.Namespace) -> int:
    """One training process on arguments already read (parse_args); its exit code."""
    try:
        config = cfg.from_args(args)
        if not config.training.resume:  # a fresh run: a checkpoint to start from is checked before anything starts,
            # and pinned as the launcher pins it (a Hub id at its commit), so train() finds it again in the cache
            config, _ = for_workers(config, lambda line: print(f"pretrain: {line}", file=sys.stderr, flush=True))
        scripted = faults.scripted()  # PRETRAIN_FAULTS, refused here if malformed
        runtime = init_runtime(config)
        float8.check_device(config, runtime.device)  # torchao, and float8 tensor cores for training.float8 true
    except Refusal as error:
        print(f"pretrain: error: {error}", file=sys.stderr)
        return error.exit_code
    log = setup_logging(runtime.label, config.logging.level)
    peers_alive = False  # whether every rank reaches shutdown() together
    try:
        train(config, runtime, args.run_dir, log, faults.for_rank(scripted, runtime.rank))
        peers_alive = True
    except Stopped as stop:
        peers_alive = True
        return by_signal(stop.signum)
    except (KeyboardInterrupt, SystemExit) as error:  # a stop signal before training: while preparing the data
        if (signum := stop_signal(error)) is None:
            raise
        return by_signal(signum)
    except NumericalFailure as error:
        peers_alive = True  # every rank agreed on the step and stops there
        log.error(str(error))
        return NUMERICAL_FAILURE
    except peer_loss.PeerFailed as error:
        log.error(str(error))
        return PEER_LOST
    except RuntimeError as error:
        if runtime.distributed and (gone := peer_loss.peer_gone(error)) is not None:
            return lost_peer(error, gone, log)
        if not (runtime.distributed and "timed out" in str(error).lower()):
            return unexpected_error()
        # gloo's message says only which operation timed out; say what it means.
        log.error(
            f"a collective waited longer than system.collective_timeout "
            f"({config.system.collective_timeout:g} s) for the other ranks: one of them is frozen or "
            f"gone (its log says which); {str(error).splitlines()[0]}"
        )
        return ERROR
    except Refusal as error:  # below RuntimeError, which takes a RuntimeSetupError raised in training
        log.error(str(error))
        return error.exit_code
    except OSError as error:  # an unwritable run or cache directory, a full disk
        log.error(os_error_message(error))
        return BAD_INPUT
    except Exception as error:  # a lost peer may come wrapped in another error (DCP's, say)
        if runtime.distributed and (gone := peer_loss.peer_gone(error)) is not None:
            return lost_peer(error, gone, log)
        return unexpected_error()
    finally:
        shutdown(runtime, peers_alive)
    return 0
