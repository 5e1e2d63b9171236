"""The goodput ledger: how much of a run's wall time became kept training steps.

<run dir>/goodput.json splits the wall time of every launch into the run directory (summed over
its attempts, and over earlier launches that `--resume auto` continued) into parts that add up to
it: productive (the step time of steps the run kept), redone (the step time of steps a restart threw
away: those after the checkpoint the next attempt resumed from, and an attempt's tail after its last
record), startup (from the launch's start, the launcher's data preparation included, to the first
step), checkpoint_stall (what checkpointing blocked the training thread for), evaluation (validation
and task evaluations), restart (teardown, backoff, waiting for devices, the next attempt's start-up
and checkpoint load) and other (step lines, logging, the stop agreement: the rest).

Who writes what, in <run dir>/goodput/:
- launch_<k>.json, by the launcher (launcher/supervise/goodput.py): when the launch started, and each
  attempt's spawn, first failure and end (wall-clock seconds). Its number reaches the workers as
  PRETRAIN_GOODPUT_LAUNCH. Without the launcher (`python -m pretrain`) there is none: the worker's own
  record stands for it, its process start as the launch's start.
- launch_<k>_attempt_<n>.json, by rank 0 of each attempt (AttemptClock), at each logging step, at
  each step a checkpoint can be saved after, and at the end: its first step's time, the seconds each
  part took since, and the cumulative step seconds at each checkpoint step, so that when a later
  attempt resumes from step S the steps after S count as redone.
goodput.json is combine() of all of them: rank 0 rewrites it at each logging step, the launcher at
the end. Every time is time.time() (the launcher and rank 0 share node 0's clock). Their names,
writing and reading (which passes over a damaged record, saying so once) are in goodput_records.py.
No problem of the ledger's ends a run: it is said once, and the run goes on without it."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from pretrain import config as cfg
from pretrain.observe.goodput_records import (
    Warn,
    attempt_file,
    next_launch,
    read_records,
    warn_once,
    well_formed,
    worker_warning,
    write_json,
    write_text,
)

LEDGER_FILE = "goodput.json"
LAUNCH_VAR = "PRETRAIN_GOODPUT_LAUNCH"
"""The launcher's number for this launch (launch_<k>.json); absent without the launcher."""
ATTEMPT_VAR = "TORCHELASTIC_RESTART_COUNT"
PARTS = ("productive", "redone", "startup", "checkpoint_stall", "evaluation", "restart", "other")
_IMPORTED = time.time()
LEDGER_ERRORS = (OSError, LookupError, TypeError, ValueError, ArithmeticError)
"""What writing the ledger can raise (a full disk, a damaged record it passed over): caught, said once."""


def process_started() -> float:
    """When this process started (wall clock): /proc's start time, else when this module was imported."""
    try:
        stat = Path("/proc/self/stat").read_text()
        ticks = int(stat.rsplit(")", 1)[1].split()[19])  # field 22, starttime, in clock ticks after boot
        uptime = float(Path("/proc/uptime").read_text().split()[0])
        started = time.time() - uptime + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return _IMPORTED
    return min(started, _IMPORTED)


# --- the combining ---------------------------------------------------------------------


def step_seconds_at(record: Mapping[str, Any], steps_done: int) -> float:
    """An attempt's cumulative step seconds when it had steps_done steps done: its recorded points
    (each checkpoint step's, and its last), linearly between them."""
    points = [(record["start_step"], 0.0)] + [(int(s), float(v)) for s, v in record.get("points", [])]
    points.append((record["steps_done"], float(record["step_s"])))
    points.sort()
    if steps_done <= points[0][0]:
        return 0.0
    for (s0, v0), (s1, v1) in zip(points, points[1:], strict=False):
        if steps_done <= s1:
            return v0 + (v1 - v0) * (steps_done - s0) / (s1 - s0) if s1 > s0 else v1
    return points[-1][1]


def kept_step_seconds(records: list[dict[str, Any]]) -> list[float]:
    """The step seconds each attempt (in the order they ran) kept: an attempt that resumed from
    step S takes away every earlier attempt's steps after S, which were redone."""
    kept_until = [int(r["steps_done"]) for r in records]
    for later, record in enumerate(records):
        resumed = int(record["start_step"])
        for earlier in range(later):
            if kept_until[earlier] > resumed:
                kept_until[earlier] = max(int(records[earlier]["start_step"]), resumed)
    return [step_seconds_at(r, until) for r, until in zip(records, kept_until, strict=True)]


