"""Scripted faults, a testing aid: PRETRAIN_FAULTS makes chosen ranks die, exit or slow down at
chosen steps, so restarts (the launcher's --max-restarts), their benchmark and the straggler line
are tested on real training processes, on CPUs as on GPUs.

PRETRAIN_FAULTS holds comma-separated entries ATTEMPT:RANK:STEP:ACTION, read once at start:

- ATTEMPT: the attempt it fires in, matched against TORCHELASTIC_RESTART_COUNT (which the launcher
  and torchrun set; absent: 0), or * for every attempt. An attempt that resumed from a checkpoint
  before STEP does not meet attempt 0's fault again.
- RANK: the global rank, below the world size (the launcher refuses one that would never fire);
  STEP: the 0-based step index, as the step line shows it ("Step [10/40]").
- ACTION: sigkill or sigsegv (the process kills itself with that signal right after step STEP,
  once its step line is printed), exit=N (exits with code N there, without any cleanup), or
  sleep=S (every step from STEP on sleeps S seconds where the straggler measurement times this
  rank's compute: it looks like a slow GPU).

Standard library only; the training loop calls it only when this process has a fault, so a run
without PRETRAIN_FAULTS pays one None check per step."""

from __future__ import annotations

import math
import os
import re
import signal
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

from pretrain.run.refusal import Refusal

FAULTS_VAR = "PRETRAIN_FAULTS"
ATTEMPT_VAR = "TORCHELASTIC_RESTART_COUNT"
FORM = (
    "comma-separated ATTEMPT:RANK:STEP:ACTION, ATTEMPT a number or *, "
    "ACTION sigkill, sigsegv, exit=N or sleep=S (e.g. 0:1:10:sigkill)"
)
SIGNALS = {"sigkill": signal.SIGKILL, "sigsegv": signal.SIGSEGV}

Action = Literal["sigkill", "sigsegv", "exit", "sleep"]


class FaultsError(Refusal):
    """PRETRAIN_FAULTS (or TORCHELASTIC_RESTART_COUNT) cannot be read; the message names the entry and the form."""


@dataclass(frozen=True)
class Fault:
    """One entry of PRETRAIN_FAULTS."""

    attempt: int | None
    """The attempt it fires in; None: every attempt (*)."""
    rank: int
    step: int
    action: Action
    value: float = 0.0
    """exit's code, or sleep's seconds."""


def parse(text: str) -> tuple[Fault, ...]:
    """Every entry of a PRETRAIN_FAULTS value (empty: none); FaultsError on a malformed one."""
    return tuple(_entry(entry.strip()) for entry in text.split(",") if entry.strip())


def _entry(entry: str) -> Fault:
    def refuse(problem: str) -> FaultsError:
        return FaultsError(f"{FAULTS_VAR} entry {entry!r}: {problem}; the form is {FORM}")

    parts = entry.split(":")
    if len(parts) != 4:
        raise refuse(f"has {len(parts)} field(s), not 4")
    attempt, rank, step, action = (part.strip() for part in parts)
    for name, number in (("ATTEMPT", "0" if attempt == "*" else attempt), ("RANK", rank), ("STEP", step)):
        if not _whole(number):
            raise refuse(f"{name} {number!r} is not a whole number" + (" or *" if name == "ATTEMPT" else ""))
    at = (None if attempt == "*" else int(attempt), int(rank), int(step))
    kind, _, argument = action.partition("=")
    if action == "sigkill":
        return Fault(*at, "sigkill")
    if action == "sigsegv":
        return Fault(*at, "sigsegv")
    if kind == "exit" and _whole(argument) and int(argument) <= 255:
        return Fault(*at, "exit", int(argument))
    if kind == "sleep" and (seconds := _seconds(argument)) is not None:
        return Fault(*at, "sleep", seconds)
    raise refuse(f"ACTION {action!r} is not sigkill, sigsegv, exit=N (0-255) or sleep=S (seconds)")


def _whole(text: str) -> bool:
    return re.fullmatch(r"[0-9]+", text) is not None


def _seconds(text: str) -> float | None:
    try:
        seconds = float(text)
    except ValueError:
        return None
    return seconds if math.isfinite(seconds) and seconds >= 0 else None


def check_ranks(faults: Sequence[Fault], world_size: int) -> None:
    """FaultsError for a fault of a rank the run does not have: it would never fire, and the run
    would pass for one that survived it. Checked against the first attempt's world size, the
    largest a run has (a restart keeps it, or shrinks it with --min-nproc)."""
    for fault in faults:
        if fault.rank >= world_size:
            raise FaultsError(
                f"{FAULTS_VAR} names rank {fault.rank}, but the world size is {world_size} (ranks 0-{world_size - 1}), "
                f"so that fault would never fire; give a rank below {world_size}"
            )


def current_attempt(environ: Mapping[str, str]) -> int:
    """TORCHELASTIC_RESTART_COUNT: 0 for the first attempt, and when absent (a run without restarts)."""
    value = environ.get(ATTEMPT_VAR, "").strip()
    if not value:
        return 0
    if not _whole(value):
        raise FaultsError(f"{ATTEMPT_VAR}={value!r} is not a whole number; unset it, or start the run through the launcher")
    return int(value)


@dataclass(frozen=True)
class Faults:
    """The faults of this process (this rank, this attempt), as the training loop applies them."""

    ends: dict[int, Fault]
    """By step: the kill or exit that ends the process after that step."""
    sleeps: tuple[Fault, ...]

    def sleep_seconds(self, step: int) -> float:
        """How long step sleeps: the seconds of every sleep that has begun by then (0: none)."""
        return sum(fault.value for fault in self.sleeps if step >= fault.step)

    def after_step(self, step: int, say: Callable[[str], None]) -> None:
        """Kill or exit the process if a fault says so after this step, after saying so in one line."""
        fault = self.ends.get(step)
        if fault is None:
            return
        what = f"exit {int(fault.value)}" if fault.action == "exit" else fault.action.upper()
        say(f"fault injected: {what} after step {step} ({FAULTS_VAR})")
        sys.stdout.flush()
        sys.stderr.flush()
        if fault.action == "exit":
            os._exit(int(fault.value))  # no cleanup, as a process that dies
        number = SIGNALS[fault.action]
        if number != signal.SIGKILL:  # which no handler can take
            signal.signal(number, signal.SIG_DFL)  # past faulthandler, or any handler: die by the signal itself
        os.kill(os.getpid(), number)


def scripted(environ: Mapping[str, str] = os.environ) -> tuple[Fault, ...]:
    """The faults PRETRAIN_FAULTS scripts for this attempt, on any rank (none: the usual case).
    FaultsError (exit 2) on a malformed value, before the process joins any group."""
    faults = parse(environ.get(FAULTS_VAR, ""))
    if not faults:
        return ()
    attempt = current_attempt(environ)
    return tuple(fault for fault in faults if fault.attempt in (None, attempt))


def for_rank(faults: Sequence[Fault], rank: int) -> Faults | None:
    """Those of faults that rank applies; None without any, so the training loop's check is one None test."""
    mine = [fault for fault in faults if fault.rank == rank]
    if not mine:
        return None
    ends = {fault.step: fault for fault in mine if fault.action != "sleep"}
    return Faults(ends, tuple(fault for fault in mine if fault.action == "sleep"))
