"""Restarts (--max-restarts N): which failures start the run again from its latest checkpoint and
which never do, and the record of every attempt (<run dir>/restarts.jsonl).

A restart is worth it only where the next attempt can get further: the hardware or the network
let the run down (a worker killed by a signal it did not ask for, a hang or a collective's timeout,
a CUDA error that names the hardware, a lost peer or node). A failure the run itself makes would
only repeat (bad input, a numerical failure, a bug), and so would one that came before any step
was trained, or the same failure at the same step twice in a row; a stop the user asked for is
never undone. The rules run in that order, each tested (tests/launcher/supervise/test_restarts.py); docs/failures.md
explains them.
"""

from __future__ import annotations

import json
import re
import signal
import time
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path

from pretrain.run.exit_codes import BAD_INPUT, NUMERICAL_FAILURE, PEER_LOST, signal_of
from pretrain.run.files import atomic_write_text

RECORD = "restarts.jsonl"
UNASKED_SIGNALS: dict[int, str] = {s: s.name for s in (signal.SIGKILL, signal.SIGSEGV, signal.SIGBUS, signal.SIGABRT)}
"""Deaths a worker did not ask for: the OOM killer or another process (SIGKILL), a crash in native code
(SIGSEGV, SIGBUS: often a GPU or driver fault), NCCL's watchdog aborting a stuck collective (SIGABRT)."""
COLLECTIVE, STORE = "a collective timed out", "torch.distributed's store timed out"
HARDWARE = (
    (re.compile(r"uncorrectable ECC error", re.I), "an uncorrectable ECC error"),
    (re.compile(r"\bXid\b"), "an Xid error (the driver's report of a GPU fault)"),
    (re.compile(r"fallen off the bus", re.I), "a GPU fell off the bus"),
    (re.compile(r"illegal memory access", re.I), "a CUDA illegal memory access"),
    (re.compile(r"unspecified launch failure", re.I), "a CUDA unspecified launch failure"),
    # Timeouts, in the words of the libraries that time out (torch 2.13's, checked against its
    # sources and runs) and of pretrain/train.py, never a bare "timed out": a download or a
    # command of the user's that times out would only time out again.
    (re.compile(r"[Cc]aught collective operation timeout: WorkNCCL\("), COLLECTIVE),  # NCCL's watchdog
    (re.compile(r"Timed out waiting \d+ms for (recv|send)\b"), COLLECTIVE),  # gloo
    (re.compile(r"Application timeout caused pair closure"), COLLECTIVE),  # gloo, after that timeout
    (re.compile(r"failed to pass monitoredBarrier in \d+ ms"), COLLECTIVE),  # torch's monitored_barrier
    (re.compile(r"a collective waited longer than system\.collective_timeout"), COLLECTIVE),  # ours
    (re.compile(r"wait timeout after \d+ms, keys: "), STORE),  # TCPStore get/wait
    (re.compile(r"Timed out after \d+ seconds waiting for clients\. \d+/\d+ clients joined"), STORE),
    (re.compile(r"The client socket has timed out after \d+ms while trying to connect to \("), STORE),
    (re.compile(r"DistNetworkError: Socket Timeout"), STORE),
    (re.compile(r"Timed out initializing process group in store based barrier"), STORE),
)
"""What a worker's last lines say when the hardware or the network let it down, and how the restart
line words it. A CUDA error that names no hardware (out of memory, an assert) repeats: not here."""
STEP_LINE = re.compile(r"\] Step \[(\d+)/\d+\]")
"""A training step line ("[GPU 0] Step [10/40] | Loss: ..."): the last step a worker logged, for
workers that report no progress (below)."""
PROGRESS_VAR = "LAUNCHER_PROGRESS_MARK"
"""In every worker's environment: the marker of a progress line, the step a worker has just
finished ("<mark>12"), which a training worker writes after every step (pretrain/observe/progress.py;
the worker contract, docs/design.md "Log format"). The supervisor reads it and writes it nowhere."""
PROGRESS_MARK = "\x1fprogress\x1f"
"""As launcher/supervise/printer.py's LOG_ONLY_MARK: a word between unit separators."""
MAX_BACKOFF = 60.0
DEFAULT_BACKOFF = 1.0


