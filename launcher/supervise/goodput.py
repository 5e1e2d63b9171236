"""The launcher's side of the goodput ledger (pretrain/observe/goodput.py says what it splits): the
launch's own record, <run dir>/goodput/launch_<k>.json (when the launch started, each attempt's
spawn, first failure and end), goodput.json once the launch ends, and the summary line.

Only a launcher that trains keeps one, and in a job of several nodes only node 0's (rank 0's node,
whose clock its records share). A job of several nodes that restarts (launcher/nodes/restart_rounds.py)
keeps one for all its rounds (launch.py restarting_job), so the time between attempts (teardown,
settling with the other nodes, backoff, the next round's rendezvous and start-up) counts as restart."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from pretrain.observe import goodput, goodput_records
from pretrain.observe.goodput import LAUNCH_VAR
from pretrain.observe.goodput_records import Warn

__all__ = ["LAUNCH_VAR", "JobLedger", "LaunchLedger"]


class LaunchLedger:
    """One launch's record, rewritten as its attempts come and go. No problem of the ledger's ends
    the launch: a record that cannot be written (a full disk) is left as it was, a damaged one is
    passed over, an unreadable goodput/ means no ledger this launch; each said once through say."""

    def __init__(self, run_dir: Path, started: float | None = None, say: Warn | None = None) -> None:
        """started: the launch's start (default: this process's). say: the launcher's line (default: the log's warning)."""
        self.run_dir = run_dir
        self.say: Warn | None = (lambda line: say(f"warning: {line}")) if say is not None else None
        self.number = goodput_records.next_launch(run_dir, self.say)
        """None: goodput/ cannot be listed; the launch keeps no ledger (and tells its workers none)."""
        self.record: dict[str, Any] = {
            "launch": self.number,
            "started": goodput.process_started() if started is None else started,
            "ended": None,
            "attempts": [],
        }
        self._failed = False

    def env(self) -> dict[str, str]:
        """What the workers are told: this launch's number (their attempt's is TORCHELASTIC_RESTART_COUNT)."""
        return {LAUNCH_VAR: str(self.number)} if self.number is not None else {}

    def spawned(self, attempt: int) -> None:
        self.record["attempts"].append({"attempt": attempt, "spawned": time.time(), "failed": None, "ended": None})
        self._write()

    def ended(self, attempt: int, failed: float | None) -> None:
        """The attempt's supervisor returned; failed: when its first failure came (wall clock), if one did."""
        for entry in self.record["attempts"]:
            if entry["attempt"] == attempt:
                entry["failed"], entry["ended"] = failed, time.time()
        self._write()

    def finish(self) -> str | None:
        """The launch ended: its record closed, goodput.json written; the summary line (None when
        nothing could be written or no step ran)."""
        if not self.record["attempts"] or self.number is None:
            return None
        self.record["ended"] = time.time()
        self._write(durable=True)
        try:
            if (written := goodput.write_ledger(self.run_dir, durable=True, warn=self.say)) is None:
                return None
            ledger, restarts = written
            if ledger["parts_s"]["productive"] <= 0 and ledger["parts_s"]["redone"] <= 0:
                return None
            return goodput.summary_line(ledger, restarts)
        except goodput.LEDGER_ERRORS as error:
            self._failed_once(error)
            return None

    def _write(self, durable: bool = False) -> None:
        if (
            not self.record["attempts"] or self.number is None
        ):  # from the first spawn on: a launch that never started is no launch
            return
        try:
            goodput_records.write_json(goodput_records.launch_file(self.run_dir, self.number), self.record, durable)
        except goodput.LEDGER_ERRORS as error:
            self._failed_once(error)

    def _failed_once(self, error: BaseException) -> None:
        if not self._failed:
            self._failed = True
            goodput_records.warn_once(
                self.say, f"goodput: cannot write the ledger in {self.run_dir}: {error}; the run goes on without it"
            )


class JobLedger:
    """Node 0 of a job of several nodes that restarts: one LaunchLedger for all its rounds, made at
    the first attempt (once the first round has chosen the run directory), so that every round's
    attempt is an attempt of one launch and the time between them is restart."""

    def __init__(self, say: Warn | None = None) -> None:
        self.say = say
        self.started = goodput.process_started()
        self.ledger: LaunchLedger | None = None

    def of(self, run_dir: Path) -> LaunchLedger:
        """The launch's ledger (run_dir: the run directory, the same every round)."""
        if self.ledger is None:
            self.ledger = LaunchLedger(run_dir, self.started, self.say)
        return self.ledger

    def finish(self) -> str | None:
        """The job ended here: LaunchLedger.finish, once (None without an attempt)."""
        ledger, self.ledger = self.ledger, None
        return ledger.finish() if ledger is not None else None
