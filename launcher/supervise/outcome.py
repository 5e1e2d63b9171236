"""What a supervised run came to, once its workers are gone: the failure summary's facts, the
line of a graceful stop, and workers.json. The supervisor (launcher/supervise/supervisor.py) gathers
what it saw of each worker into a Watch while the run lasts; this module reads them after."""

from __future__ import annotations

import json
import signal
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

from launcher.nodes.node import NodeStop
from launcher.supervise import restarts, summary
from launcher.exit_codes import EXIT_HANG, by_signal
from launcher.supervise.printer import CONSOLE_CLOSED, CONSOLE_CLOSED_SIGNAL
from launcher.processes.worker import StartError, Worker
from pretrain.run.files import atomic_write_text, os_error_message

TAIL_LINES = 20
NO_DUMP = "no stack dump: the process was stopped (SIGSTOP) or is stuck in the kernel"


def exit_code(returncode: int) -> int:
    """A shell-style exit status: a death by signal n (returncode -n) becomes by_signal(n)."""
    return by_signal(-returncode) if returncode < 0 else returncode


@dataclass
class Watch:
    """What the supervisor knows about one running worker."""

    last_output: float
    tail: deque[str] = field(default_factory=lambda: deque(maxlen=TAIL_LINES))
    """Its last lines on the console (those meant for the logs only are not among them)."""
    returncode: int | None = None
    exited_at: float | None = None
    output_open: bool = True
    cuda_oom: bool = False
    host_oom: bool = False
    nccl_watchdog: str | None = None
    """The hint for what NCCL's watchdog reported before it aborted the worker."""
    nonfinite_report: str | None = None
    """The banner of the NaN/Inf report the worker logged."""
    stacks: summary.StackDump = field(default_factory=summary.StackDump)
    last_step: int | None = None
    """The last step it finished: its last progress line's, else its last training step line's
    (launcher/supervise/restarts.py reads it)."""

    def progress(self, text: str) -> bool:
        """Whether a line of the worker's is a progress line (restarts.PROGRESS_MARK, then the step it
        has just finished): taken in here and shown nowhere. Not output: a hang is judged without it."""
        if not text.startswith(restarts.PROGRESS_MARK):
            return False
        step = text.removeprefix(restarts.PROGRESS_MARK)
        if step.isascii() and step.isdigit():
            self.last_step = int(step)
        return True

    def see(self, text: str, now: float, log_only: bool = False) -> None:
        """One line of the worker's output: what the summary may need of it. log_only: a line for
        the logs alone (a consequence's traceback), which the summary's tail leaves out too."""
        self.last_output = now
        if log_only:
            return
        self.tail.append(text)
        self.cuda_oom = self.cuda_oom or summary.is_cuda_oom(text)
        self.host_oom = self.host_oom or summary.is_host_oom(text)
        self.nccl_watchdog = self.nccl_watchdog or summary.nccl_watchdog(text)
        self.nonfinite_report = self.nonfinite_report or summary.nonfinite_banner(text)
        if step := restarts.STEP_LINE.search(text):
            self.last_step = int(step[1])


@dataclass
class FirstFailure:
    worker: Worker
    at: float
    clock: str
    stopped: int
    """Other workers still running at that moment, which the teardown stopped."""
    hung_for: float | None = None
    unresponsive: bool = False
    """For a hang: the worker did not answer the stack-dump request either (it is frozen)."""
    cause_awaited: float | None = None
    """For a consequence exit (it lost a peer): the seconds waited in vain for another worker's
    failure, the cause, before reporting it."""
    still_running: list[str] = field(default_factory=list)
    """For a consequence exit: the workers still running when that wait ended."""
    lost_by: Worker | None = None
    """For a worker that exited 0 while its peers still ran (ended_early): the first of them that
    lost it, whose exit code the run returns."""


@dataclass(frozen=True)
class Ending:
    """Everything the outcome is made of, as the supervisor's loop left it."""

    watches: dict[Worker, Watch]
    failure: FirstFailure | None
    no_dump: set[Worker]
    """Workers asked for their stacks that neither dumped nor exited in time."""
    teardown_done: float
    exit_meanings: dict[int, str]
    agreed_exit_codes: frozenset[int]
    logs_dir: Path | None
    consequence_exit_codes: frozenset[int] = frozenset()
    stop_exit_codes: frozenset[int] = frozenset()


