"""The lifetime of a group of workers: one loop over typed events.

Teardown rules (each has a test in tests/test_supervisor.py or tests/test_launcher_cli.py):
1. The first worker to fail decides the outcome: the supervisor returns its exit code (a
   death by signal n returns 128 + n). A worker that prints nothing for hang_timeout
   seconds has failed, with exit code 124. Success means every worker exited 0.
2. On that first failure, workers that can dump their stacks are asked to (the summary
   shows where each one was; this waits at most STACK_DUMP_MAX_WAIT), then every process of
   the run gets SIGTERM at once: every running worker's process group, the descendants that
   left their group (found as in rule 4) and what is left of exited workers' groups. Those
   still running kill_grace seconds later get SIGKILL, so the grace is spent only on
   processes that ignore SIGTERM.
   An exit code the workers agree on (agreed_exit_codes: a numerical failure, which every
   rank stops for at the same step) gives the others AGREED_EXIT_GRACE seconds to exit on
   their own first.
3. SIGINT, SIGTERM or SIGHUP to the supervisor asks every worker to stop gracefully with
   SIGTERM: to every process of the run as in rule 2, or, for training workers, to the worker
   process alone, so it can finish its step and save while its helpers (data loaders) keep
   working. After stop_timeout seconds they are killed; a second SIGINT or SIGTERM kills at
   once (a second SIGHUP does not: a closing terminal can send it twice, and is no request to
   hurry). A group that got SIGTERM (rules 2 and 3) has until that deadline to finish, even
   once its worker has exited: what a shell started is still printing its last words.
   Returns 130, 143 or 129, unless a worker fails while stopping (an exit code other than 0
   or a death by that SIGTERM): that is a failure as in rule 1.
4. When the loop ends, every process of the run is SIGKILLed: the workers' groups and
   the descendants that left them (setsid, double fork), found by the run's token in
   their environment and, with adopt_orphans, by being re-parented to the supervisor.
   A SIGKILLed supervisor cannot do this: its workers die with it (parent-death signal)
   and the guardian process kills the rest: whatever carries the token or is in a
   worker's group, and every process of the run the supervisor saw (it looks every
   SNAPSHOT_INTERVAL seconds).
"""

from __future__ import annotations

import json
import os
import queue
import signal
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

from launcher import reaper, summary
from launcher.guardian import Guardian
from launcher.printer import Printer
from launcher.worker import Event, Exited, Line, OutputClosed, Worker
from pretrain.runfiles import PROJECT_ROOT, atomic_write_text, os_error_message

OUTPUT_DRAIN_SECONDS = 1.0  # after teardown, wait at most this long for the rest of the output
# SIGTERM right after the stack-dump signal would kill a worker before it dumps (a default
# SIGTERM is fatal at once), so it waits until every worker has begun its dump and a little
# longer for the rest of it, or at most the first delay.
STACK_DUMP_MAX_WAIT = 0.3
AGREED_EXIT_GRACE = 5.0
STACK_DUMP_SETTLE = 0.03
NO_DUMP = "no stack dump: the process was stopped (SIGSTOP) or is stuck in the kernel"
SNAPSHOT_INTERVAL = 0.5  # how often the guardian learns the run's processes (one /proc pass)
TAIL_LINES = 20
EXIT_HANG = 124  # as timeout(1) reports it
# How a worker ends when asked to stop: 0, or by (or after handling) SIGTERM.
STOPPED_AS_ASKED = {0, -signal.SIGTERM, 128 + signal.SIGTERM}
# What asks the supervisor to stop gracefully (rule 3): Ctrl-C, a scheduler, a closed terminal.
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


def exit_code(returncode: int) -> int:
    """A shell-style exit status: a death by signal n becomes 128 + n."""
    return 128 - returncode if returncode < 0 else returncode


class StartError(OSError):
    """A worker's command exists but cannot be executed (not executable, bad format)."""


@dataclass(frozen=True)
class Interrupted:
    """The supervisor itself received one of STOP_SIGNALS."""
    signum: int


@dataclass
class _Watch:
    """What the supervisor knows about one running worker."""
    last_output: float
    tail: deque[str] = field(default_factory=lambda: deque(maxlen=TAIL_LINES))
    returncode: int | None = None
    output_open: bool = True
    cuda_oom: bool = False
    nccl_watchdog: str | None = None
    """The hint for what NCCL's watchdog reported before it aborted the worker."""
    nonfinite_report: str | None = None
    """The banner of the NaN/Inf report the worker logged."""
    stacks: summary.StackDump = field(default_factory=summary.StackDump)