def combine(launches: list[dict[str, Any]], attempts: list[dict[str, Any]], now: float | None = None) -> dict[str, Any]:
    """goodput.json from the launch and attempt records (pure). Each launch's wall time, from its
    start to its end (now for the newest launch still running, else its last known time), is cut
    at its attempts' first steps, last records, failures and ends, and each piece goes to one
    part, so the parts add up to the wall time."""
    parts = dict.fromkeys(PARTS, 0.0)
    launches, attempts = well_formed(launches, attempts)
    by_key = {(int(r["launch"]), int(r["attempt"])): r for r in attempts}
    by_launch = with_standalone_launches(launches, by_key)
    order: list[dict[str, Any]] = []  # the attempt records in the order they ran
    wall = 0.0
    for number in sorted(by_launch):
        launch = by_launch[number]
        runs = sorted(launch["attempts"], key=lambda a: int(a["attempt"]))
        records = [by_key.get((number, int(run["attempt"]))) for run in runs]
        known = [launch["started"]] + [t for run in runs for t in (run.get("spawned"), run.get("ended")) if t]
        known += [record["updated"] for record in records if record is not None]
        end = launch.get("ended") or (now if now is not None and number == max(by_launch) else max(known))
        wall += max(0.0, end - launch["started"])
        order += split_launch(launch["started"], end, runs, records, parts)
    kept = kept_step_seconds(order)
    parts["productive"] += sum(kept)
    parts["redone"] += sum(float(r["step_s"]) for r in order) - sum(kept)
    return {
        "wall_s": round(wall, 3),
        "goodput": round(parts["productive"] / wall, 4) if wall > 0 else 0.0,
        "parts_s": {name: round(value, 3) for name, value in parts.items()},
    }


def with_standalone_launches(
    launches: list[dict[str, Any]], by_key: dict[tuple[int, int], dict[str, Any]]
) -> dict[int, dict[str, Any]]:
    """The launches by number, with one made up for each attempt no launcher recorded (`python -m
    pretrain`): its process start the launch's, its final record the launch's end."""
    by_launch = {int(launch["launch"]): dict(launch, attempts=list(launch["attempts"])) for launch in launches}
    for (number, attempt), record in by_key.items():
        if number not in by_launch:
            ended = record["updated"] if record.get("final") else None
            by_launch[number] = {"launch": number, "started": record["started"], "ended": ended, "attempts": []}
        if attempt not in {int(run["attempt"]) for run in by_launch[number]["attempts"]}:
            by_launch[number]["attempts"].append({"attempt": attempt, "spawned": record["started"]})
    return by_launch


def split_launch(
    started: float, end: float, runs: list[dict[str, Any]], records: list[dict[str, Any] | None], parts: dict[str, float]
) -> list[dict[str, Any]]:
    """Add one launch's pieces to parts, but for its step time (kept or redone across attempts);
    return the attempt records that ran steps."""
    stepped = []
    cursor = started
    for index, (run, record) in enumerate(zip(runs, records, strict=True)):
        before = "startup" if index == 0 else "restart"
        run_end = run.get("ended") or end
        if record is None or record.get("first_step") is None:  # it ended before its first step
            parts[before] += max(0.0, run_end - cursor)
            cursor = max(cursor, run_end)
            continue
        stepped.append(record)
        parts[before] += max(0.0, record["first_step"] - cursor)
        inside = max(0.0, record["updated"] - record["first_step"])
        parts["checkpoint_stall"] += record["checkpoint_stall_s"]
        parts["evaluation"] += record["evaluation_s"]
        parts["other"] += max(0.0, inside - record["step_s"] - record["checkpoint_stall_s"] - record["evaluation_s"])
        failed = run.get("failed") or run_end
        # After its last record: steps lost with it, unless it had finished (or is running still).
        tail = max(0.0, min(failed, run_end) - record["updated"])
        parts["other" if record.get("final") or run.get("ended") is None else "redone"] += tail
        # The teardown after a failure: a restart's when one follows, else the run's end.
        parts["restart" if index < len(runs) - 1 else "other"] += max(0.0, run_end - max(failed, record["updated"]))
        cursor = max(run_end, record["updated"])
    parts["other"] += max(0.0, end - cursor)
    return stepped