def describe_failure(ending: Ending, first: FirstFailure) -> summary.Failure:
    """The summary's facts. A stop signal from outside names the worker it came to (first.worker
    becomes that one, for workers.json too)."""
    first.worker = signalled(ending, first)
    worker, watch = first.worker, ending.watches[first.worker]
    returncode = watch.returncode if watch.returncode is not None else -signal.SIGKILL
    stopped_by = summary.signal_came(list(watch.tail)) or summary.stop_signal(returncode, ending.stop_exit_codes)
    if first.hung_for is not None:
        stopped_by, code, how = None, EXIT_HANG, f"printed nothing for {first.hung_for:g} s"
        if first.unresponsive:
            how += " and did not answer the stack-dump request (frozen)"
    elif first.lost_by is not None:
        code = exit_code(ending.watches[first.lost_by].returncode or 0)
        step = f" after step {watch.last_step}" if watch.last_step is not None else ""
        how = f"exited 0{step}, before the run ended; its peers lost it (exit code {code})"
    else:
        code, how = exit_code(returncode), summary.describe(returncode)
        if stopped_by is not None:
            how = f"stopped by {stopped_by} from outside the launcher"  # restarts.py's judge reads the exit code
        elif returncode in ending.exit_meanings:
            how += f" ({ending.exit_meanings[returncode]})"
    where = {w.label: frames for w, wa in ending.watches.items() if (frames := wa.stacks.where())}
    where |= {w.label: NO_DUMP for w in ending.no_dump}
    nonfinite = {
        w.label: wa.nonfinite_report
        for w, wa in ending.watches.items()
        if wa.nonfinite_report and returncode in ending.agreed_exit_codes
    }
    return summary.Failure(
        label=worker.label,
        rank=worker.rank,
        after_start=first.at - worker.started_at,
        clock=first.clock,
        exit_code=code,
        how=how,
        hint=summary.hint(
            returncode,
            hung_for=first.hung_for,
            cuda_oom=watch.cuda_oom,
            nccl_watchdog=watch.nccl_watchdog,
            nonfinite_reports=nonfinite,
            host_oom=watch.host_oom,
            injected=bool(watch.tail) and "fault injected:" in watch.tail[-1],
            ended_early=first.lost_by is not None,
            stopped_by=stopped_by,
        ),
        tail=list(watch.tail),
        stopped=first.stopped,
        teardown_seconds=ending.teardown_done - first.at,
        where=where,
        logs=ending.logs_dir,
        consequences=consequences(ending, first),
        lost_peer=lost_peer(first),
        stopped_by=stopped_by,
    )


def signalled(ending: Ending, first: FirstFailure) -> Worker:
    """The worker a stop signal from outside came to, when first (a training rank that stopped on
    it, as every rank does at the same step) did not say that it came to it; else first's worker."""
    returncode = ending.watches[first.worker].returncode
    if first.hung_for is not None or summary.stop_signal(returncode or 0, ending.stop_exit_codes) is None:
        return first.worker
    told = [w for w, watch in ending.watches.items() if summary.signal_came(list(watch.tail))]
    return first.worker if not told or first.worker in told else told[0]


def ended_early(watches: dict[Worker, Watch], lost: Worker) -> Worker | None:
    """The worker that exited 0 before lost (which failed as a consequence: it lost a peer) did,
    while the run went on: it left its peers, the cause. None if none did (the cause is elsewhere)."""
    left = watches[lost].exited_at
    if left is None:
        return None
    early = [(w, at) for w, wa in watches.items() if wa.returncode == 0 and (at := wa.exited_at) is not None and at <= left]
    return min(early, key=lambda pair: pair[1])[0] if early else None


def remote_account(ending: Ending, stop: NodeStop, awaiting_cause: list[Worker], took: float) -> list[str]:
    """The account of a stop that began on another node (the supervisor's rule 5): what this node's
    workers did after it (awaiting_cause: those that failed as a consequence, no cause here)."""
    running = len([w for w, watch in ending.watches.items() if watch.returncode != 0])
    lines = [summary.RULE, f"STOPPED: {stop.describe()}."]
    if ending.failure is not None:
        failed = ending.failure.worker
        how = summary.describe(ending.watches[failed].returncode or 0)
        lines.append(f"{failed.label} here failed after that ({how}): a consequence.")
    else:
        lines += [
            f"{lost.label} here failed as a consequence of another rank's failure "
            f"({summary.describe(ending.watches[lost].returncode or 0)})."
            for lost in awaiting_cause
        ]
    return lines + [
        f"Stopped this node's {running} worker(s); teardown took {took:.2f} s."
        + (" That node's launcher printed its summary." if stop.kind != "lost" else ""),
        f"Exit code {stop.our_exit_code}: {'a node was lost' if stop.kind == 'lost' else 'another node failed'}.",
        summary.RULE,
    ]


