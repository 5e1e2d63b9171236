"""A run's attempts (--max-restarts N): after a transient failure (launcher/supervise/restarts.py says
which), wait a short backoff, choose devices afresh (a GPU that failed its health check is left out;
with --min-nproc M, fewer GPUs keep the global batch through gradient accumulation) and start the
run again from its latest complete checkpoint, in the same run directory, until it ends for good.
Every attempt goes into <run dir>/restarts.jsonl; the final exit code is the last attempt's."""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import signal
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from launcher.errors import UsageError
from launcher.exit_codes import by_signal
from launcher.gpus.placement import GpuOptions, Placement, place
from launcher.gpus import health, nvml
from launcher.gpus.selection import DeviceError, find, parse_request
from launcher.nodes import multinode
from launcher.processes.torchrun_env import Restarts
from launcher.supervise import restarts
from launcher.supervise.printer import Printer, use_colour
from pretrain import config as cfg
from pretrain.run.files import runs_root

if TYPE_CHECKING:
    from launcher.launch import Devices

RETRY_SECONDS = 5.0
"""How often a restart that waits for its devices looks for them again."""

Attempt = Callable[[cfg.Config, Restarts], tuple[int, restarts.AttemptEnd]]
"""One attempt: the config it runs and its restart count -> its exit code and how it ended."""


