"""A run's attempts (--max-restarts N): after a transient failure (launcher/supervise/restarts.py says
which), wait a short backoff, choose devices afresh (a GPU that failed its health check is left out;
with --min-nproc M, fewer GPUs keep the global batch through gradient accumulation) and start the
run again from its latest complete checkpoint (else the one it started from), in the same run
directory, until it ends for good. Every attempt goes into <run dir>/restarts.jsonl, after those of
the directory's earlier launches; the final exit code is the last attempt's. From an attempt's end to
the next one's workers, whatever ends the launcher (a stop signal, a full disk, devices that do not
come back) is recorded as why the attempt was not restarted."""

from __future__ import annotations

import argparse
import dataclasses
import functools
import itertools
import json
import signal
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from launcher.errors import UsageError
from launcher.exit_codes import STOP_SIGNALS, by_signal, stop_signal
from launcher.gpus.placement import GpuOptions, Placement, place
from launcher.gpus import health, vendors
from launcher.gpus.selection import DeviceError, find, parse_request
from launcher.nodes import multinode
from launcher.processes.torchrun_env import Restarts
from launcher.supervise import restarts
from launcher.supervise.printer import Printer, use_colour
from pretrain import config as cfg
from pretrain.run.files import os_error_message

if TYPE_CHECKING:
    from launcher.launch import Devices

RETRY_SECONDS = 5.0
"""How often a restart that waits for its devices looks for them again."""

Attempt = Callable[[cfg.Config, Restarts, Callable[[], None]], tuple[int, restarts.AttemptEnd]]
"""One attempt: the config it runs, its restart count, and what to call once its workers are spawned
(the supervisor holds the stop signals from then on) -> its exit code and how it ended."""


class StoppedBetweenAttempts(SystemExit):
    """SIGTERM or SIGHUP (or Ctrl-C) came while no worker ran: between two attempts. A SystemExit
    with the signal's exit code, as pretrain/data/cache.py's sigterm_as_exit raises: code on the way
    (a dataset build, a download) cleans up as it does for that one, no `except Exception` swallows
    it, and a second signal while the first is handled still ends the launcher with its code."""

    def __init__(self, signum: int) -> None:
        super().__init__(by_signal(signum))
        self.signum = signum

    def __str__(self) -> str:
        return signal.Signals(self.signum).name


@dataclass
class Pending:
    """An attempt that ended, from then until the next attempt's workers are spawned: its line of
    restarts.jsonl says "restarted" only once they are."""

    entry: restarts.Attempt
    end: restarts.AttemptEnd
    code: int
    verdict: restarts.Verdict | None = None
    """The restart rules' word on it, once given."""


