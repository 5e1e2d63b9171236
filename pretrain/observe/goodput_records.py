"""The goodput ledger's records on disk (pretrain/observe/goodput.py says what they hold): their
names in <run dir>/goodput/, their writing, and their reading, which passes over any that is not a
record of its kind (a damaged file, a hand edit, NaN), said once naming it: the ledger is an
account, never worth a run."""

from __future__ import annotations

import json
import logging
import math
import os
import re
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from pretrain.run.files import atomic_write_text

RECORDS_DIR = "goodput"
_LAUNCH_FILE = re.compile(r"^launch_(\d+)\.json$")
_ATTEMPT_FILE = re.compile(r"^launch_(\d+)_attempt_(\d+)\.json$")
Warn = Callable[[str], None]
_warned: set[str] = set()  # the problems said in this process: a record is read again at every logging step


def worker_warning(line: str) -> None:
    logging.getLogger("pretrain").warning(line)


def warn_once(warn: Warn | None, line: str) -> None:
    """Say line once in this process (through warn, default the worker's log)."""
    if line not in _warned:
        _warned.add(line)
        (warn or worker_warning)(line)


def launch_file(run_dir: Path, launch: int) -> Path:
    return run_dir / RECORDS_DIR / f"launch_{launch}.json"


def attempt_file(run_dir: Path, launch: int, attempt: int) -> Path:
    return run_dir / RECORDS_DIR / f"launch_{launch}_attempt_{attempt}.json"


def next_launch(run_dir: Path, warn: Warn | None = None) -> int | None:
    """The number of a new launch into run_dir: one past any recorded there (1 for the first);
    None, said once, when run_dir/goodput/ cannot be listed (the launch keeps no ledger)."""
    numbers = [0]
    if (records := run_dir / RECORDS_DIR).is_dir():
        try:
            names = [path.name for path in records.iterdir()]
        except OSError as error:
            warn_once(warn, unreadable_line(records, error))
            return None
        for name in names:
            if found := _LAUNCH_FILE.match(name) or _ATTEMPT_FILE.match(name):
                numbers.append(int(found[1]))
    return max(numbers) + 1


def unreadable_line(records: Path, error: OSError) -> str:
    reason = error.strerror or type(error).__name__
    return f"goodput: cannot list {records}: {reason}; no goodput ledger this time (make it readable, or remove it)"


def write_text(path: Path, text: str, durable: bool = False) -> None:
    """Replace path atomically (readers see the old file or the new one). Not durable unless asked:
    the records are rewritten at every logging step, where an fsync each would cost more than the
    logging itself, and a crash loses at most the latest account (an unreadable file is passed over)."""
    if durable:
        atomic_write_text(path, text)
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        temporary.write_text(text, encoding="utf-8")
        os.replace(temporary, path)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise


def write_json(path: Path, record: Mapping[str, Any], durable: bool = False) -> None:
    write_text(path, json.dumps(record) + "\n", durable)


def read_records(run_dir: Path, warn: Warn | None = None) -> tuple[list[dict[str, Any]], list[dict[str, Any]]] | None:
    """The launch records and the attempt records in run_dir/goodput/; None when the directory
    cannot be listed. A file that cannot be read, or is not a record of its kind (record_problem),
    is passed over, said once naming it: the ledger is an account, not worth a run."""
    launches: list[dict[str, Any]] = []
    attempts: list[dict[str, Any]] = []
    records = run_dir / RECORDS_DIR
    try:
        paths = sorted(records.iterdir()) if records.is_dir() else []
    except OSError as error:
        warn_once(warn, unreadable_line(records, error))
        return None
    for path in paths:
        named = _LAUNCH_FILE.match(path.name) or _ATTEMPT_FILE.match(path.name)
        if named is None:
            continue
        try:
            record = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as error:  # UnicodeDecodeError is a ValueError
            problem: str | None = f"cannot be read ({getattr(error, 'strerror', None) or type(error).__name__})"
        else:
            problem = record_problem(record, [int(number) for number in named.groups()])
        if problem is not None:
            warn_once(warn, f"goodput: skipping {path}: {problem}; the ledger leaves it out (delete it to silence this)")
            continue
        (launches if len(named.groups()) == 1 else attempts).append(record)
    return launches, attempts