class StoppedBetweenAttempts(Exception):
    """SIGTERM or SIGHUP (or Ctrl-C) came while no worker ran: between two attempts."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


@dataclass
class Attempts:
    args: argparse.Namespace
    config: cfg.Config
    """The first attempt's config (its resume resolved: the exact checkpoint, or "")."""
    command: list[str]
    run_dir: Path
    console: Printer
    started: bool = False
    """Whether an attempt has run (a later error must not give the run directory up)."""

    @property
    def training(self) -> bool:
        return not self.command

    def run(self, attempt: Attempt, devices: Devices) -> int:
        """Run attempts until one ends for good; return its exit code."""
        max_restarts = self.args.max_restarts
        if max_restarts == 0:
            code, _ = attempt(self.config, Restarts())
            self.started = True
            return code
        first_world = devices.placement.world_size
        self.check_min_nproc(first_world)
        if self.training:
            warn_without_checkpoints(self.config, self.console.launcher_line)
        record = restarts.Record(self.run_dir / restarts.RECORD)
        config, previous = self.config, None
        for number in itertools.count():
            entry = record.begin(labels(devices.placement), config.training.resume or None if self.training else None)
            code, end = attempt(config, Restarts(number, max_restarts))
            self.started = True
            with self.logged():  # what happens between two attempts goes into combined.log too
                verdict = restarts.judge(end, number, max_restarts, previous, self.training)
                if warning := record.end(entry, end, verdict):
                    self.console.launcher_line(warning)
                if not verdict.restart:
                    if code != 0:
                        self.console.launcher_line(f"not restarted: {verdict.why}")
                    if number > 0:
                        self.console.launcher_line("\n".join(record.summary()))
                    return code
                previous = end
                wait = restarts.backoff(number + 1, self.args.restart_backoff)
                self.console.launcher_line(f"restart {number + 1} of {max_restarts} in {wait:g} s: {verdict.why}")
                try:
                    with stop_signals_raise():
                        time.sleep(wait)
                        devices.placement.release()
                        devices.placement = self.place_again(devices, first_world)
                except StoppedBetweenAttempts as stopped:
                    if warning := record.end(entry, end, restarts.Verdict(False, f"stopped by {stopped} before the restart")):
                        self.console.launcher_line(warning)
                    self.console.launcher_line(f"stopped by {stopped}: no restart; the run's checkpoints are kept")
                    return by_signal(stopped.signum)
                except DeviceError as error:  # the devices did not come back: the last failure stands
                    if warning := record.end(entry, end, restarts.Verdict(False, str(error))):
                        self.console.launcher_line(warning)
                    self.console.launcher_line(f"{error}\n" + "\n".join(record.summary()))
                    return code
                config = self.restart_config(devices.placement.world_size, first_world)
        raise AssertionError("unreachable")

    @contextmanager
    def logged(self) -> Iterator[None]:
        """Launcher lines to the console and the run's combined.log (its workers' printer is closed
        between attempts: only one writes the log at a time)."""
        console = self.console
        self.console = Printer(sys.stdout, self.run_dir / "logs", colour=use_colour(sys.stdout))
        try:
            yield
        finally:
            self.console.close()
            self.console = console

    def check_min_nproc(self, world_size: int) -> None:
        """--min-nproc M: at most the run's worker count, and (training) a global batch every
        world size from M up can keep."""
        low = self.args.min_nproc
        if low is None:
            return
        if low > world_size:
            raise UsageError(f"--min-nproc {low} is more than this run's {world_size} worker(s); give at most {world_size}")
        if not self.training:
            return
        check_global_batch_kept(self.config.training, world_size, range(low, world_size), "--min-nproc", "worker(s)")

    def place_again(self, devices: Devices, first_world: int) -> Placement:
        """Devices for the next attempt: as many as the first had, else (--min-nproc) down to M,
        else wait for them up to --join-timeout, then stop (one line)."""
        low = self.args.min_nproc or first_world
        deadline = time.monotonic() + self.args.join_timeout
        said = False
        while True:
            problems = []
            for size in range(first_world, low - 1, -1):
                try:
                    return place(sized(devices, size), self.console)
                except DeviceError as error:
                    problems.append(str(error))
            if not said:
                fewer = "" if low < first_world else " (--min-nproc M would go on with fewer)"
                self.console.launcher_line(
                    f"waiting up to {self.args.join_timeout:g} s for {first_world} free, healthy device(s) to restart on"
                    f"{fewer}; the restart asked for the run's count: {problems[0]}"
                )
                said = True
            if time.monotonic() >= deadline:
                raise DeviceError(
                    f"no restart: {problems[0]}; waited {self.args.join_timeout:g} s (--join-timeout) for "
                    f"{first_world} device(s)" + (f" or at least {low} (--min-nproc)" if low < first_world else "")
                )
            time.sleep(min(RETRY_SECONDS, max(0.0, deadline - time.monotonic())))

    def restart_config(self, world_size: int, first_world: int) -> cfg.Config:
        """The first attempt's config, resuming from the run's latest complete checkpoint (from step 0
        when there is none yet), on world_size workers with the first attempt's global batch."""
        if not self.training:
            return self.config
        from pretrain.checkpoint.resume import resolve_resume

        _, checkpoint = resolve_resume("auto", str(self.run_dir), runs_root(), world_size)
        say = self.console.launcher_line
        say(f"resuming from {checkpoint}" if checkpoint else "no complete checkpoint yet: starting again at step 0")
        training = dataclasses.replace(self.config.training, resume=str(checkpoint) if checkpoint else "")
        if world_size != first_world:
            batch = global_batch(self.config.training, first_world)
            training = dataclasses.replace(training, global_batch_size=batch)
            self.console.launcher_line(
                f"{world_size} worker(s) instead of {first_world}: the global batch stays {batch} sequences "
                "(more gradient accumulation per worker)"
            )
        return dataclasses.replace(self.config, training=training)


MAX_RESTARTS = 1000
MAX_BACKOFF_START = restarts.MAX_BACKOFF


def add_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("restarts (docs/failures.md, Restarts)")
    group.add_argument(
        "--max-restarts",
        "--max_restarts",
        dest="max_restarts",
        type=int,
        default=0,
        metavar="N",
        help="after a transient failure (a worker killed by SIGKILL/SIGSEGV/SIGBUS/SIGABRT, a hang, a "
        "hardware or timeout error), start again from the latest checkpoint, at most N times (default: 0, fail fast)",
    )
    group.add_argument(
        "--min-nproc",
        dest="min_nproc",
        type=int,
        metavar="M",
        help="a restart that cannot get the run's worker count continues on as few as M, keeping the global "
        "batch through gradient accumulation (default: wait for them up to --join-timeout, then stop)",
    )
    group.add_argument(
        "--restart-backoff",
        dest="restart_backoff",
        type=float,
        default=1.0,
        metavar="S",
        help="seconds before the first restart, doubling for each next one, at most 60 (default: 1)",
    )


