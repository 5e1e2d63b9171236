"""The lifetime of a group of workers: one loop over typed events.

Teardown rules (each has a test in tests/launcher/supervise/test_supervisor.py or tests/launcher/test_launcher_cli.py):
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
from launcher.supervise.run_state import RunState
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
        self._state = RunState(self._processes, self.options)
        self._next_snapshot = 0.0
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
            while self._state.watching():
                self._handle(self._next_event())
                self._check_deadlines()
        finally:
            self._processes.kill_all()  # rule 4
            self._state.teardown_done = time.monotonic()
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
            self._state.watch[worker] = Watch(last_output=time.monotonic())
            worker.watch(self._events.put)
        if self.peers is not None:
            self.peers.on_stop(self._events.put)

    def _next_event(self) -> Incoming | None:
        deadlines = [*self._state.deadlines(), self._next_snapshot]
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
                self._state.watch[worker].output_open = False
            case Exited(worker, returncode):
                self._state.exited(worker, returncode)
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
            case NodeInterrupt(node, signum) if not self._state.tearing_down:
                self.printer.launcher_line(f"node {node} was asked to stop ({signal.Signals(signum).name}); so is this node")
                self._on_interrupt(signum, told=False)
            case NodeInterrupt() if self._state.interrupted_by is None:  # another node's, in a failure's teardown: no restart
                self._state.kill_running()

    def _is_first_failure(self, worker: Worker, returncode: int) -> bool:
        if returncode == 0 or self._state.failure is not None or self._state.remote is not None or worker in self._state.killed:
            return False
        return self._state.interrupted_by is None or returncode not in STOPPED_AS_ASKED  # rules 1 and 3

    def _on_failure(self, worker: Worker, returncode: int) -> None:
        """Rule 1: a worker failed, and none before it. A consequence (it lost the connection to a
        rank) waits for the cause; any other failure is the first."""
        if returncode not in self.options.consequence_exit_codes:
            self.printer.launcher_line(summary.first_failure_line(worker.label, returncode, self.options.stop_exit_codes))
            self._fail(worker)
            return
        self._state.awaiting_cause.append(worker)
        if self._state.cause_deadline is None and self._state.running():
            self._state.cause_deadline = time.monotonic() + self.options.cause_wait
            self.printer.launcher_line(
                f"{worker.label} failed as a consequence of another worker's failure ({summary.describe(returncode)}); "
                f"waiting up to {self.options.cause_wait:g} s for that failure"
            )

    def _settle_consequences(self) -> None:
        """Rule 1: once no cause can come (no other worker runs, or the wait is over), the first
        consequence is the first failure."""
        if self._state.failure is not None or self._state.remote is not None:
            self._state.cause_deadline = None  # a cause came, or another node's word
            return
        if not self._state.awaiting_cause:
            return
        running, first = self._state.running(), self._state.awaiting_cause[0]
        left = outcome.ended_early(self._state.watch, first)  # a worker that exited 0 first: the one it lost
        if left is None and running and self._state.cause_deadline is not None and time.monotonic() < self._state.cause_deadline:
            return
        self._state.cause_deadline = None
        if left is not None:
            lost = f"{first.label} lost it ({summary.describe(self._state.watch[first].returncode or 0)})"
            self.printer.launcher_line(f"{left.label} exited 0 before the run ended; {lost}; stopping the other workers")
            self._fail(left, at=self._state.watch[left].exited_at)
            assert self._state.failure is not None
            self._state.failure.lost_by = first
            return
        self.printer.launcher_line(
            f"{first.label} failed ({summary.describe(self._state.watch[first].returncode or 0)}) and no other worker "
            f"failed {f'within {self.options.cause_wait:g} s' if running else 'otherwise'}; stopping the other workers"
        )
        self._fail(first, at=self._state.watch[first].exited_at)
        assert self._state.failure is not None
        self._state.failure.cause_awaited = self.options.cause_wait
        self._state.failure.still_running = [f"{w.label} (rank {w.rank})" for w in running]

    def _on_line(self, worker: Worker, text: str) -> None:
        watch = self._state.watch[worker]
        if watch.progress(text):  # the step it reached: for the restart rules, written nowhere
            return
        in_dump = False
        if self._state.stacks_requested:
            if watch.stacks.feed(text):
                self._state.dump_done(worker)
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
        if self.peers is None or self._state.tearing_down or returncode not in STOPPED_AS_ASKED or returncode == 0:
            return False
        interrupt = self.peers.interrupted()
        if interrupt is None:
            return False
        self._handle(interrupt)
        return True

    def _on_interrupt(self, signum: int, told: bool = True) -> None:
        """Rule 3; told: this node's own signal, which the other nodes are told of (rule 5)."""
        if self._state.tearing_down and self._state.interrupted_by is None and told and self.peers is not None:
            self.peers.report_interrupt(signum)  # in a failure's teardown: no restart (launcher/nodes/restart_rounds.py)
        if self._state.tearing_down and signum == signal.SIGHUP:
            self.printer.launcher_line("received SIGHUP: already stopping; carrying on")
            return
        if self._state.tearing_down:
            first = self._state.interrupted_by is None  # a failure's teardown, not a stop asked for before
            said = f"received {signal.Signals(signum).name} while stopping" if first else "second signal"
            self.printer.launcher_line(f"{said}: killing every worker now")
            self._state.kill_running()
            return
        self._state.interrupted_by, self._state.interrupted_at = signum, time.monotonic()
        if told and self.peers is not None:
            self.peers.report_interrupt(signum)
        again = "SIGINT or SIGTERM" if signum in (signal.SIGHUP, CONSOLE_CLOSED_SIGNAL) else "again"
        cause = CONSOLE_CLOSED if signum == CONSOLE_CLOSED_SIGNAL else f"received {signal.Signals(signum).name}"
        self.printer.launcher_line(
            f"{cause}: asking the workers to stop gracefully "
            f"(at most {self.options.stop_timeout:g} s, --stop-timeout; {again} to kill them now)"
        )
        if self.options.stop_leaders_only:  # rule 3
            for worker in self._state.running():
                worker.signal(signal.SIGTERM)
        else:
            self._state.terminate_groups(self._state.running())
        self._state.set_kill_deadline(self.options.stop_timeout, "--stop-timeout")

    def _on_signal(self, signum: int, _frame: object) -> None:
        self._events.put(Interrupted(signum))

    def _check_deadlines(self) -> None:
        self._settle_consequences()
        now = time.monotonic()
        if now >= self._next_snapshot:
            self._next_snapshot = now + SNAPSHOT_INTERVAL
            self._processes.report_to_guardian()
            lock.check_held(self.options.run_dir)  # gone or replaced: RunDirLost ends the loop, rule 4 kills
        if self._state.terminate_at is not None and now >= self._state.terminate_at:
            self._state.terminate_running()
        if self._state.kill_at is not None and now >= self._state.kill_at:
            if line := self._state.still_running_line():
                self.printer.launcher_line(line)
            self._state.kill_running()
        deadline = self._state.hang_deadline()
        if deadline is not None and now >= deadline:
            worker = min(self._state.running(), key=lambda w: self._state.watch[w].last_output)
            self.printer.launcher_line(
                f"{worker.label} printed nothing for {self.options.hang_timeout:g} s (--hang-timeout); "
                f"it has failed; stopping every worker"
            )
            self._fail(worker, hung_for=self.options.hang_timeout)

    # --- teardown -----------------------------------------------------------------------

    def _fail(self, worker: Worker, hung_for: float | None = None, at: float | None = None) -> None:
        """Rules 1 and 2: remember the first failure, ask for stacks, stop the others. at: when it
        failed, if before now (a consequence reported after the wait for its cause)."""
        running = self._state.running()
        now = time.monotonic()
        at = now if at is None else at
        clock = time.strftime("%H:%M:%S", time.localtime(time.time() - (now - at)))
        self._state.failure = FirstFailure(worker, at, clock, len([w for w in running if w is not worker]), hung_for)
        self._tell_peers(worker, hung_for)
        if hung_for is None and self._state.watch[worker].returncode in self.options.agreed_exit_codes and running:
            self._state.failure.stopped = 0  # so far: they are on their way out too
            self._state.terminate_at = time.monotonic() + AGREED_EXIT_GRACE
            return
        if self.options.stack_dump_signal is None or not running:
            self._state.terminate_running()
            return
        self._state.request_stacks(running, self.options.stack_dump_signal, STACK_DUMP_MAX_WAIT)

    def _tell_peers(self, worker: Worker, hung_for: float | None) -> None:
        """Rule 5: this node's first failure stops the other nodes, unless another node's came first."""
        if self.peers is None:
            return
        returncode = self._state.watch[worker].returncode
        if hung_for is not None or returncode is None:
            code, how = EXIT_HANG, f"printed nothing for {hung_for or 0:g} s"
        else:
            code, how = exit_code(returncode), summary.describe(returncode)
        earlier = self.peers.report_failure(worker.label, worker.rank, code, how)
        same_agreed = earlier is not None and earlier.exit_code == code and code in self.options.agreed_exit_codes
        if earlier is not None and not same_agreed:
            self._state.remote, self._state.remote_at = earlier, time.monotonic()
            self.printer.launcher_line(f"{earlier.describe()}; {worker.label}'s failure here followed it")
        elif earlier is None:
            self.printer.launcher_line("told the other nodes to stop")

    def _on_node_stop(self, stop: NodeStop) -> None:
        """Rule 5: another node stopped the job; stop this node's workers (no stack dump: the
        cause is elsewhere)."""
        if self._state.remote is not None or self._state.failure is not None:
            return  # this node's own failure came first, or the word is in already
        self._state.remote, self._state.remote_at = stop, time.monotonic()
        running = self._state.running()
        self.printer.launcher_line(f"{stop.describe()}; stopping this node's {len(running)} worker(s)")
        if running:
            self._state.terminate_at = None
            self._state.terminate_groups(running)
            self._state.set_kill_deadline(self.options.kill_grace, "--kill-grace")

    def _drain_output(self) -> None:
        """Print what the workers wrote before they exited. Every writer is dead by now,
        so the pipes reach end of file at once; the deadline is only a safety net."""
        deadline = time.monotonic() + OUTPUT_DRAIN_SECONDS
        while any(w.output_open for w in self._state.watch.values()) and time.monotonic() < deadline:
            try:
                event = self._events.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                break
            self._after_the_end(event)
        while not self._events.empty():  # a stop signal after the loop still stops a restart (below)
            self._after_the_end(self._events.get())

    def _after_the_end(self, event: Incoming) -> None:
        """The workers are gone: nothing to stop; a stop signal in a failure's teardown is said (_on_interrupt)."""
        if isinstance(event, Interrupted) and self._state.tearing_down:
            self._on_interrupt(event.signum)
        elif not isinstance(event, Interrupted | NodeStop | NodeInterrupt):
            self._handle(event)

    # --- outcome ------------------------------------------------------------------------

    def _outcome(self) -> int:
        """Print the summary of a failure, or the line of a graceful stop; return the exit code."""
        code, said, self._described = self._state.conclusion()
        if said is not None:
            self.printer.launcher_line(said)
        return code

    def failed_at(self) -> float | None:
        """When the first failure came (wall clock; for the goodput ledger), None if none did."""
        return None if self._state.failure is None else time.time() - (time.monotonic() - self._state.failure.at)

    def attempt_end(self, code: int) -> restarts.AttemptEnd:
        """What the run that returned code came to, as the restart rules read it (after run())."""
        return outcome.attempt_end(
            code, self._state.ending(), self._described, self._state.remote, self._state.interrupted_by is not None
        )

    def _record_exit_codes(self) -> None:
        """workers.json, then the run's last line: where its files are."""
        run_dir = self.options.run_dir
        if run_dir is None:
            return
        lock.check_held(run_dir)  # writing workers.json would recreate a run directory deleted meanwhile
        if warning := outcome.write_exit_record(
            run_dir, outcome.exit_record(self.workers, self._state.ending()), self.options.exit_record
        ):
            self.printer.launcher_line(warning)
        self.printer.console_line(f"run directory: {run_dir}")