def attempt_end(
    code: int, ending: Ending, described: summary.Failure | None, remote: NodeStop | None, stopped: bool
) -> restarts.AttemptEnd:
    """The run as the restart rules read it: its code, the first failure as the summary told it
    (described), another node's word (remote) and whether a stop was asked for; the last step any
    worker finished."""
    steps = [watch.last_step for watch in ending.watches.values() if watch.last_step is not None]
    step = max(steps) if steps else None
    if remote is not None:
        return restarts.AttemptEnd(code, how=remote.describe(), step=step, lost_node=remote.kind == "lost")
    if described is None:
        return restarts.AttemptEnd(code, step=step, stopped=stopped)
    return restarts.AttemptEnd(
        code,
        worker=described.label,
        rank=described.rank,
        how=described.how,
        tail=tuple(described.tail),
        step=step,
        hung=ending.failure is not None and ending.failure.hung_for is not None,
        stopped=stopped,  # a failure while stopping as asked
        stopped_from_outside=described.stopped_by,
        ended_early=ending.failure is not None and ending.failure.lost_by is not None,
    )


def consequences(ending: Ending, first: FirstFailure) -> list[str]:
    """The other workers that failed with a consequence code (another rank's failure ended them),
    each with when: 'CPU1 (rank 1), exit code 4, 0.31 s before it'."""
    found = []
    for worker, watch in ending.watches.items():
        if worker is first.worker or watch.returncode not in ending.consequence_exit_codes:
            continue
        when = ""
        if watch.exited_at is not None:
            gap = first.at - watch.exited_at
            when = f", {abs(gap):.2f} s {'before' if gap >= 0 else 'after'} it"
        found.append(f"{worker.label} (rank {worker.rank}), {summary.describe(watch.returncode or 0)}{when}")
    return found


def lost_peer(first: FirstFailure) -> str | None:
    """For a consequence reported because no cause came: what that means, and who was still running."""
    if first.cause_awaited is None:
        return None
    if not first.still_running:
        return (
            "It failed as a consequence of another rank's failure, but no other worker here reported one: "
            "that rank is on another node, or was ended from outside the launcher."
        )
    return (
        f"It failed as a consequence of another rank's failure, but no other worker failed within "
        f"{first.cause_awaited:g} s of it; still running then: {', '.join(first.still_running)}. The cause is "
        f"there (frozen, stuck, or slow to fail) or outside this node."
    )


def stopped_line(ending: Ending, signum: int, interrupted_at: float) -> str:
    """After a graceful stop (rule 3): how long it took, and who had to be killed."""
    killed = [w.label for w, watch in ending.watches.items() if watch.returncode == -signal.SIGKILL]
    took = ending.teardown_done - interrupted_at
    if signum == CONSOLE_CLOSED_SIGNAL:  # not a signal: the console's reader went away (launcher/supervise/printer.py)
        line = f"stopped: {CONSOLE_CLOSED}; every worker exited within {took:.2f} s"
    else:
        line = f"stopped: every worker exited within {took:.2f} s of {signal.Signals(signum).name}"
    return line + (f"; {', '.join(killed)} had to be killed" if killed else "")


def exit_record(workers: list[Worker], ending: Ending) -> list[dict[str, object]]:
    """workers.json: each worker's exit, which failed first, and whose failure was a consequence
    (it lost the connection to another rank)."""
    failed = ending.failure.worker if ending.failure is not None else None
    hung = ending.failure is not None and ending.failure.hung_for is not None
    record: list[dict[str, object]] = []
    for worker in workers:
        returncode = ending.watches[worker].returncode if worker in ending.watches else None
        record.append(
            {
                "rank": worker.rank,
                "label": worker.label,
                "pid": worker.process.pid if worker.process else None,
                "returncode": returncode,
                "exit_code": exit_code(returncode) if returncode is not None else None,
                "failed_first": worker is failed,
                "hung": worker is failed and hung,
                "consequence": returncode in ending.consequence_exit_codes,
            }
        )
    return record


def start_failure_record(workers: list[Worker], error: StartError) -> list[dict[str, object]]:
    """workers.json of a run one of whose workers could not be started (error.label): it failed
    first, with its exit code (126 or 127 as a shell gives them, 2 with no memory left) and the
    reason; none ran on (those started before it were killed at once)."""
    return [
        {
            "rank": worker.rank,
            "label": worker.label,
            "pid": worker.process.pid if worker.process else None,
            "returncode": None,
            "exit_code": error.exit_code if worker.label == error.label else None,
            "failed_first": worker.label == error.label,
            "hung": False,
            "start_error": str(error) if worker.label == error.label else None,
        }
        for worker in workers
    ]


def write_exit_record(run_dir: Path, record: list[dict[str, object]], name: str = "workers.json") -> str | None:
    """Write workers.json; the warning to print when that fails (a full disk), so the exit code
    and the summary survive it."""
    try:
        atomic_write_text(run_dir / name, json.dumps(record, indent=2) + "\n")
    except OSError as error:
        return f"warning: could not record exit codes: {os_error_message(error)}"
    return None
