"""The lifetime of a group of workers: one loop over typed events.

Teardown rules (each has a test in tests/test_supervisor.py or tests/test_launcher_cli.py):
1. The first worker to fail decides the outcome: the supervisor returns its exit code (a
   death by signal n returns by_signal(n), launcher/exit_codes.py). A worker that
   prints nothing for hang_timeout seconds has failed, with exit code 124. Success means every worker exited 0.
   A failure that another worker's caused (consequence_exit_codes: it lost the connection to
   a rank that failed) decides nothing while another worker runs that may report the cause:
   the supervisor waits up to cause_wait seconds for another worker to fail otherwise, and
   that worker failed first, however the exits were timed. A worker that exited 0 before the
   consequence did is the cause (it left; the run returns the consequence's code). Only when no
   cause comes (the others exited, or the wait ran out) is the first consequence reported, naming
   the workers still running then. A stop signal the launcher did not send, to one training rank,
   stops every rank at the same step: the summary names the rank it came to (its stop line says so).
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
5. In a job of several nodes (launcher/nodes/rendezvous.py), this node's first failure is told to the
   other nodes, and another node's word that the job stops (its worker failed first, or a node
   was lost) stops this node's workers as in rule 2, without the stack dump: the cause is
   elsewhere. The first word across the nodes decides: a failure here that follows another
   node's is a consequence, and the supervisor returns launcher/exit_codes.py's code for the other
   node's (75: it failed; 76: it was lost), unless both are the same agreed exit code.
   A node asked to stop gracefully (rule 3) tells the others, and they stop the same way:
   every rank finishes the same step and saves, and every node returns that signal's exit code.
"""

from __future__ import annotations

import queue
import re
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass

from launcher.supervise import outcome, restarts, summary
from launcher.rundir import lock
from launcher.nodes.node import NodeInterrupt, NodeStop, Peers
from launcher.supervise.options import SupervisorOptions
from launcher.exit_codes import EXIT_HANG, by_signal
from launcher.supervise.outcome import FirstFailure, Watch, exit_code
from launcher.supervise.printer import CONSOLE_CLOSED, CONSOLE_CLOSED_SIGNAL, LOG_ONLY_MARK, LOG_ONLY_VAR, Printer, is_log_only
from launcher.processes.run_processes import RunProcesses
from launcher.processes.worker import Event, Exited, Line, OutputClosed, StartError, Worker

__all__ = ["StartError", "Supervisor", "SupervisorOptions", "exit_code"]

OUTPUT_DRAIN_SECONDS = 1.0  # after teardown, wait at most this long for the rest of the output
# SIGTERM right after the stack-dump signal would kill a worker before it dumps (a default
# SIGTERM is fatal at once), so it waits until every worker has begun its dump and a little
# longer for the rest of it, or at most the first delay.
STACK_DUMP_MAX_WAIT = 0.3
AGREED_EXIT_GRACE = 5.0
STACK_DUMP_SETTLE = 0.03
SNAPSHOT_INTERVAL = 0.5  # how often the guardian learns the run's processes (one /proc pass)
# How a worker ends when asked to stop: 0, or by (or after handling) SIGTERM.
STOPPED_AS_ASKED = {0, -signal.SIGTERM, by_signal(signal.SIGTERM)}
# What asks the supervisor to stop gracefully (rule 3): Ctrl-C, a scheduler, a closed terminal.
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


@dataclass(frozen=True)
class Interrupted:
    """The supervisor itself received one of STOP_SIGNALS."""

    signum: int


@dataclass(frozen=True)
class Said:
    """A line another thread of the launcher has for the console (the GPU health watch)."""

    text: str


Incoming = Event | Interrupted | NodeStop | NodeInterrupt | Said
"""What the loop handles: a worker's line or exit, a signal, another node's word, a line to print."""
STRAGGLER = re.compile(r"\bstraggler: (\S+) ")
"""The trainer's straggler line (pretrain/observe/stragglers.py), which names the slow rank's label."""


