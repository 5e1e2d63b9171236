"""A run's attempts (--max-restarts N): after a transient failure (launcher/supervise/restarts.py says
which), wait a short backoff, choose devices afresh (a GPU that failed its health check is left out;
with --min-nproc M, fewer GPUs keep the global batch through gradient accumulation) and start the
run again from its latest complete checkpoint (else the one it started from; devices and checkpoint
as launcher/restart_plan.py chooses them), in the same run directory, until it ends for good. Every
attempt goes into <run dir>/restarts.jsonl, after those of the directory's earlier launches; the
final exit code is the last attempt's. From an attempt's end to the next one's workers, whatever ends
the launcher (a stop signal, a full disk, devices that do not come back) is recorded as why the
attempt was not restarted."""

from __future__ import annotations

import argparse
import functools
import itertools
import signal
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from launcher.errors import UsageError
from launcher.exit_codes import STOP_SIGNALS, by_signal, stop_signal
from launcher.gpus.placement import Placement
from launcher.gpus.request import DeviceError
from launcher.nodes import multinode
from launcher.processes.torchrun_env import Restarts
from launcher.restart_plan import Devices, RestartPlan, check_global_batch_kept, warn_without_checkpoints
from launcher.supervise import restarts
from launcher.supervise.printer import Printer, use_colour
from pretrain import config as cfg
from pretrain.run.files import os_error_message
from pretrain.run.raising_signals import signals_raise

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
class Attempts(RestartPlan):
    """The attempt loop of one machine, over its run's restart plan (devices again, the config resumed)."""

    started: bool = False
    """Whether an attempt's workers were spawned (a later error must not give the run directory up)."""

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


def labels(placement: Placement) -> list[str]:
    return [placement.label(local) for local in range(placement.world_size)]


@contextmanager
def stop_signals_raise() -> Iterator[None]:
    """While no worker runs, SIGTERM, SIGHUP and SIGINT stop the launcher with their exit code
    (also one that lands in a finalizer: pretrain/run/raising_signals.py)."""
    with signals_raise(STOP_SIGNALS, StoppedBetweenAttempts):
        yield
