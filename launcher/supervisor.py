"""The lifetime of a group of workers: one loop over typed events.

Teardown rules (each has a test in tests/test_supervisor.py):
1. The first worker to exit non-zero decides the outcome: the supervisor returns its exit
   code (a death by signal n returns 128 + n). Success means every worker exited 0.
2. On that first failure every other worker's process group gets SIGTERM, and SIGKILL
   once `kill_grace` seconds have passed.
3. SIGINT or SIGTERM to the supervisor starts the same teardown for all workers and
   returns 130 or 143; a second signal SIGKILLs at once.
4. When the loop ends, every worker's process group gets SIGKILL, so nothing a worker
   started in its group outlives the run.
"""

from __future__ import annotations

import json
import queue
import signal
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

from launcher.printer import Printer
from launcher.worker import Event, Exited, Line, OutputClosed, Worker
from pretrain.runfiles import atomic_write_text

OUTPUT_DRAIN_SECONDS = 1.0  # after the last exit, wait this long for pipes held by leftovers
TAIL_LINES = 20


def exit_code(returncode: int) -> int:
    """A shell-style exit status: a death by signal n becomes 128 + n."""
    return 128 - returncode if returncode < 0 else returncode


def describe(returncode: int) -> str:
    if returncode < 0:
        try:
            return f"killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"killed by signal {-returncode}"
    return f"exit code {returncode}"


class StartError(OSError):
    """A worker's command exists but cannot be executed (not executable, bad format)."""


@dataclass(frozen=True)
class Interrupted:
    """The supervisor itself received SIGINT or SIGTERM."""
    signum: int


@dataclass
class _State:
    returncodes: dict[Worker, int] = field(default_factory=dict)
    open_outputs: set[Worker] = field(default_factory=set)
    tails: dict[Worker, deque[str]] = field(default_factory=dict)
    first_failure: Worker | None = None
    failed_at: float = 0.0
    interrupted_by: int | None = None
    teardown_started: float | None = None
    stopped: int = 0
    """Workers still running at the first failure, which the teardown stopped."""
    kill_at: float | None = None


