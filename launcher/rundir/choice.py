"""The run directory a launch trains in: which one (new, given, or the one --resume names), and
holding it for the launcher's lifetime (launcher/rundir/lock.py), with the refusals in one line."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path

from launcher.rundir import lock as run_lock
from launcher.errors import UsageError
from launcher.supervise.printer import Printer
from launcher.rundir.lock import LockHolder, RunDirLock
from pretrain import config as cfg
from pretrain.run.files import new_run_id, os_error_message, runs_root


def resume_point(
    config: cfg.Config, run_dir_arg: str | None, printer: Printer, world_size: int | None = None
) -> tuple[RunDirLock, cfg.Config]:
    """Resolve training.resume once, for every worker (world_size of them: the checkpoint must
    hold what each will read), and take the run directory to train in (held until the launcher
    exits): return it, and the config naming the exact checkpoint ("" when starting fresh)."""
    from pretrain.checkpoint.resume import resolve_resume, run_results

    resume = config.training.resume
    # With the config, auto weighs the run's local checkpoints too (a launcher killed left them).
    run_dir, checkpoint = resolve_resume(resume, run_dir_arg, runs_root(), world_size, config, printer.launcher_line)
    run_dir = run_dir_path(run_dir)
    if checkpoint is not None and resume != "auto":
        refuse_live_checkpoint(resume, checkpoint)
    owned = own_run_dir(run_dir, still_training(run_dir_arg) if resume == "auto" else None)
    try:
        # A fresh run where one has trained would replace its checkpoints and append to its metrics.
        if not resume and (results := run_results(owned.path)):
            raise UsageError(
                f"run directory {owned.path} already holds a run ({', '.join(results)}); continue it "
                "with --resume auto (or a checkpoint path), or choose another --run-dir for a new run"
            )
    except BaseException:
        owned.abandon()
        raise
    for skipped in passed_over(resume, run_dir, checkpoint, world_size):
        printer.launcher_line(f"warning: not resuming from the later {skipped}")
    if checkpoint is not None:
        printer.launcher_line(f"resuming from {checkpoint}")
    elif resume == "auto":
        printer.launcher_line("no checkpoint to resume from; starting at step 0")
    training = dataclasses.replace(config.training, resume=str(checkpoint) if checkpoint else "")
    return owned, dataclasses.replace(config, training=training)


def passed_over(resume: str, run_dir: Path, checkpoint: Path | None, world_size: int | None) -> list[str]:
    """The later checkpoints a resume that chose the latest complete one (--resume auto, or a run
    directory) passed over, each as "step_<N>: <missing or damaged file>"; none when --resume
    named the checkpoint itself."""
    from pretrain.checkpoint.resume import damaged, damaged_after

    if checkpoint is None:
        return damaged(run_dir / "checkpoints", world_size=world_size) if resume == "auto" else []
    if resume != "auto" and Path(resume).expanduser().resolve() == checkpoint:
        return []
    return damaged_after(checkpoint, world_size)


def run_dir_path(run_dir: str | Path | None) -> Path:
    """The run directory, absolute: the one given, or a new <runs root>/<run-id>/."""
    return Path(run_dir).expanduser().resolve() if run_dir else runs_root() / new_run_id()


def own_run_dir(
    run_dir: Path, refusal: Callable[[Path, LockHolder], str] | None = None, lock_name: str = run_lock.LOCK_NAME
) -> RunDirLock:
    """Create the run directory if need be and lock it for this launcher's lifetime, before
    anything is written into it; one line (UsageError) when another launcher holds it."""
    try:
        owned = run_lock.take(run_dir, lock_name)
    except OSError as error:
        raise cannot_create(run_dir, error) from None
    if isinstance(owned, LockHolder):
        raise UsageError((refusal or in_use)(run_dir, owned))
    return owned


def cannot_create(run_dir: Path, error: OSError) -> UsageError:
    reason = error.strerror or str(error)
    if error.filename and Path(error.filename) != run_dir:  # its lock file, its logs/
        reason = os_error_message(error)
    return UsageError(f"cannot create run directory {run_dir}: {reason}; choose another with --run-dir")


def in_use(run_dir: Path, holder: LockHolder) -> str:
    return f"run directory {run_dir} is in use by {holder.describe()}; wait for it to end, or choose another with --run-dir"


def still_training(run_dir_arg: str | None) -> Callable[[Path, LockHolder], str]:
    """The refusal of --resume auto whose run is live: how to continue it, and how to start anew."""
    new_run = "leave out --resume" + (" and choose another --run-dir" if run_dir_arg else "")
    return lambda run_dir, holder: (
        f"run directory {run_dir} is still training under {holder.describe()}; "
        f"continue it with --resume auto once that launcher ends, or for a new run {new_run}"
    )


def refuse_live_checkpoint(resume: str, checkpoint: Path) -> None:
    """A live run may replace or prune the checkpoint while it is read, and its run directory is
    not this launch's to write in."""
    owner = checkpoint.parent.parent if checkpoint.parent.name == "checkpoints" else None
    if owner is not None and (holder := run_lock.holder_of(owner)) is not None:
        raise UsageError(
            f"--resume {resume}: its run {owner} is still training under {holder.describe()}; "
            "resume it once that launcher ends, or from a copy of the checkpoint made outside that run"
        )
