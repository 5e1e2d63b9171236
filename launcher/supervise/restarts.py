"""Restarts (--max-restarts N): which failures start the run again from its latest checkpoint and
which never do, and the record of every attempt (<run dir>/restarts.jsonl).

A restart is worth it only where the next attempt can get further: the hardware or the network
let the run down (a worker killed by a signal it did not ask for, a hang or a collective's timeout,
a CUDA error that names the hardware, a lost peer or node). A failure the run itself makes would
only repeat (bad input, a numerical failure, a bug), and so would one that came before any step
was trained, or the same failure at the same step twice in a row; a stop the user asked for is
never undone. The rules run in that order, each tested (tests/test_restarts.py); docs/failures.md
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
HARDWARE = (
    (re.compile(r"uncorrectable ECC error", re.I), "an uncorrectable ECC error"),
    (re.compile(r"\bXid\b"), "an Xid error (the driver's report of a GPU fault)"),
    (re.compile(r"fallen off the bus", re.I), "a GPU fell off the bus"),
    (re.compile(r"illegal memory access", re.I), "a CUDA illegal memory access"),
    (re.compile(r"unspecified launch failure", re.I), "a CUDA unspecified launch failure"),
    (re.compile(r"Watchdog caught collective operation timeout|collective operation timeout", re.I), "a collective timed out"),
    (re.compile(r"Timed out waiting .* for|Socket Timeout|timed out after \d+", re.I), "a collective timed out"),
    (re.compile(r"a collective waited longer than system\.collective_timeout"), "a collective timed out"),
)
"""What a worker's last lines say when the hardware or the network let it down, and how the restart
line words it. A CUDA error that names no hardware (out of memory, an assert) repeats: not here."""
STEP_LINE = re.compile(r"\] Step \[(\d+)/\d+\]")
"""A training step line ("[GPU 0] Step [10/40] | Loss: ..."): the step a failure came after."""
MAX_BACKOFF = 60.0


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
    """The last step line any worker printed (None: no step was trained, or the command prints none)."""
    stopped: bool = False
    """A stop the user asked for ended it (Ctrl-C, SIGTERM or SIGHUP to the launcher)."""
    hung: bool = False
    lost_node: bool = False


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
    """The same exit at the same step: the hardware rarely fails twice at one step."""
    return previous.exit_code == end.exit_code and previous.step == end.step and previous.step is not None


def backoff(restart: int, first: float) -> float:
    """Seconds to wait before restart number `restart` (1, 2, ...): first, doubling, at most a minute."""
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
    """One line of restarts.jsonl: one attempt of the run."""

    attempt: int
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
    """Every attempt of a run, written to <run dir>/restarts.jsonl after each (whole, atomically)."""

    path: Path
    attempts: list[Attempt] = field(default_factory=list)

    def begin(self, devices: list[str], resumed_from: str | None) -> Attempt:
        attempt = Attempt(len(self.attempts), now(), devices, resumed_from)
        self.attempts.append(attempt)
        return attempt

    def end(self, attempt: Attempt, end: AttemptEnd, verdict: Verdict) -> str | None:
        """Fill in how the attempt ended; the warning to print when writing fails (a full disk)."""
        attempt.ended, attempt.exit_code, attempt.worker = now(), end.exit_code, end.worker
        attempt.how, attempt.step, attempt.restarted, attempt.why = end.how, end.step, verdict.restart, verdict.why
        try:
            atomic_write_text(self.path, "".join(json.dumps(asdict(a)) + "\n" for a in self.attempts))
        except OSError as error:
            return f"warning: could not record the attempt in {self.path.name}: {error.strerror or error}"
        return None

    def summary(self) -> list[str]:
        """The attempts, one line each, for the end of a run that had more than one."""
        lines = [f"attempts: {len(self.attempts)} (restarts.jsonl)"]
        for a in self.attempts:
            where = f" at step {a.step}" if a.step is not None else ""
            outcome = "finished" if a.exit_code == 0 and a.worker is None else f"{a.worker}: {a.how}{where}"
            then = "restarted" if a.restarted else f"exit code {a.exit_code}"
            resumed = f"from {Path(a.resumed_from).name}" if a.resumed_from else "from step 0"
            lines.append(f"  {a.attempt}. {resumed} on {', '.join(a.devices)}: {outcome}; {then}")
        return lines


def now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S%z")