def check_arguments(args: argparse.Namespace, nnodes: int) -> None:
    """The restart options' one-line refusals, before anything is claimed or started."""
    if not 0 <= args.max_restarts <= MAX_RESTARTS:
        raise UsageError(f"--max-restarts must be between 0 and {MAX_RESTARTS} (got {args.max_restarts}); 0 turns restarts off")
    if not 0 <= args.restart_backoff <= MAX_BACKOFF_START:  # also refuses nan
        raise UsageError(f"--restart-backoff must be between 0 and {MAX_BACKOFF_START:g} seconds (got {args.restart_backoff:g})")
    if args.min_nproc is not None:
        if args.min_nproc < 1:
            raise UsageError(f"--min-nproc must be at least 1 (got {args.min_nproc})")
        if args.max_restarts == 0:
            raise UsageError("--min-nproc only applies to restarts: add --max-restarts N")
    multinode.check_restart_arguments(args, nnodes)


def sized(devices: Devices, size: int) -> GpuOptions:
    """The first attempt's device options, asking for size workers: CPU workers, the size freest
    healthy GPUs, or, where --gpus (or system.device_id) named the GPUs, the first size of those
    that pass their health check now (DeviceError when fewer do)."""
    options = devices.options
    if devices.placement.device == "cpu":
        return dataclasses.replace(options, nproc=size)
    named = parse_request(options.gpus).ids if options.gpus is not None else ()
    if options.device_id is not None:
        named = (str(options.device_id),)
    if not named:
        return dataclasses.replace(options, gpus=f"auto:{size}", nproc=None)
    gpus = nvml.discover(window=0)
    failing = {name: health.assess(find(gpus, name, "--gpus names").health) for name in named}
    healthy = [name for name in named if failing[name].healthy]
    if len(healthy) < size:
        reasons = "; ".join(f"GPU {name}: {a.describe()}" for name, a in failing.items() if not a.healthy)
        raise DeviceError(f"{len(healthy)} of the {len(named)} GPUs --gpus names pass their health check ({reasons})")
    return dataclasses.replace(options, gpus=",".join(healthy[:size]), device_id=None, nproc=None)


def warn_without_checkpoints(config: cfg.Config, say: Callable[[str], None]) -> None:
    """A run that saves no checkpoint before its end restarts at step 0: say so before it starts."""
    if config.training.checkpoint_interval == 0:
        say(
            "warning: training.checkpoint_interval is 0 (no checkpoint before the end): a restart starts again "
            "at step 0; set it (e.g. --set training.checkpoint_interval=100) to restart from the last checkpoint"
        )


def check_global_batch_kept(
    training: cfg.TrainingConfig, world_size: int, sizes: range, option: str, unit: str, per_unit: int = 1
) -> None:
    """A restart onto `size` units (workers, or nodes of per_unit workers) for each size in sizes keeps
    the global batch the first attempt trains on world_size ranks, or this refuses it in one line."""
    batch = global_batch(training, world_size)
    for size in sizes:
        if batch % (training.batch_size * per_unit * size):
            raise UsageError(
                f"{option} {sizes.start}: the global batch of {batch} sequences cannot be kept on {size} {unit}"
                f" (not a multiple of training.batch_size {training.batch_size} x {per_unit * size}); raise {option}, "
                "or set training.global_batch_size to a multiple of every such product"
            )


def global_batch(training: cfg.TrainingConfig, world_size: int) -> int:
    """Sequences per optimizer step over all ranks, as the first attempt trains them."""
    return training.global_batch_size or training.batch_size * training.grad_accum_nums * world_size


def labels(placement: Placement) -> list[str]:
    return [placement.label(local) for local in range(placement.world_size)]


@contextmanager
def stop_signals_raise() -> Iterator[None]:
    """While no worker runs, SIGTERM, SIGHUP and SIGINT stop the launcher with their exit code."""

    def stop(signum: int, _frame: object) -> None:
        raise StoppedBetweenAttempts(signum)

    previous = {sig: signal.signal(sig, stop) for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