@dataclass(frozen=True)
class AttemptEnd:
    """What one attempt came to, as the restart rules read it."""

    exit_code: int
    worker: str | None = None
    """The label of the worker that failed first (GPU3, node1:GPU3), None when none failed."""
    rank: int | None = None
    how: str = ""
    """How it failed, as the summary says it ("killed by SIGKILL", "exit code 1")."""
    tail: tuple[str, ...] = ()
    """Its last lines on the console."""
    step: int | None = None
    """The last step any worker finished, as its progress lines report it (else its last step line);
    None: no step was trained, or the command reports none."""
    stopped: bool = False
    """A stop the user asked for ended it (Ctrl-C, SIGTERM or SIGHUP to the launcher)."""
    hung: bool = False
    lost_node: bool = False
    stopped_from_outside: str | None = None
    """The stop signal another process sent the first worker alone (SIGTERM), not the launcher."""
    ended_early: bool = False
    """The first worker exited 0 while its peers still trained (they lost it)."""


@dataclass(frozen=True)
class Verdict:
    restart: bool
    why: str
    """One clause: the transient cause that earns a restart, or why there is none."""


def transient_cause(end: AttemptEnd, training: bool = True) -> str | None:
    """What let the attempt down from outside the run, or None when the failure is its own.
    training: the workers are training processes, whose exit code 4 means a lost peer."""
    if end.hung:  # the supervisor's own finding; a command exiting 124 by itself is no hang of ours
        return "a worker hung (no output for --hang-timeout)"
    if end.lost_node:
        return "a node was lost"
    if (name := UNASKED_SIGNALS.get(signal_of(end.exit_code) or 0)) is not None:
        return f"{end.worker or 'a worker'} was killed by {name}"
    for pattern, what in HARDWARE:
        if any(pattern.search(line) for line in end.tail):
            return f"{what} on {end.worker or 'a worker'}"
    if training and end.exit_code == PEER_LOST:
        return f"{end.worker or 'a worker'} lost its peers (the cause is on another node or outside the launcher)"
    return None


def judge(end: AttemptEnd, attempt: int, max_restarts: int, previous: AttemptEnd | None, training: bool) -> Verdict:
    """Whether attempt (0 for the first) is followed by another, by the rules in the module's order."""
    if end.exit_code == 0 and end.worker is None:
        return Verdict(False, "the run finished")
    if end.stopped:
        return Verdict(False, "the stop was asked for")
    if end.stopped_from_outside is not None:
        return Verdict(
            False, f"{end.worker} was stopped by {end.stopped_from_outside} from outside the launcher: a stop is never undone"
        )
    if end.ended_early:
        return Verdict(False, f"{end.worker} exited 0 before the run ended: it would again")
    if end.exit_code == BAD_INPUT:
        return Verdict(False, "bad input (exit 2) fails again the same way")
    if training and end.exit_code == NUMERICAL_FAILURE:
        return Verdict(False, "a numerical failure (exit 3) repeats from the same checkpoint")
    cause = transient_cause(end, training)
    if cause is None:
        how = end.how or f"exit code {end.exit_code}"
        return Verdict(False, f"{how} shows no hardware, network or timeout cause: it would repeat")
    if training and attempt == 0 and end.step is None:
        return Verdict(False, f"{cause} before the first step: a run that cannot start is not restarted")
    if training and previous is not None and same_failure(previous, end):
        return Verdict(False, f"the same failure ({end.how}) at the same step ({end.step}) twice in a row")
    if attempt >= max_restarts:
        return Verdict(False, f"{cause}; the restart budget ({max_restarts}) is used up")
    return Verdict(True, cause)


def same_failure(previous: AttemptEnd, end: AttemptEnd) -> bool:
    """The same exit at the same step (the step reached, not the last one logged): the hardware
    rarely fails twice at one step."""
    return previous.exit_code == end.exit_code and previous.step == end.step and previous.step is not None


def backoff(restart: int, first: float | None) -> float:
    """Seconds to wait before restart number `restart` (1, 2, ...): first (None: --restart-backoff's
    default), doubling, at most a minute."""
    first = DEFAULT_BACKOFF if first is None else first
    return min(MAX_BACKOFF, first * 2 ** (restart - 1)) if first > 0 else 0.0