# --- the records' shape ----------------------------------------------------------------


Check = tuple[Callable[[Any], bool], str]  # a field's test, and what it says a field should be


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _is_seconds(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _is_points(value: Any) -> bool:
    return isinstance(value, list) and all(
        isinstance(p, list | tuple) and len(p) == 2 and _is_count(p[0]) and _is_seconds(p[1]) for p in value
    )


COUNT: Check = (_is_count, "a whole number, 0 or more")
SECONDS: Check = (_is_seconds, "a finite number")
MAYBE_SECONDS: Check = (lambda value: value is None or _is_seconds(value), "a finite number or null")
MAYBE_FLAG: Check = (lambda value: value is None or isinstance(value, bool), "true, false or null")
POINTS: Check = (_is_points, "a list of [step, seconds] pairs")
_LAUNCH_FIELDS = {"launch": COUNT, "started": SECONDS}
_LAUNCH_OPTIONAL = {"ended": MAYBE_SECONDS}
_RUN_FIELDS = {"attempt": COUNT}
_RUN_OPTIONAL = dict.fromkeys(("spawned", "failed", "ended"), MAYBE_SECONDS)
_ATTEMPT_FIELDS = {"launch": COUNT, "attempt": COUNT, "started": SECONDS, "start_step": COUNT, "updated": SECONDS}
_ATTEMPT_FIELDS |= {"steps_done": COUNT} | dict.fromkeys(("step_s", "checkpoint_stall_s", "evaluation_s"), SECONDS)
_ATTEMPT_OPTIONAL = {"first_step": MAYBE_SECONDS, "points": POINTS, "final": MAYBE_FLAG}


def _shown(value: Any) -> str:
    text = json.dumps(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _fields_problem(record: Any, required: dict[str, Check], optional: dict[str, Check]) -> str | None:
    if not isinstance(record, dict):
        return f"not a JSON object (got {_shown(record)})"
    if missing := [key for key in required if key not in record]:
        return f"no {missing[0]!r}"
    for key, (check, what) in (required | optional).items():
        if key in record and not check(record[key]):
            return f"{key!r} is not {what} (got {_shown(record[key])})"
    return None


def record_problem(record: Any, numbers: list[int] | None = None) -> str | None:
    """What is wrong with a launch record (numbers: [k]) or an attempt record ([k, n]), None when
    nothing is: the keys combine() reads, of their types, the times finite. numbers: those its
    file name gives, which it must carry (default: whichever kind it has the keys of)."""
    is_attempt = len(numbers) == 2 if numbers is not None else isinstance(record, dict) and "attempt" in record
    if is_attempt:
        problem = _fields_problem(record, _ATTEMPT_FIELDS, _ATTEMPT_OPTIONAL)
    else:
        problem = _fields_problem(record, _LAUNCH_FIELDS, _LAUNCH_OPTIONAL) or _runs_problem(record.get("attempts"))
    if problem is not None:
        return problem
    own = [record["launch"], record["attempt"]] if is_attempt else [record["launch"]]
    return f"it says it is {own}, its name {numbers}" if numbers is not None and own != numbers else None


def _runs_problem(runs: Any) -> str | None:
    """What is wrong with a launch record's attempts."""
    if not isinstance(runs, list):
        return "no 'attempts'" if runs is None else f"'attempts' is not a list (got {_shown(runs)})"
    for run in runs:
        if problem := _fields_problem(run, _RUN_FIELDS, _RUN_OPTIONAL):
            return f"an attempt in it: {problem}"
    return None


def well_formed(
    launches: list[dict[str, Any]], attempts: list[dict[str, Any]]
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The records of the right shape (read_records already said which it passed over)."""
    return (
        [r for r in launches if isinstance(r, dict) and "attempt" not in r and record_problem(r) is None],
        [r for r in attempts if isinstance(r, dict) and "attempt" in r and record_problem(r) is None],
    )