class Supervisor:
    def __init__(self, workers: list[Worker], printer: Printer, kill_grace: float = 5.0,
                 run_dir: Path | None = None) -> None:
        self.workers = workers
        self.printer = printer
        self.kill_grace = kill_grace
        self.run_dir = run_dir
        self._events: queue.SimpleQueue[Event | Interrupted] = queue.SimpleQueue()  # put() is signal-safe
        self._state = _State()

    # --- the loop -----------------------------------------------------------------------

    def run(self) -> int:
        """Start every worker, watch them to the end, and return the exit code."""
        state = self._state
        previous = {sig: signal.signal(sig, self._on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            # Every process is spawned before any thread starts: forking while other
            # threads run is what makes preexec_fn unsafe.
            for worker in self.workers:
                try:
                    worker.start()
                except OSError as error:
                    raise StartError(f"cannot run {worker.argv[0]}: {error.strerror or error}") from None
            for worker in self.workers:
                state.open_outputs.add(worker)
                state.tails[worker] = deque(maxlen=TAIL_LINES)
                worker.watch(self._events.put)
            while len(state.returncodes) < len(self.workers):
                self._handle(self._next_event())
            self._drain_output()
        finally:
            for worker in self.workers:
                worker.signal_group(signal.SIGKILL)  # rule 4
            for sig, handler in previous.items():
                signal.signal(sig, handler)
        self._record_exit_codes()
        return self._outcome()

    def _next_event(self) -> Event | Interrupted | None:
        state = self._state
        timeout = None if state.kill_at is None else max(0.0, state.kill_at - time.monotonic())
        try:
            return self._events.get(timeout=timeout)
        except queue.Empty:
            return None  # the grace period is over

    def _handle(self, event: Event | Interrupted | None) -> None:
        state = self._state
        match event:
            case Line(worker, text):
                state.tails[worker].append(text)
                self.printer.worker_line(worker.label, text)
            case OutputClosed(worker):
                state.open_outputs.discard(worker)
            case Exited(worker, returncode):
                state.returncodes[worker] = returncode
                if returncode != 0 and state.first_failure is None and state.interrupted_by is None:
                    state.first_failure, state.failed_at = worker, time.monotonic()
                    state.stopped = len(self._running())
                    self.printer.launcher_line(
                        f"{worker.label} failed ({describe(returncode)}); stopping the other workers")
                    self._begin_teardown()  # rule 2
            case Interrupted(signum):
                if state.teardown_started is not None:
                    self.printer.launcher_line("second signal: killing every worker now")
                    self._kill_all(announce=False)
                else:
                    state.interrupted_by = signum
                    self.printer.launcher_line(
                        f"received {signal.Signals(signum).name}: stopping workers "
                        f"(again to kill them at once)")
                    self._begin_teardown()  # rule 3
            case None:
                self._kill_all()

    def _on_signal(self, signum: int, _frame: object) -> None:
        self._events.put(Interrupted(signum))

    # --- teardown -----------------------------------------------------------------------

    def _running(self) -> list[Worker]:
        return [w for w in self.workers if w not in self._state.returncodes]

    def _begin_teardown(self) -> None:
        state = self._state
        state.teardown_started = time.monotonic()
        state.kill_at = state.teardown_started + self.kill_grace
        for worker in self._running():
            worker.signal_group(signal.SIGTERM)

    def _kill_all(self, announce: bool = True) -> None:
        state = self._state
        running = self._running()
        if running and announce:
            self.printer.launcher_line(
                f"{', '.join(w.label for w in running)} still running after "
                f"{self.kill_grace:g} s; sending SIGKILL")
        for worker in running:
            worker.signal_group(signal.SIGKILL)
        state.kill_at = None

    def _drain_output(self) -> None:
        """Print what the workers wrote before exiting; don't wait forever on a pipe that a
        leftover grandchild still holds open (rule 4 kills it right after)."""
        deadline = time.monotonic() + OUTPUT_DRAIN_SECONDS
        while self._state.open_outputs and time.monotonic() < deadline:
            try:
                event = self._events.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                break
            if not isinstance(event, Interrupted):
                self._handle(event)

    # --- outcome ------------------------------------------------------------------------

    def _outcome(self) -> int:
        state = self._state
        if state.first_failure is not None:
            self._print_failure_summary(state.first_failure)
            return exit_code(state.returncodes[state.first_failure])
        if state.interrupted_by is not None:
            return 128 + state.interrupted_by
        return 0

    def _print_failure_summary(self, worker: Worker) -> None:
        state = self._state
        returncode = state.returncodes[worker]
        elapsed = state.failed_at - worker.started_at
        teardown = time.monotonic() - state.failed_at
        lines = [
            "=" * 72,
            f"FAILED: {worker.label} (rank {worker.rank}) failed first, {elapsed:.1f} s after start, "
            f"with {describe(returncode)}.",
            f"Stopped {state.stopped} other running worker(s); teardown took {teardown:.2f} s.",
        ]
        if state.tails[worker]:
            lines.append(f"Last {len(state.tails[worker])} lines of {worker.label}:")
            lines += [f"  {line}" for line in state.tails[worker]]
        if self.run_dir is not None:
            lines.append(f"Full logs: {self.run_dir / 'logs'}")
        lines.append("=" * 72)
        self.printer.launcher_line("\n".join(lines))

    def _record_exit_codes(self) -> None:
        if self.run_dir is None:
            return
        record = [{"rank": w.rank, "label": w.label, "pid": w.process.pid if w.process else None,
                   "returncode": self._state.returncodes.get(w),
                   "exit_code": exit_code(self._state.returncodes[w]) if w in self._state.returncodes else None,
                   "failed_first": w is self._state.first_failure}
                  for w in self.workers]
        atomic_write_text(self.run_dir / "workers.json", json.dumps(record, indent=2) + "\n")