@dataclass
class Attempts:
    args: argparse.Namespace
    config: cfg.Config
    """The first attempt's config (its resume resolved: the exact checkpoint, or "")."""
    command: list[str]
    run_dir: Path
    console: Printer
    started: bool = False
    """Whether an attempt's workers were spawned (a later error must not give the run directory up)."""
    local_choice: Callable[[Path | None, int], Path | None] | None = None
    """Several nodes: the local checkpoint every node has that a restart on world_size workers takes
    over the durable one given (launcher/local_tier.py, agreed), None for the durable one; None: this
    machine's own local tier (pretrain/checkpoint/tiers.py, newest)."""

    @property
    def training(self) -> bool:
        return not self.command

    def run(self, attempt: Attempt, devices: Devices) -> int:
        """Run attempts until one ends for good; return its exit code."""
        if self.args.max_restarts == 0:
            code, _ = attempt(self.config, Restarts(), self.spawned)
            return code
        self.check_min_nproc(devices.placement.world_size)
        if self.training:
            warn_without_checkpoints(self.config, self.console.launcher_line)
        # While workers run, the supervisor takes the stop signals; from an attempt's end to the next
        # attempt's workers, they raise here, wherever the launcher is (judging, the backoff, preparing).
        with stop_signals_raise():
            return self.attempts(attempt, devices)

    def spawned(self) -> None:
        self.started = True

    def attempts(self, attempt: Attempt, devices: Devices) -> int:
        record = restarts.Record(self.run_dir / restarts.RECORD)
        first_world, config = devices.placement.world_size, self.config
        previous: restarts.AttemptEnd | None = None
        pending: Pending | None = None
        for number in itertools.count():
            begun: list[restarts.Attempt] = []  # its line of the record, once its workers are spawned
            spawned = functools.partial(self.begin, record, begun, devices, config, pending)
            try:
                try:
                    code, end = attempt(config, Restarts(number, self.args.max_restarts), spawned)
                except BaseException as error:
                    if not begun or (signum := stop_signal(error)) is None:
                        raise
                    code = by_signal(signum)  # a stop just after its workers ended: asked for
                    end = restarts.AttemptEnd(code, stopped=True)
                if not begun:
                    spawned()
                pending = Pending(begun[0], end, code)
                with self.logged():  # what happens between two attempts goes into combined.log too
                    if (ended := self.judge(record, pending, number, previous)) is not None:
                        return ended
                    previous = end
                    self.back_off(number + 1, pending)
                    devices.placement.release()
                    devices.placement = self.place_again(devices, first_world)
                    config = self.restart_config(devices.placement.world_size, first_world)
            except BaseException as error:
                if pending is None or begun and pending.entry is not begun[0]:
                    raise  # the first attempt did not start (as without restarts), or the launcher's own failure
                return self.not_restarted(record, pending, error)
        raise AssertionError("unreachable")

    def begin(
        self,
        record: restarts.Record,
        begun: list[restarts.Attempt],
        devices: Devices,
        config: cfg.Config,
        pending: Pending | None,
    ) -> None:
        """Once an attempt's workers are spawned: its line in the record, and the restart before it
        recorded as made."""
        self.started = True
        resumed = config.training.resume or None if self.training else None
        begun.append(record.begin(labels(devices.placement), resumed))
        if pending is not None and pending.verdict is not None:
            if warning := record.decide(pending.entry, pending.verdict):
                self.console.launcher_line(warning)

    def judge(self, record: restarts.Record, pending: Pending, number: int, previous: restarts.AttemptEnd | None) -> int | None:
        """The restart rules on the attempt that ended: its exit code when it is the last, else None
        (recorded as not restarted until the next attempt's workers start)."""
        max_restarts = self.args.max_restarts
        verdict = restarts.judge(pending.end, number, max_restarts, previous, self.training)
        pending.verdict = verdict
        written = verdict if not verdict.restart else restarts.Verdict(False, f"{verdict.why} (restart {number + 1} pending)")
        if warning := record.end(pending.entry, pending.end, written):
            self.console.launcher_line(warning)
        if verdict.restart:
            return None
        if pending.code != 0:
            self.console.launcher_line(f"not restarted: {verdict.why}")
        if number > 0:
            self.console.launcher_line("\n".join(record.summary()))
        return pending.code

    def back_off(self, restart: int, pending: Pending) -> None:
        wait = restarts.backoff(restart, self.args.restart_backoff)
        why = pending.verdict.why if pending.verdict is not None else ""
        self.console.launcher_line(f"restart {restart} of {self.args.max_restarts} in {wait:g} s: {why}")
        time.sleep(wait)

    def not_restarted(self, record: restarts.Record, pending: Pending, error: BaseException) -> int:
        """The restart decided did not happen, or the attempt's end was cut short before the rules
        spoke: the record says so and why, the attempts are listed, and the launcher ends as the error
        says: a stop signal with its code, devices that did not come back with the last failure's code,
        a full disk or another refusal with its one line (exit 2)."""
        if pending.verdict is not None and not pending.verdict.restart:
            raise error  # the run had ended for good: nothing to take back
        said: list[str] = []
        if (signum := stop_signal(error)) is not None:
            name = signal.Signals(signum).name
            why = f"stopped by {name} before {'the' if pending.verdict else 'any'} restart"
            said.append(f"stopped by {name}: no restart; the run's checkpoints are kept")
        elif isinstance(error, DeviceError):
            why = str(error)
            said.append(why)
        elif isinstance(error, OSError) and error.filename:  # a full disk: config.json, the logs
            again = "continue the run with --resume auto" if self.training else "launch it again"
            why = f"no restart: {os_error_message(error)}; make room on its disk (or make it writable), then {again}"
            error = UsageError(why)
        else:  # a refusal (the dataset, the checkpoint) or the launcher's own failure: passed on
            why = "no restart: " + (str(error).strip().splitlines() or [type(error).__name__])[0]
        with self.logged():
            if warning := record.end(pending.entry, pending.end, restarts.Verdict(False, why)):
                self.console.launcher_line(warning)
            self.console.launcher_line("\n".join(said + record.summary()))
        if signum is not None:
            return by_signal(signum)
        if isinstance(error, DeviceError):
            return pending.code  # the last failure stands
        raise error

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
        """The first attempt's config, resuming from restart_point() on world_size workers with the
        first attempt's global batch."""
        if not self.training:
            return self.config
        checkpoint = self.restart_point(world_size)
        training = dataclasses.replace(self.config.training, resume=str(checkpoint) if checkpoint else "")
        if world_size != first_world:
            batch = global_batch(self.config.training, first_world)
            training = dataclasses.replace(training, global_batch_size=batch)
            self.console.launcher_line(
                f"{world_size} worker(s) instead of {first_world}: the global batch stays {batch} sequences "
                "(more gradient accumulation per worker)"
            )
        return dataclasses.replace(self.config, training=training)

    def restart_point(self, world_size: int) -> Path | None:
        """The checkpoint a restart on world_size workers resumes from, said in a line: the run
        directory's latest complete one if it is newer than where the first attempt started, else
        where the first attempt started (a checkpoint --resume named, maybe another run's; refused
        in one line if it is no longer complete), else none: step 0, with training.init_from's
        weights if it names some. A newer checkpoint of the run passed over as damaged is named, as
        `--resume auto` names it."""
        from pretrain.checkpoint import tiers
        from pretrain.checkpoint.resume import ResumeError, checkpoint_at, damaged, latest

        say = self.console.launcher_line
        first = Path(self.config.training.resume) if self.config.training.resume else None
        durable = latest(self.run_dir / "checkpoints", world_size)
        if self.local_choice is not None:
            local = self.local_choice(durable, world_size)
            own = local if local is not None and (durable is None or tiers.steps_of(local) > tiers.steps_of(durable)) else durable
        else:
            local_dir = tiers.local_dir_of(self.config, self.run_dir, tiers.NodePlace())
            own = tiers.newest(self.run_dir / "checkpoints", local_dir, world_size, say)
        # Later local ones (damaged, or not on every node) are of the continuation this restart
        # abandons: each node's launcher removes them as it takes its local tier (launcher/local_tier.py).
        checkpoint = own.resolve() if own is not None else None
        if first is not None and (checkpoint is None or steps_of(checkpoint) <= steps_of(first)):
            try:
                checkpoint = checkpoint_at(first, world_size)
            except ResumeError as error:
                raise ResumeError(
                    f"the checkpoint the run started from cannot be resumed any more: {error}; put it back, "
                    "or continue the run from another with --resume"
                ) from None
        for skipped in damaged(self.run_dir / "checkpoints", steps_of(checkpoint) if checkpoint else -1, world_size):
            say(f"warning: not resuming from the later {skipped}")
        if checkpoint is not None:
            where = " (where the run started: it has no newer complete checkpoint)" if checkpoint == first else ""
            in_local = own is not None and checkpoint == own.resolve() and own.parent != self.run_dir / "checkpoints"
            tier = " (local)" if in_local else ""
            say(f"resuming from {checkpoint}{tier}{where}")
        elif init_from := self.config.training.init_from:
            say(f"no complete checkpoint yet: starting again at step 0 from training.init_from's weights ({init_from})")
        else:
            say("no complete checkpoint yet: starting again at step 0")
        return checkpoint


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
        default=None,  # None: not given (refused without --max-restarts), 1 s (restarts.DEFAULT_BACKOFF)
        metavar="S",
        help="seconds before the first restart, doubling for each next one, at most 60 (default: 1)",
    )