def restarts_of(launches: list[dict[str, Any]], attempts: list[dict[str, Any]]) -> int:
    """The restarts the records show: attempts after the first of their launch."""
    launches, attempts = well_formed(launches, attempts)
    numbers = {(int(a["launch"]), int(a["attempt"])) for a in attempts}
    numbers |= {(int(launch["launch"]), int(a["attempt"])) for launch in launches for a in launch["attempts"]}
    return sum(1 for _, attempt in numbers if attempt > 0)


def summary_line(ledger: Mapping[str, Any], restarts: int) -> str:
    """`goodput 93.4%: lost 41 s to 2 restarts, 12 s to checkpoints, 30 s to start-up`."""
    parts = ledger["parts_s"]
    lost = []
    if restarts:
        lost.append(f"{parts['redone'] + parts['restart']:.0f} s to {restarts} restart{'s' if restarts > 1 else ''}")
    elif parts["redone"] >= 0.5:
        lost.append(f"{parts['redone']:.0f} s to redone steps")
    lost.append(f"{parts['checkpoint_stall']:.0f} s to checkpoints")
    lost.append(f"{parts['startup']:.0f} s to start-up")
    if parts["evaluation"] >= 0.5:
        lost.append(f"{parts['evaluation']:.0f} s to evaluation")
    return f"goodput {100 * ledger['goodput']:.1f}%: lost " + ", ".join(lost)


def write_ledger(
    run_dir: Path, now: float | None = None, durable: bool = False, warn: Warn | None = None
) -> tuple[dict[str, Any], int] | None:
    """Combine run_dir's records into goodput.json; (the ledger, the restarts it counts), None when
    the records cannot be listed (goodput.json is then left as it was)."""
    if (read := read_records(run_dir, warn)) is None:
        return None
    launches, attempts = read
    ledger = combine(launches, attempts, now)
    write_text(run_dir / LEDGER_FILE, json.dumps(ledger, indent=2) + "\n", durable)
    return ledger, restarts_of(launches, attempts)


# --- the worker's side -----------------------------------------------------------------