def last_step(lines: Iterable[str]) -> int | None:
    """The step of the last step line among lines."""
    found = None
    for line in lines:
        if match := STEP_LINE.search(line):
            found = int(match[1])
    return found


@dataclass
class Attempt:
    """One line of restarts.jsonl: one attempt of one launch of the run."""

    launch: int
    """Which launch of the run directory (1, 2, ...: `--resume auto`, a Slurm requeue) it belongs to."""
    attempt: int
    """Its number within the launch (0 for the first, as TORCHELASTIC_RESTART_COUNT)."""
    started: str
    devices: list[str]
    resumed_from: str | None
    ended: str = ""
    exit_code: int | None = None
    worker: str | None = None
    how: str = ""
    step: int | None = None
    restarted: bool = False
    why: str = ""


@dataclass
class Record:
    """The attempts of a run, written to <run dir>/restarts.jsonl whole (atomically) after each: the
    earlier launches' lines as they were, then this launch's."""

    path: Path
    attempts: list[Attempt] = field(default_factory=list)
    """This launch's."""
    earlier: list[str] = field(default_factory=list)
    """The lines earlier launches in the run directory wrote, kept as they are."""
    launch: int = 1

    def __post_init__(self) -> None:
        try:
            self.earlier = self.path.read_text(encoding="utf-8", errors="replace").splitlines()
        except OSError:  # none yet (or unreadable: the write after the attempt says so)
            return
        self.launch = 1 + max((launch_of(line) for line in self.earlier), default=0)

    def begin(self, devices: list[str], resumed_from: str | None) -> Attempt:
        attempt = Attempt(self.launch, len(self.attempts), now(), devices, resumed_from)
        self.attempts.append(attempt)
        return attempt

    def end(self, attempt: Attempt, end: AttemptEnd, verdict: Verdict) -> str | None:
        """Fill in how the attempt ended; the warning to print when writing fails (a full disk)."""
        attempt.ended, attempt.exit_code, attempt.worker = now(), end.exit_code, end.worker
        attempt.how, attempt.step = end.how or stop_wording(end), end.step
        return self.decide(attempt, verdict)

    def decide(self, attempt: Attempt, verdict: Verdict) -> str | None:
        """Whether the ended attempt was restarted, and why; written as end() writes."""
        attempt.restarted, attempt.why = verdict.restart, verdict.why
        lines = self.earlier + [json.dumps(asdict(a)) for a in self.attempts]
        try:
            atomic_write_text(self.path, "".join(line + "\n" for line in lines))
        except OSError as error:
            return f"warning: could not record the attempt in {self.path.name}: {error.strerror or error}"
        return None

    def summary(self) -> list[str]:
        """This launch's attempts, one line each, for the end of a launch that had more than one."""
        of_launch = f" of launch {self.launch}" if self.launch > 1 else ""
        lines = [f"attempts{of_launch}: {len(self.attempts)} (restarts.jsonl)"]
        for a in self.attempts:
            where = f" at step {a.step}" if a.step is not None else ""
            who = f"{a.worker}: " if a.worker else ""  # none: a stop asked for, another node's word
            what = a.how or f"exit code {a.exit_code}"
            outcome = "finished" if a.exit_code == 0 and a.worker is None else f"{who}{what}{where}"
            then = "restarted" if a.restarted else f"exit code {a.exit_code}"
            resumed = f"from {Path(a.resumed_from).name}" if a.resumed_from else "from step 0"
            lines.append(f"  {a.attempt}. {resumed} on {', '.join(a.devices)}: {outcome}; {then}")
        return lines


def stop_wording(end: AttemptEnd) -> str:
    """How an attempt that a stop asked for ended, where no worker failed ("stopped by SIGTERM")."""
    if not end.stopped or (signum := signal_of(end.exit_code)) is None:
        return ""
    try:
        return f"stopped by {signal.Signals(signum).name}"
    except ValueError:  # a number with no name
        return f"stopped by signal {signum}"


def launch_of(line: str) -> int:
    """The launch a line of restarts.jsonl belongs to (a line from before launches were numbered: 1;
    a damaged one: 0)."""
    try:
        found = json.loads(line)
    except ValueError:
        return 0
    launch = found.get("launch", 1) if isinstance(found, dict) else 0
    return launch if isinstance(launch, int) else 0


def now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S%z")