class Supervisor:
    def __init__(
        self, workers: list[Worker], printer: Printer, options: SupervisorOptions | None = None, peers: Peers | None = None
    ) -> None:
        """peers: the other nodes of a job of several (rule 5); None on one machine."""
        self.workers = workers
        self.peers = peers
        self.printer = printer
        self.options = options or SupervisorOptions()
        self._processes = RunProcesses(workers, self.options.adopt_orphans)
        self._events: queue.SimpleQueue[Incoming] = queue.SimpleQueue()  # put() is signal-safe
        self._watch: dict[Worker, Watch] = {}
        self._failure: FirstFailure | None = None
        self._remote: NodeStop | None = None
        """Another node's word that the job stops, when it came first (rule 5)."""
        self._remote_at = 0.0
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
        self._teardown_done: float | None = None
        self._awaiting_cause: list[Worker] = []
        """Workers that exited with a consequence code before any other failure (rule 1)."""
        self._cause_deadline: float | None = None
        self._described: summary.Failure | None = None
        """The first failure as the summary told it, once the run is over."""
        self.on_started: Callable[[], object] = lambda: None
        """Called once every worker is spawned: where a helper thread may start (forking while
        another thread runs is what makes the workers' preexec_fn unsafe)."""
        self.clocks_of: Callable[[str], str | None] = lambda label: None
        """What slows a worker's GPU down now (clock reasons), by its label, for the straggler line."""

    def say(self, text: str) -> None:
        """Print a launcher line from another thread: the loop prints it, between the workers' lines."""
        self._events.put(Said(text))

    # --- the loop -----------------------------------------------------------------------

    def run(self) -> int:
        """Start every worker, watch them to the end, and return the exit code."""
        previous = {sig: signal.signal(sig, self._on_signal) for sig in STOP_SIGNALS}
        # The console's reader went away (`| head`): a graceful stop, as on SIGHUP (rule 3).
        self.printer.on_console_closed = lambda: self._events.put(Interrupted(CONSOLE_CLOSED_SIGNAL))
        try:
            self._start_all()
            self.on_started()
            while self._watching():
                self._handle(self._next_event())
                self._check_deadlines()
        finally:
            self._processes.kill_all()  # rule 4
            self._teardown_done = time.monotonic()
            self._processes.dismiss_guardian()
            for sig, handler in previous.items():
                signal.signal(sig, handler)
        self._drain_output()
        code = self._outcome()
        self._record_exit_codes()
        return code

    def _start_all(self) -> None:
        # Every process is spawned before any thread starts: forking while other
        # threads run is what makes preexec_fn unsafe.
        self._processes.start_guardian()
        for worker in self.workers:
            worker.env[LOG_ONLY_VAR] = LOG_ONLY_MARK  # the printer keeps such lines off the console
            worker.env[restarts.PROGRESS_VAR] = restarts.PROGRESS_MARK  # the step it reached, for the restart rules
            try:
                self._processes.start(worker)
            except OSError as error:
                raise StartError(worker.argv[0], error, worker.label) from None  # 126 or 127, as a shell says
        for worker in self.workers:
            self._watch[worker] = Watch(last_output=time.monotonic())
            worker.watch(self._events.put)
        if self.peers is not None:
            self.peers.on_stop(self._events.put)

    def _watching(self) -> bool:
        """A worker is running, or a group told to stop still holds its output before the kill deadline."""
        return bool(self._running() or self._kill_at is not None and self._stopping_groups())

    def _next_event(self) -> Incoming | None:
        deadlines = [
            d
            for d in (self._terminate_at, self._kill_at, self._hang_deadline(), self._next_snapshot, self._cause_deadline)
            if d is not None
        ]
        timeout = max(0.0, min(deadlines) - time.monotonic()) if deadlines else None
        try:
            return self._events.get(timeout=timeout)
        except queue.Empty:
            return None

    def _handle(self, event: Incoming | None) -> None:
        match event:
            case Line(worker, text):
                self._on_line(worker, text)
            case OutputClosed(worker):
                self._watch[worker].output_open = False
            case Exited(worker, returncode):
                self._watch[worker].returncode, self._watch[worker].exited_at = returncode, time.monotonic()
                self._dump_done(worker)
                if self._stopped_with_another_node(returncode):
                    pass
                elif self._is_first_failure(worker, returncode):
                    self._on_failure(worker, returncode)
                self._settle_consequences()
            case Interrupted(signum):
                self._on_interrupt(signum)
            case NodeStop():
                self._on_node_stop(event)
            case Said(text):
                self.printer.launcher_line(text)
            case NodeInterrupt(node, signum) if not self._tearing_down:
                self.printer.launcher_line(f"node {node} was asked to stop ({signal.Signals(signum).name}); so is this node")
                self._on_interrupt(signum, told=False)
            case NodeInterrupt() if self._interrupted_by is None:  # another node's, in a failure's teardown: no restart
                self._kill_running()

    def _is_first_failure(self, worker: Worker, returncode: int) -> bool:
        if returncode == 0 or self._failure is not None or self._remote is not None or worker in self._killed:
            return False
        return self._interrupted_by is None or returncode not in STOPPED_AS_ASKED  # rules 1 and 3

    def _on_failure(self, worker: Worker, returncode: int) -> None:
        """Rule 1: a worker failed, and none before it. A consequence (it lost the connection to a
        rank) waits for the cause; any other failure is the first."""
        if returncode not in self.options.consequence_exit_codes:
            self.printer.launcher_line(summary.first_failure_line(worker.label, returncode, self.options.stop_exit_codes))
            self._fail(worker)
            return
        self._awaiting_cause.append(worker)
        if self._cause_deadline is None and self._running():
            self._cause_deadline = time.monotonic() + self.options.cause_wait
            self.printer.launcher_line(
                f"{worker.label} failed as a consequence of another worker's failure ({summary.describe(returncode)}); "
                f"waiting up to {self.options.cause_wait:g} s for that failure"
            )

    def _settle_consequences(self) -> None:
        """Rule 1: once no cause can come (no other worker runs, or the wait is over), the first
        consequence is the first failure."""
        if self._failure is not None or self._remote is not None:
            self._cause_deadline = None  # a cause came, or another node's word
            return
        if not self._awaiting_cause:
            return
        running, first = self._running(), self._awaiting_cause[0]
        left = outcome.ended_early(self._watch, first)  # a worker that exited 0 first: the one it lost
        if left is None and running and self._cause_deadline is not None and time.monotonic() < self._cause_deadline:
            return
        self._cause_deadline = None
        if left is not None:
            lost = f"{first.label} lost it ({summary.describe(self._watch[first].returncode or 0)})"
            self.printer.launcher_line(f"{left.label} exited 0 before the run ended; {lost}; stopping the other workers")
            self._fail(left, at=self._watch[left].exited_at)
            assert self._failure is not None
            self._failure.lost_by = first
            return
        self.printer.launcher_line(
            f"{first.label} failed ({summary.describe(self._watch[first].returncode or 0)}) and no other worker "
            f"failed {f'within {self.options.cause_wait:g} s' if running else 'otherwise'}; stopping the other workers"
        )
        self._fail(first, at=self._watch[first].exited_at)
        assert self._failure is not None
        self._failure.cause_awaited = self.options.cause_wait
        self._failure.still_running = [f"{w.label} (rank {w.rank})" for w in running]

    def _on_line(self, worker: Worker, text: str) -> None:
        watch = self._watch[worker]
        if watch.progress(text):  # the step it reached: for the restart rules, written nowhere
            return
        in_dump = False
        if self._stacks_requested:
            if watch.stacks.feed(text):
                self._dump_done(worker)
            # Rule 2's stack dumps go to the logs only: the summary says where each worker was, and
            # on the console a hundred lines per rank would bury the line of the one that failed.
            in_dump = watch.stacks.took_line
        watch.see(text, time.monotonic(), log_only=in_dump or is_log_only(text))
        if (slow := STRAGGLER.search(text)) and (clocks := self.clocks_of(slow[1])):
            text += f"; clocks: {clocks}"  # what NVML says slows that GPU down
        self.printer.worker_line(worker.label, LOG_ONLY_MARK + text if in_dump else text)

    def _stopped_with_another_node(self, returncode: int) -> bool:
        """Rule 5: a worker that stopped as asked (143) while this node was not asked: another
        node was, and its workers agreed with this node's on the step to stop at (the word
        through the store may come a moment after)."""
        if self.peers is None or self._tearing_down or returncode not in STOPPED_AS_ASKED or returncode == 0:
            return False
        interrupt = self.peers.interrupted()
        if interrupt is None:
            return False
        self._handle(interrupt)
        return True

    def _on_interrupt(self, signum: int, told: bool = True) -> None:
        """Rule 3; told: this node's own signal, which the other nodes are told of (rule 5)."""
        if self._tearing_down and self._interrupted_by is None and told and self.peers is not None:
            self.peers.report_interrupt(signum)  # in a failure's teardown: no restart (launcher/nodes/restart_rounds.py)
        if self._tearing_down and signum == signal.SIGHUP:
            self.printer.launcher_line("received SIGHUP: already stopping; carrying on")
            return
        if self._tearing_down:
            self.printer.launcher_line("second signal: killing every worker now")
            self._kill_running()
            return
        self._interrupted_by, self._interrupted_at = signum, time.monotonic()
        if told and self.peers is not None:
            self.peers.report_interrupt(signum)
        again = "SIGINT or SIGTERM" if signum in (signal.SIGHUP, CONSOLE_CLOSED_SIGNAL) else "again"
        cause = CONSOLE_CLOSED if signum == CONSOLE_CLOSED_SIGNAL else f"received {signal.Signals(signum).name}"
        self.printer.launcher_line(
            f"{cause}: asking the workers to stop gracefully "
            f"(at most {self.options.stop_timeout:g} s, --stop-timeout; {again} to kill them now)"
        )
        if self.options.stop_leaders_only:  # rule 3
            for worker in self._running():
                worker.signal(signal.SIGTERM)
        else:
            self._terminate_groups(self._running())
        self._set_kill_deadline(self.options.stop_timeout, "--stop-timeout")

    def _on_signal(self, signum: int, _frame: object) -> None:
        self._events.put(Interrupted(signum))

    def _check_deadlines(self) -> None:
        self._settle_consequences()
        now = time.monotonic()
        if now >= self._next_snapshot:
            self._next_snapshot = now + SNAPSHOT_INTERVAL
            self._processes.report_to_guardian()
            lock.check_held(self.options.run_dir)  # gone or replaced: RunDirLost ends the loop, rule 4 kills
        if self._terminate_at is not None and now >= self._terminate_at:
            self._terminate_running()
        if self._kill_at is not None and now >= self._kill_at:
            running = self._running()
            if running:
                self.printer.launcher_line(
                    f"{', '.join(w.label for w in running)} still running after {self._kill_reason}; sending SIGKILL"
                )
            elif lingering := self._stopping_groups():
                self.printer.launcher_line(
                    f"processes started by {', '.join(w.label for w in lingering)} still running after "
                    f"{self._kill_reason}; sending SIGKILL"
                )
            self._kill_running()
        deadline = self._hang_deadline()
        if deadline is not None and now >= deadline:
            worker = min(self._running(), key=lambda w: self._watch[w].last_output)
            self.printer.launcher_line(
                f"{worker.label} printed nothing for {self.options.hang_timeout:g} s (--hang-timeout); "
                f"it has failed; stopping every worker"
            )
            self._fail(worker, hung_for=self.options.hang_timeout)

    @property
    def _tearing_down(self) -> bool:
        return self._failure is not None or self._interrupted_by is not None or self._remote is not None

    def _hang_deadline(self) -> float | None:
        """When the quietest running worker will have been silent for hang_timeout."""
        running = self._running()
        if self.options.hang_timeout is None or self._tearing_down or not running:
            return None
        return min(self._watch[w].last_output for w in running) + self.options.hang_timeout

    # --- teardown -----------------------------------------------------------------------

    def _running(self) -> list[Worker]:
        return [w for w, watch in self._watch.items() if watch.returncode is None]

    def _stopping_groups(self) -> list[Worker]:
        """Exited workers told to stop whose output some process of their group still holds."""
        return [w for w in self._groups_stopping if self._watch[w].returncode is not None and self._watch[w].output_open]

    def _fail(self, worker: Worker, hung_for: float | None = None, at: float | None = None) -> None:
        """Rules 1 and 2: remember the first failure, ask for stacks, stop the others. at: when it
        failed, if before now (a consequence reported after the wait for its cause)."""
        running = self._running()
        now = time.monotonic()
        at = now if at is None else at
        clock = time.strftime("%H:%M:%S", time.localtime(time.time() - (now - at)))
        self._failure = FirstFailure(worker, at, clock, len([w for w in running if w is not worker]), hung_for)
        self._tell_peers(worker, hung_for)
        if hung_for is None and self._watch[worker].returncode in self.options.agreed_exit_codes and running:
            self._failure.stopped = 0  # so far: they are on their way out too
            self._terminate_at = time.monotonic() + AGREED_EXIT_GRACE
            return
        if self.options.stack_dump_signal is None or not running:
            self._terminate_running()
            return
        self._stacks_requested = True
        self._awaiting_dump = set(running)
        self._terminate_at = time.monotonic() + STACK_DUMP_MAX_WAIT
        for other in running:
            other.signal(self.options.stack_dump_signal)

    def _tell_peers(self, worker: Worker, hung_for: float | None) -> None:
        """Rule 5: this node's first failure stops the other nodes, unless another node's came first."""
        if self.peers is None:
            return
        returncode = self._watch[worker].returncode
        if hung_for is not None or returncode is None:
            code, how = EXIT_HANG, f"printed nothing for {hung_for or 0:g} s"
        else:
            code, how = exit_code(returncode), summary.describe(returncode)
        earlier = self.peers.report_failure(worker.label, worker.rank, code, how)
        same_agreed = earlier is not None and earlier.exit_code == code and code in self.options.agreed_exit_codes
        if earlier is not None and not same_agreed:
            self._remote, self._remote_at = earlier, time.monotonic()
            self.printer.launcher_line(f"{earlier.describe()}; {worker.label}'s failure here followed it")
        elif earlier is None:
            self.printer.launcher_line("told the other nodes to stop")

    def _on_node_stop(self, stop: NodeStop) -> None:
        """Rule 5: another node stopped the job; stop this node's workers (no stack dump: the
        cause is elsewhere)."""
        if self._remote is not None or self._failure is not None:
            return  # this node's own failure came first, or the word is in already
        self._remote, self._remote_at = stop, time.monotonic()
        running = self._running()
        self.printer.launcher_line(f"{stop.describe()}; stopping this node's {len(running)} worker(s)")
        if running:
            self._terminate_at = None
            self._terminate_groups(running)
            self._set_kill_deadline(self.options.kill_grace, "--kill-grace")

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
        self._set_kill_deadline(self.options.kill_grace, "--kill-grace")

    def _terminate_groups(self, workers: list[Worker]) -> None:
        """SIGTERM, all at once, to these workers' groups and to every other process of the run:
        the descendants that left their worker's group (setsid, double fork) and what is left of
        exited workers' groups. One of those that still holds a worker's output would otherwise
        keep the teardown waiting for the whole deadline, though it ends at once when asked."""
        for worker in workers:
            worker.signal_group(signal.SIGTERM)
            self._groups_stopping.add(worker)
        self._processes.terminate(workers)

    def _set_kill_deadline(self, seconds: float, option: str) -> None:
        self._kill_at = time.monotonic() + seconds
        self._kill_reason = f"{seconds:g} s ({option})"

    def _kill_running(self) -> None:
        for worker in self._running():
            self._killed.add(worker)
            worker.signal_group(signal.SIGKILL)
        self._kill_at = None

    def _drain_output(self) -> None:
        """Print what the workers wrote before they exited. Every writer is dead by now,
        so the pipes reach end of file at once; the deadline is only a safety net."""
        deadline = time.monotonic() + OUTPUT_DRAIN_SECONDS
        while any(w.output_open for w in self._watch.values()) and time.monotonic() < deadline:
            try:
                event = self._events.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                break
            self._after_the_end(event)
        while not self._events.empty():  # a stop signal after the loop still stops a restart (below)
            self._after_the_end(self._events.get())

    def _after_the_end(self, event: Incoming) -> None:
        """The workers are gone: nothing to stop; a stop signal in a failure's teardown is said (_on_interrupt)."""
        if isinstance(event, Interrupted) and self._tearing_down:
            self._on_interrupt(event.signum)
        elif not isinstance(event, Interrupted | NodeStop | NodeInterrupt):
            self._handle(event)

    # --- outcome ------------------------------------------------------------------------

    def _ending(self) -> outcome.Ending:
        return outcome.Ending(
            self._watch,
            self._failure,
            self._no_dump,
            self._teardown_done or time.monotonic(),
            self.options.exit_meanings,
            self.options.agreed_exit_codes,
            self.options.logs_dir or (self.options.run_dir / "logs" if self.options.run_dir is not None else None),
            consequence_exit_codes=self.options.consequence_exit_codes,
            stop_exit_codes=self.options.stop_exit_codes,
        )

    def _outcome(self) -> int:
        """Print the summary of a failure, or the line of a graceful stop; return the exit code."""
        if self._remote is not None:
            return self._remote_outcome(self._remote)
        if self._failure is not None:
            failure = self._described = outcome.describe_failure(self._ending(), self._failure)
            self.printer.launcher_line("\n".join(summary.render(failure)))
            return failure.exit_code
        if self._interrupted_by is not None:
            self.printer.launcher_line(outcome.stopped_line(self._ending(), self._interrupted_by, self._interrupted_at))
            return by_signal(self._interrupted_by)
        return 0

    def failed_at(self) -> float | None:
        """When the first failure came (wall clock; for the goodput ledger), None if none did."""
        return None if self._failure is None else time.time() - (time.monotonic() - self._failure.at)

    def attempt_end(self, code: int) -> restarts.AttemptEnd:
        """What the run that returned code came to, as the restart rules read it (after run())."""
        return outcome.attempt_end(code, self._ending(), self._described, self._remote, self._interrupted_by is not None)

    def _remote_outcome(self, stop: NodeStop) -> int:
        """The account of a stop that began on another node (rule 5); its code."""
        took = (self._teardown_done or time.monotonic()) - self._remote_at
        self.printer.launcher_line("\n".join(outcome.remote_account(self._ending(), stop, self._awaiting_cause, took)))
        return stop.our_exit_code

    def _record_exit_codes(self) -> None:
        """workers.json, then the run's last line: where its files are."""
        run_dir = self.options.run_dir
        if run_dir is None:
            return
        lock.check_held(run_dir)  # writing workers.json would recreate a run directory deleted meanwhile
        if warning := outcome.write_exit_record(
            run_dir, outcome.exit_record(self.workers, self._ending()), self.options.exit_record
        ):
            self.printer.launcher_line(warning)
        self.printer.console_line(f"run directory: {run_dir}")