class AttemptClock:
    """Rank 0's account of one attempt, from its first step: the step time, the evaluations, the
    checkpoint stall (the writer's stall_seconds), and the rest. Disabled on the other ranks.

    A step's time is everything from its start (mark()) to its end (step_time(done=True)) but the
    evaluations and the checkpoint stall in it and its logging (from the logging step's read of the
    loss, a step_time(), to the record()): so the device work a step's host side runs ahead of,
    which a later read waits for (the loss's, the stop agreement's), is step time wherever it is
    waited for."""

    def __init__(
        self,
        run_dir: Path,
        enabled: bool,
        start_step: int,
        is_checkpoint_step: Callable[[int], bool],
        stall_seconds: Callable[[], float],
        environ: Mapping[str, str] | None = None,
    ) -> None:
        environ = os.environ if environ is None else environ
        self.run_dir = run_dir
        self.standalone = LAUNCH_VAR not in environ
        numbers = launch_and_attempt(run_dir, environ) if enabled else (0, 0)
        self.enabled = enabled and numbers is not None  # None: no ledger this time (said why)
        self.launch, self.attempt = numbers or (0, 0)
        self._failed = False  # a write of the ledger failed (said once)
        self.is_checkpoint_step = is_checkpoint_step
        self.stall_seconds = stall_seconds
        self.started = process_started()
        self.start_step = start_step
        self.first_step: float | None = None
        self.steps_done = start_step
        self.step_s = 0.0
        self.evaluation_s = 0.0
        self.points: list[tuple[int, float]] = []
        self._mark = 0.0
        self._stall_at_mark = 0.0
        self._evaluation_at_mark = 0.0
        self._stall_before = 0.0  # the writer's stall before the first step (a resume's): not this attempt's

    def begin(self) -> None:
        """The training loop begins: start-up (or a restart's) ends here."""
        self.first_step = time.time()
        self._stall_before = self.stall_seconds()
        self.mark()

    def mark(self) -> None:
        """What follows is step time, until step_time()."""
        self._mark = time.time()
        self._stall_at_mark = self.stall_seconds()
        self._evaluation_at_mark = self.evaluation_s

    def step_time(self, steps_done: int, done: bool = False) -> None:
        """The time since mark() (or the last step_time()) was the step's, less the evaluations and
        the checkpoint stall in it. done: the step's end; after one a checkpoint can follow, the
        point redone steps are counted from is kept and written."""
        now, stall, evaluation = time.time(), self.stall_seconds(), self.evaluation_s
        self.step_s += max(0.0, now - self._mark - (stall - self._stall_at_mark) - (evaluation - self._evaluation_at_mark))
        self._mark, self._stall_at_mark, self._evaluation_at_mark = now, stall, evaluation
        self.steps_done = max(self.steps_done, steps_done)
        if done and self.is_checkpoint_step(steps_done):
            self.points.append((steps_done, self.step_s))
            self.record(steps_done)

    @contextmanager
    def evaluating(self) -> Iterator[None]:
        began = time.time()
        try:
            yield
        finally:
            self.evaluation_s += time.time() - began

    def as_record(self, final: bool) -> dict[str, Any]:
        return {
            "launch": self.launch,
            "attempt": self.attempt,
            "started": self.started,
            "first_step": self.first_step,
            "start_step": self.start_step,
            "updated": time.time(),
            "steps_done": self.steps_done,
            "step_s": self.step_s,
            "checkpoint_stall_s": max(0.0, self.stall_seconds() - self._stall_before),
            "evaluation_s": self.evaluation_s,
            "points": self.points,
            "final": final,
        }

    def record(self, steps_done: int, final: bool = False) -> dict[str, Any] | None:
        """Write this attempt's record and goodput.json (rank 0); the ledger, or None when disabled
        or the files cannot be written (the ledger is an account: a full disk costs it, not the run)."""
        if not self.enabled or self.first_step is None:
            return None
        self.steps_done = max(self.steps_done, steps_done)
        try:
            write_json(attempt_file(self.run_dir, self.launch, self.attempt), self.as_record(final), durable=final)
            written = write_ledger(self.run_dir, now=time.time(), durable=final)
        except LEDGER_ERRORS as error:
            if not self._failed:
                self._failed = True
                worker_warning(f"goodput: cannot write the ledger in {self.run_dir}: {error}; training goes on without it")
            return None
        finally:
            self.mark()  # the logging is not the step's
        return written[0] if written is not None else None

    def summary(self) -> str | None:
        """The summary line of the run so far (rank 0), else None."""
        if not self.enabled:
            return None
        try:
            if (read := read_records(self.run_dir)) is None:
                return None
            return summary_line(combine(*read, time.time()), restarts_of(*read))
        except LEDGER_ERRORS:
            return None


def launch_and_attempt(run_dir: Path, environ: Mapping[str, str]) -> tuple[int, int] | None:
    """This attempt's numbers: the launcher's (its environment), else a launch of its own, the next
    in run_dir; None, said once, when there are none to be had (no ledger this time)."""
    if LAUNCH_VAR not in environ:
        launch = next_launch(run_dir)
        return None if launch is None else (launch, 0)
    try:
        return int(environ[LAUNCH_VAR]), int(environ.get(ATTEMPT_VAR) or 0)
    except ValueError:
        values = f"{LAUNCH_VAR}={environ[LAUNCH_VAR]!r}, {ATTEMPT_VAR}={environ.get(ATTEMPT_VAR)!r}"
        warn_once(None, f"goodput: {values} are not numbers; no goodput ledger this time (unset them)")
        return None


def clock_for(trainer: Any) -> AttemptClock:
    """The attempt clock of a Trainer, begun: its checkpoint steps are those any of its intervals (or an
    epoch's end) falls on; its stall, its checkpoint writer's (0 without one)."""
    t = trainer.config.training
    intervals = [i for i in (t.checkpoint_interval, getattr(t, "local_checkpoint_interval", 0)) if i]
    epoch = max(1, trainer.loader.batches_per_epoch // cfg.grad_accum_nums(trainer.config)) if t.by_epoch else 0

    def is_checkpoint_step(steps_done: int) -> bool:
        return any(steps_done % i == 0 for i in intervals) or bool(epoch and steps_done % epoch == 0)

    def stall_seconds() -> float:
        return float(getattr(getattr(trainer, "checkpoints", None), "stall_seconds", 0.0))

    clock = AttemptClock(trainer.run_dir, trainer.runtime.is_main, trainer.start_step, is_checkpoint_step, stall_seconds)
    clock.begin()
    return clock