def check_arguments(args: argparse.Namespace, nnodes: int) -> None:
    """The restart options' one-line refusals, before anything is claimed or started."""
    if not 0 <= args.max_restarts <= MAX_RESTARTS:
        raise UsageError(f"--max-restarts must be between 0 and {MAX_RESTARTS} (got {args.max_restarts}); 0 turns restarts off")
    if args.restart_backoff is not None:
        if not 0 <= args.restart_backoff <= MAX_BACKOFF_START:  # also refuses nan
            raise UsageError(
                f"--restart-backoff must be between 0 and {MAX_BACKOFF_START:g} seconds (got {args.restart_backoff:g})"
            )
        if args.max_restarts == 0:
            raise UsageError("--restart-backoff only applies to restarts: add --max-restarts N")
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
    gpus = vendors.backend(options.gpu_vendor).discover(window=0)
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
    for size in sizes:  # under grad_accum_nums "auto" the plan fits the micro-batch to each size's share
        auto = training.grad_accum_nums == "auto"
        micro = 1 if auto else training.batch_size
        if batch % (micro * per_unit * size):
            rule = (
                f"not a multiple of {per_unit * size}: grad_accum_nums auto shares it equally over the workers"
                if auto
                else f"not a multiple of training.batch_size {training.batch_size} x {per_unit * size}"
            )
            raise UsageError(
                f"{option} {sizes.start}: the global batch of {batch} sequences cannot be kept on {size} {unit}"
                f" ({rule}); raise {option}, or set training.global_batch_size to a multiple of every such product"
            )


def global_batch(training: cfg.TrainingConfig, world_size: int) -> int:
    """Sequences per optimizer step over all ranks, as the first attempt trains them."""
    return training.global_batch_size or training.batch_size * cfg.grad_accum_nums(training) * world_size


def labels(placement: Placement) -> list[str]:
    return [placement.label(local) for local in range(placement.world_size)]


@contextmanager
def stop_signals_raise() -> Iterator[None]:
    """While no worker runs, SIGTERM, SIGHUP and SIGINT stop the launcher with their exit code."""

    def stop(signum: int, _frame: object) -> None:
        raise StoppedBetweenAttempts(signum)

    previous = {sig: signal.signal(sig, stop) for sig in STOP_SIGNALS}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def steps_of(checkpoint: Path) -> int:
    """The steps a checkpoint holds (its state.json's steps_done; -1 when it cannot be read)."""
    try:
        steps = json.loads((checkpoint / "state.json").read_text(encoding="utf-8"))["steps_done"]
    except (OSError, ValueError, KeyError, TypeError):
        return -1
    return steps if isinstance(steps, int) else -1