@dataclass
class _FirstFailure:
    worker: Worker
    at: float
    clock: str
    stopped: int
    """Other workers still running at that moment, which the teardown stopped."""
    hung_for: float | None = None
    unresponsive: bool = False
    """For a hang: the worker did not answer the stack-dump request either (it is frozen)."""


class Supervisor:
    def __init__(self, workers: list[Worker], printer: Printer, *, kill_grace: float = 5.0,
                 stop_timeout: float = 120.0, hang_timeout: float | None = None,
                 stack_dump_signal: int | None = None, stop_leaders_only: bool = False,
                 run_dir: Path | None = None, adopt_orphans: bool = False,
                 exit_meanings: dict[int, str] | None = None,
                 agreed_exit_codes: frozenset[int] = frozenset()) -> None:
        """stack_dump_signal: the signal on which the workers print their Python stacks
        (only for commands known to handle it; by default it would kill them).
        stop_leaders_only: a graceful stop signals only each worker process, which stops
        its own helpers (for training workers); otherwise their whole groups.
        adopt_orphans: make this process a child subreaper, so descendants that double
        fork stay findable; only for a process that runs nothing but this supervisor.
        exit_meanings: what the workers' own exit codes mean, named in the summary.
        agreed_exit_codes: codes every worker exits with together (rule 2)."""
        self.workers = workers
        self.printer = printer
        self.kill_grace = kill_grace
        self.stop_timeout = stop_timeout
        self.hang_timeout = hang_timeout
        self.stack_dump_signal = stack_dump_signal
        self.stop_leaders_only = stop_leaders_only
        self.run_dir = run_dir
        self.adopt_orphans = adopt_orphans
        self.exit_meanings = exit_meanings or {}
        self.agreed_exit_codes = agreed_exit_codes
        self._token = reaper.new_token()
        self._events: queue.SimpleQueue[Event | Interrupted] = queue.SimpleQueue()  # put() is signal-safe
        self._watch: dict[Worker, _Watch] = {}
        self._guardian: Guardian | None = None
        self._failure: _FirstFailure | None = None
        self._interrupted_by: int | None = None
        self._interrupted_at = 0.0
        self._stacks_requested = False
        self._awaiting_dump: set[Worker] = set()
        self._no_dump: set[Worker] = set()
        """Workers asked for their stacks that neither dumped nor exited in time."""
        self._terminate_at: float | None = None
        self._kill_at: float | None = None
        self._kill_reason = ""
        self._killed: set[Worker] = set()
        """Workers the supervisor SIGKILLed: their deaths are never a first failure."""
        self._groups_stopping: set[Worker] = set()
        """Workers whose whole process group was sent SIGTERM."""
        self._next_snapshot = 0.0
        self._reported: dict[int, int] = {}
        self._teardown_done: float | None = None

    # --- the loop -----------------------------------------------------------------------

    def run(self) -> int:
        """Start every worker, watch them to the end, and return the exit code."""
        previous = {sig: signal.signal(sig, self._on_signal) for sig in STOP_SIGNALS}
        try:
            self._start_all()
            while self._watching():
                self._handle(self._next_event())
                self._check_deadlines()
        finally:
            self._kill_everything()  # rule 4
            if self._guardian is not None:
                self._guardian.dismiss()
            for sig, handler in previous.items():
                signal.signal(sig, handler)
        self._drain_output()
        code = self._outcome()
        self._record_exit_codes()
        return code

    def _start_all(self) -> None:
        if self.adopt_orphans:
            reaper.become_subreaper()
        # Every process is spawned before any thread starts: forking while other
        # threads run is what makes preexec_fn unsafe.
        self._guardian = Guardian(self._token, dict(os.environ), str(PROJECT_ROOT))
        for worker in self.workers:
            worker.env[reaper.TOKEN_VAR] = self._token
            try:
                worker.start()
            except OSError as error:
                raise StartError(f"cannot run {worker.argv[0]}: {error.strerror or error}") from None
            self._guardian.add_group(worker.process.pid)
        for worker in self.workers:
            self._watch[worker] = _Watch(last_output=time.monotonic())
            worker.watch(self._events.put)

    def _watching(self) -> bool:
        """A worker is running, or a group told to stop still holds its output before the kill deadline."""
        return bool(self._running() or self._kill_at is not None and self._stopping_groups())

    def _next_event(self) -> Event | Interrupted | None:
        deadlines = [d for d in (self._terminate_at, self._kill_at, self._hang_deadline(), self._next_snapshot)
                     if d is not None]
        timeout = max(0.0, min(deadlines) - time.monotonic()) if deadlines else None
        try:
            return self._events.get(timeout=timeout)
        except queue.Empty:
            return None

    def _handle(self, event: Event | Interrupted | None) -> None:
        match event:
            case Line(worker, text):
                self._on_line(worker, text)
            case OutputClosed(worker):
                self._watch[worker].output_open = False
            case Exited(worker, returncode):
                self._watch[worker].returncode = returncode
                self._dump_done(worker)
                if self._is_first_failure(worker, returncode):
                    self.printer.launcher_line(
                        f"{worker.label} failed ({summary.describe(returncode)}); stopping the other workers")
                    self._fail(worker)
            case Interrupted(signum):
                self._on_interrupt(signum)

    def _is_first_failure(self, worker: Worker, returncode: int) -> bool:
        if returncode == 0 or self._failure is not None or worker in self._killed:
            return False
        return self._interrupted_by is None or returncode not in STOPPED_AS_ASKED  # rules 1 and 3

    def _on_line(self, worker: Worker, text: str) -> None:
        watch = self._watch[worker]
        watch.last_output = time.monotonic()
        watch.tail.append(text)
        watch.cuda_oom = watch.cuda_oom or summary.is_cuda_oom(text)
        watch.nccl_watchdog = watch.nccl_watchdog or summary.nccl_watchdog(text)
        watch.nonfinite_report = watch.nonfinite_report or summary.nonfinite_banner(text)
        if self._stacks_requested and watch.stacks.feed(text):
            self._dump_done(worker)
        self.printer.worker_line(worker.label, text)

    def _on_interrupt(self, signum: int) -> None:
        if self._tearing_down and signum == signal.SIGHUP:
            self.printer.launcher_line("received SIGHUP: already stopping; carrying on")
            return
        if self._tearing_down:
            self.printer.launcher_line("second signal: killing every worker now")
            self._kill_running()
            return
        self._interrupted_by, self._interrupted_at = signum, time.monotonic()
        again = "SIGINT or SIGTERM" if signum == signal.SIGHUP else "again"
        self.printer.launcher_line(
            f"received {signal.Signals(signum).name}: asking the workers to stop gracefully "
            f"(at most {self.stop_timeout:g} s, --stop-timeout; {again} to kill them now)")
        if self.stop_leaders_only:  # rule 3
            for worker in self._running():
                worker.signal(signal.SIGTERM)
        else:
            self._terminate_groups(self._running())
        self._set_kill_deadline(self.stop_timeout, "--stop-timeout")

    def _on_signal(self, signum: int, _frame: object) -> None:
        self._events.put(Interrupted(signum))

    def _check_deadlines(self) -> None:
        now = time.monotonic()
        if now >= self._next_snapshot:
            self._report_processes_to_guardian()
        if self._terminate_at is not None and now >= self._terminate_at:
            self._terminate_running()
        if self._kill_at is not None and now >= self._kill_at:
            running = self._running()
            if running:
                self.printer.launcher_line(
                    f"{', '.join(w.label for w in running)} still running after {self._kill_reason}; "
                    f"sending SIGKILL")
            elif lingering := self._stopping_groups():
                self.printer.launcher_line(
                    f"processes started by {', '.join(w.label for w in lingering)} still running after "
                    f"{self._kill_reason}; sending SIGKILL")
            self._kill_running()
        deadline = self._hang_deadline()
        if deadline is not None and now >= deadline:
            worker = min(self._running(), key=lambda w: self._watch[w].last_output)
            self.printer.launcher_line(
                f"{worker.label} printed nothing for {self.hang_timeout:g} s (--hang-timeout); "
                f"it has failed; stopping every worker")
            self._fail(worker, hung_for=self.hang_timeout)

    @property
    def _tearing_down(self) -> bool:
        return self._failure is not None or self._interrupted_by is not None

    def _hang_deadline(self) -> float | None:
        """When the quietest running worker will have been silent for hang_timeout."""
        running = self._running()
        if self.hang_timeout is None or self._tearing_down or not running:
            return None
        return min(self._watch[w].last_output for w in running) + self.hang_timeout

    # --- teardown -----------------------------------------------------------------------

    def _running(self) -> list[Worker]:
        return [w for w, watch in self._watch.items() if watch.returncode is None]

    def _stopping_groups(self) -> list[Worker]:
        """Exited workers told to stop whose output some process of their group still holds."""
        return [w for w in self._groups_stopping if self._watch[w].returncode is not None and self._watch[w].output_open]

    def _fail(self, worker: Worker, hung_for: float | None = None) -> None:
        """Rules 1 and 2: remember the first failure, ask for stacks, stop the others."""
        running = self._running()
        self._failure = _FirstFailure(worker, time.monotonic(), time.strftime("%H:%M:%S"),
                                      len([w for w in running if w is not worker]), hung_for)
        if hung_for is None and self._watch[worker].returncode in self.agreed_exit_codes and running:
            self._failure.stopped = 0  # so far: they are on their way out too
            self._terminate_at = time.monotonic() + AGREED_EXIT_GRACE
            return
        if self.stack_dump_signal is None or not running:
            self._terminate_running()
            return
        self._stacks_requested = True
        self._awaiting_dump = set(running)
        self._terminate_at = time.monotonic() + STACK_DUMP_MAX_WAIT
        for other in running:
            other.signal(self.stack_dump_signal)

    def _dump_done(self, worker: Worker) -> None:
        """The worker began its stack dump, or exited: once every one has, terminate soon."""
        if worker in self._awaiting_dump:
            self._awaiting_dump.discard(worker)
            if not self._awaiting_dump and self._terminate_at is not None:
                self._terminate_at = min(self._terminate_at, time.monotonic() + STACK_DUMP_SETTLE)

    def _terminate_running(self) -> None:
        self._terminate_at = None
        self._no_dump, self._awaiting_dump = self._awaiting_dump, set()
        failure = self._failure
        if failure is not None and failure.hung_for is not None and self._no_dump:
            # All ranks fall silent when one freezes: the one that cannot even dump its
            # stacks (stopped, stuck in the kernel) is the cause, not the first to go quiet.
            failure.worker = min(self._no_dump, key=lambda w: self._watch[w].last_output)
            failure.unresponsive = True
        if failure is not None:  # those that outlived an agreed exit's grace are stopped now
            failure.stopped = max(failure.stopped, len([w for w in self._running() if w is not failure.worker]))
        self._terminate_groups(self._running())
        self._set_kill_deadline(self.kill_grace, "--kill-grace")

    def _terminate_groups(self, workers: list[Worker]) -> None:
        """SIGTERM, all at once, to these workers' groups and to every other process of the run:
        the descendants that left their worker's group (setsid, double fork) and what is left of
        exited workers' groups. One of those that still holds a worker's output would otherwise
        keep the teardown waiting for the whole deadline, though it ends at once when asked."""
        for worker in workers:
            worker.signal_group(signal.SIGTERM)
            self._groups_stopping.add(worker)
        groups, roots, exclude = self._scope()
        reaper.terminate_run(self._token, groups=groups, roots=roots, exclude=exclude,
                             signalled_groups={w.process.pid for w in workers if w.process is not None})

    def _set_kill_deadline(self, seconds: float, option: str) -> None:
        self._kill_at = time.monotonic() + seconds
        self._kill_reason = f"{seconds:g} s ({option})"

    def _kill_running(self) -> None:
        for worker in self._running():
            self._killed.add(worker)
            worker.signal_group(signal.SIGKILL)
        self._kill_at = None

    def _scope(self) -> tuple[set[int], set[int], set[int]]:
        """(worker groups, roots, excluded pids) for the reaper: what belongs to the run."""
        groups = {w.process.pid for w in self.workers if w.process is not None}
        roots = groups | ({os.getpid()} if self.adopt_orphans else set())  # orphans were re-parented here
        exclude = {self._guardian.pid} if self._guardian is not None else set()
        return groups, roots, exclude

    def _report_processes_to_guardian(self) -> None:
        self._next_snapshot = time.monotonic() + SNAPSHOT_INTERVAL
        if self._guardian is None:
            return
        groups, roots, exclude = self._scope()
        processes = reaper.scan(self._token)
        pids = reaper.members(processes, groups=groups, roots=roots, exclude=exclude)
        new = {p.pid: p.started for p in processes if p.pid in pids and self._reported.get(p.pid) != p.started}
        self._reported.update(new)
        self._guardian.add_processes(new)
        if self.adopt_orphans:  # or adopted orphans that ended pile up as zombies in a long run
            reaper.reap_adopted(processes, keep=roots | exclude)

    def _kill_everything(self) -> None:
        for worker in self.workers:
            worker.signal_group(signal.SIGKILL)
        groups, roots, exclude = self._scope()
        reaper.kill_run(self._token, groups=groups, roots=roots, exclude=exclude)
        if self.adopt_orphans:
            reaper.reap_adopted(reaper.scan(None), keep=roots | exclude)
        for worker in self.workers:
            worker.reap()
        self._teardown_done = time.monotonic()

    def _drain_output(self) -> None:
        """Print what the workers wrote before they exited. Every writer is dead by now,
        so the pipes reach end of file at once; the deadline is only a safety net."""
        deadline = time.monotonic() + OUTPUT_DRAIN_SECONDS
        while any(w.output_open for w in self._watch.values()) and time.monotonic() < deadline:
            try:
                event = self._events.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                break
            if not isinstance(event, Interrupted):
                self._handle(event)

    # --- outcome ------------------------------------------------------------------------

    def _outcome(self) -> int:
        if self._failure is not None:
            failure = self._describe_failure(self._failure)
            self.printer.launcher_line("\n".join(summary.render(failure)))
            return failure.exit_code
        if self._interrupted_by is not None:
            killed = [w.label for w, watch in self._watch.items() if watch.returncode == -signal.SIGKILL]
            took = (self._teardown_done or time.monotonic()) - self._interrupted_at
            self.printer.launcher_line(
                f"stopped: every worker exited within {took:.2f} s of "
                f"{signal.Signals(self._interrupted_by).name}" + (f"; {', '.join(killed)} had to be killed" if killed else ""))
            return 128 + self._interrupted_by
        return 0

    def _describe_failure(self, first: _FirstFailure) -> summary.Failure:
        worker, watch = first.worker, self._watch[first.worker]
        returncode = watch.returncode if watch.returncode is not None else -signal.SIGKILL
        if first.hung_for is not None:
            code, how = EXIT_HANG, f"printed nothing for {first.hung_for:g} s"
            if first.unresponsive:
                how += " and did not answer the stack-dump request (frozen)"
        else:
            code, how = exit_code(returncode), summary.describe(returncode)
            if returncode in self.exit_meanings:
                how += f" ({self.exit_meanings[returncode]})"
        where = {w.label: frames for w, wa in self._watch.items() if (frames := wa.stacks.where())}
        where |= {w.label: NO_DUMP for w in self._no_dump}
        return summary.Failure(
            label=worker.label, rank=worker.rank, after_start=first.at - worker.started_at, clock=first.clock,
            exit_code=code, how=how,
            hint=summary.hint(returncode, hung_for=first.hung_for, cuda_oom=watch.cuda_oom,
                              nccl_watchdog=watch.nccl_watchdog,
                              nonfinite_reports={w.label: wa.nonfinite_report for w, wa in self._watch.items()
                                                 if wa.nonfinite_report and returncode in self.agreed_exit_codes}),
            tail=list(watch.tail), stopped=first.stopped,
            teardown_seconds=(self._teardown_done or time.monotonic()) - first.at, where=where,
            logs=self.run_dir / "logs" if self.run_dir is not None else None)

    def _record_exit_codes(self) -> None:
        """workers.json; a failure to write it (a full disk) is reported, not raised, so
        the exit code and the summary survive it."""
        if self.run_dir is None:
            return
        failed = self._failure.worker if self._failure is not None else None
        record = []
        for worker in self.workers:
            returncode = self._watch[worker].returncode if worker in self._watch else None
            record.append({
                "rank": worker.rank, "label": worker.label,
                "pid": worker.process.pid if worker.process else None,
                "returncode": returncode,
                "exit_code": exit_code(returncode) if returncode is not None else None,
                "failed_first": worker is failed,
                "hung": worker is failed and self._failure.hung_for is not None})
        try:
            atomic_write_text(self.run_dir / "workers.json", json.dumps(record, indent=2) + "\n")
        except OSError as error:
            self.printer.launcher_line(f"warning: could not record exit codes: {os_error_message(error)}")
