"""What the supervisor's loop (launcher/supervise/supervisor.py) knows of a run while it lasts, and
the teardown's signals that change it: each worker's Watch, what started the teardown (this node's
first failure, another node's word, a stop signal), the wait for a consequence's cause, the stack
dumps awaited, the SIGTERM and SIGKILL deadlines (rules 2 to 4), and, once the loop is over, the
Ending that launcher/supervise/outcome.py reads. The loop decides; this keeps the record."""

from __future__ import annotations

import signal
import time

from launcher.nodes.node import NodeStop
from launcher.processes.run_processes import RunProcesses
from launcher.processes.worker import Worker
from launcher.exit_codes import by_signal
from launcher.supervise import outcome, summary
from launcher.supervise.options import SupervisorOptions
from launcher.supervise.outcome import FirstFailure, Watch

STACK_DUMP_SETTLE = 0.03
"""Once every worker asked for its stacks has begun its dump (or exited), SIGTERM comes this much later."""


class RunState:
    """One run's record, which the supervisor's loop alone reads and changes (one thread)."""

    def __init__(self, processes: RunProcesses, options: SupervisorOptions) -> None:
        self.processes = processes
        self.options = options
        self.watch: dict[Worker, Watch] = {}
        self.failure: FirstFailure | None = None
        self.remote: NodeStop | None = None
        """Another node's word that the job stops, when it came first (rule 5)."""
        self.remote_at = 0.0
        self.interrupted_by: int | None = None
        self.interrupted_at = 0.0
        self.stacks_requested = False
        self.awaiting_dump: set[Worker] = set()
        self.no_dump: set[Worker] = set()
        """Workers asked for their stacks that neither dumped nor exited in time."""
        self.terminate_at: float | None = None
        self.kill_at: float | None = None
        self.kill_reason = ""
        self.killed: set[Worker] = set()
        """Workers the supervisor SIGKILLed: their deaths are never a first failure."""
        self.groups_stopping: set[Worker] = set()
        """Workers whose whole process group was sent SIGTERM."""
        self.teardown_done: float | None = None
        self.awaiting_cause: list[Worker] = []
        """Workers that exited with a consequence code before any other failure (rule 1)."""
        self.cause_deadline: float | None = None

    # --- what the loop reads ------------------------------------------------------------

    def running(self) -> list[Worker]:
        return [w for w, watch in self.watch.items() if watch.returncode is None]

    def stopping_groups(self) -> list[Worker]:
        """Exited workers told to stop whose output some process of their group still holds."""
        return [w for w in self.groups_stopping if self.watch[w].returncode is not None and self.watch[w].output_open]

    def watching(self) -> bool:
        """A worker is running, or a group told to stop still holds its output before the kill deadline."""
        return bool(self.running() or self.kill_at is not None and self.stopping_groups())

    def deadlines(self) -> list[float]:
        """The moments the loop must act at, besides its own: SIGTERM, SIGKILL, a hang, the end of a cause's wait."""
        return [d for d in (self.terminate_at, self.kill_at, self.hang_deadline(), self.cause_deadline) if d is not None]

    def still_running_line(self) -> str | None:
        """At the kill deadline, what still runs (workers, or processes of a group told to stop), said."""
        if running := self.running():
            return f"{', '.join(w.label for w in running)} still running after {self.kill_reason}; sending SIGKILL"
        if lingering := self.stopping_groups():
            return (
                f"processes started by {', '.join(w.label for w in lingering)} still running after "
                f"{self.kill_reason}; sending SIGKILL"
            )
        return None

    @property
    def tearing_down(self) -> bool:
        return self.failure is not None or self.interrupted_by is not None or self.remote is not None

    def hang_deadline(self) -> float | None:
        """When the quietest running worker will have been silent for hang_timeout."""
        running = self.running()
        if self.options.hang_timeout is None or self.tearing_down or not running:
            return None
        return min(self.watch[w].last_output for w in running) + self.options.hang_timeout

    # --- teardown -----------------------------------------------------------------------

    def exited(self, worker: Worker, returncode: int) -> None:
        self.watch[worker].returncode, self.watch[worker].exited_at = returncode, time.monotonic()
        self.dump_done(worker)

    def request_stacks(self, workers: list[Worker], signum: int, wait: float) -> None:
        """Rule 2: ask these workers to dump their stacks; SIGTERM comes once they all have, or after wait."""
        self.stacks_requested = True
        self.awaiting_dump = set(workers)
        self.terminate_at = time.monotonic() + wait
        for worker in workers:
            worker.signal(signum)

    def dump_done(self, worker: Worker) -> None:
        """The worker began its stack dump, or exited: once every one has, terminate soon."""
        if worker in self.awaiting_dump:
            self.awaiting_dump.discard(worker)
            if not self.awaiting_dump and self.terminate_at is not None:
                self.terminate_at = min(self.terminate_at, time.monotonic() + STACK_DUMP_SETTLE)

    def terminate_running(self) -> None:
        self.terminate_at = None
        self.no_dump, self.awaiting_dump = self.awaiting_dump, set()
        failure = self.failure
        if failure is not None and failure.hung_for is not None and self.no_dump:
            # All ranks fall silent when one freezes: the one that cannot even dump its
            # stacks (stopped, stuck in the kernel) is the cause, not the first to go quiet.
            failure.worker = min(self.no_dump, key=lambda w: self.watch[w].last_output)
            failure.unresponsive = True
        if failure is not None:  # those that outlived an agreed exit's grace are stopped now
            failure.stopped = max(failure.stopped, len([w for w in self.running() if w is not failure.worker]))
        self.terminate_groups(self.running())
        self.set_kill_deadline(self.options.kill_grace, "--kill-grace")

    def terminate_groups(self, workers: list[Worker]) -> None:
        """SIGTERM, all at once, to these workers' groups and to every other process of the run:
        the descendants that left their worker's group (setsid, double fork) and what is left of
        exited workers' groups. One of those that still holds a worker's output would otherwise
        keep the teardown waiting for the whole deadline, though it ends at once when asked."""
        for worker in workers:
            worker.signal_group(signal.SIGTERM)
            self.groups_stopping.add(worker)
        self.processes.terminate(workers)

    def set_kill_deadline(self, seconds: float, option: str) -> None:
        self.kill_at = time.monotonic() + seconds
        self.kill_reason = f"{seconds:g} s ({option})"

    def kill_running(self) -> None:
        for worker in self.running():
            self.killed.add(worker)
            worker.signal_group(signal.SIGKILL)
        self.kill_at = None

    # --- once the loop is over ----------------------------------------------------------

    def conclusion(self) -> tuple[int, str | None, summary.Failure | None]:
        """The run's exit code, what the launcher says of how it ended (a failure's summary, the account
        of a stop that began on another node, a graceful stop's line; None after a success), and the
        first failure as that summary tells it."""
        if self.remote is not None:  # rule 5
            took = (self.teardown_done or time.monotonic()) - self.remote_at
            account = outcome.remote_account(self.ending(), self.remote, self.awaiting_cause, took)
            return self.remote.our_exit_code, "\n".join(account), None
        if self.failure is not None:
            failure = outcome.describe_failure(self.ending(), self.failure)
            return failure.exit_code, "\n".join(summary.render(failure)), failure
        if self.interrupted_by is not None:
            said = outcome.stopped_line(self.ending(), self.interrupted_by, self.interrupted_at)
            return by_signal(self.interrupted_by), said, None
        return 0, None, None

    def ending(self) -> outcome.Ending:
        return outcome.Ending(
            self.watch,
            self.failure,
            self.no_dump,
            self.teardown_done or time.monotonic(),
            self.options.exit_meanings,
            self.options.agreed_exit_codes,
            self.options.logs_dir or (self.options.run_dir / "logs" if self.options.run_dir is not None else None),
            consequence_exit_codes=self.options.consequence_exit_codes,
            stop_exit_codes=self.options.stop_exit_codes,
        )
