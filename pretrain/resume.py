"""Which run directory and which checkpoint `--resume` means. Standard library only: the
launcher resolves it too, before any worker (and torch) starts.

A checkpoint is complete when its directory is named step_<N> (or a name given to save())
and holds a readable state.json: checkpoint.save writes into <name>.tmp/ and renames it,
so unfinished saves carry a .tmp (or, while being replaced, .old) suffix.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

STEP_NAME = re.compile(r"step_(\d+)")
UNFINISHED_SUFFIXES = (".tmp", ".old")


class ResumeError(ValueError):
    """--resume names nothing to resume from; the message is one line."""


def read_state(checkpoint_dir: Path) -> dict | None:
    """The checkpoint's state.json as a dict, or None when it is missing or unreadable."""
    try:
        state = json.loads((checkpoint_dir / "state.json").read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return None
    return state if isinstance(state, dict) and isinstance(state.get("steps_done"), int) else None


def is_complete(checkpoint_dir: Path) -> bool:
    return not checkpoint_dir.name.endswith(UNFINISHED_SUFFIXES) and read_state(checkpoint_dir) is not None


def step_checkpoints(checkpoints_dir: Path) -> list[tuple[int, Path]]:
    """Every step_<N> directory (complete or not) as (N, path), lowest N first."""
    if not checkpoints_dir.is_dir():
        return []
    found = [(int(match[1]), child) for child in checkpoints_dir.iterdir()
             if (match := STEP_NAME.fullmatch(child.name)) and child.is_dir()]
    return sorted(found)


def latest(checkpoints_dir: Path) -> Path | None:
    """The complete step_<N> checkpoint with the highest N, or None."""
    complete = [path for _, path in step_checkpoints(checkpoints_dir) if is_complete(path)]
    return complete[-1] if complete else None


def resolve_resume(resume: str, run_dir_arg: str | None, runs_root: Path) -> tuple[Path | None, Path | None]:
    """(run directory to use, checkpoint to resume from) for training.resume.

    "" starts fresh in run_dir_arg (None: a new run directory). "auto" continues the latest
    checkpoint of run_dir_arg (a fresh start there when it has none) or, without one, of the
    newest run under runs_root that has a checkpoint (run ids sort by time). A path names a
    checkpoint directory or a run directory; training continues in run_dir_arg when given,
    else in the run directory the checkpoint belongs to."""
    run_dir = Path(run_dir_arg) if run_dir_arg else None
    if not resume:
        return run_dir, None
    if resume == "auto":
        return _auto(run_dir, runs_root)
    return _from_path(resume, run_dir)


def _auto(run_dir: Path | None, runs_root: Path) -> tuple[Path | None, Path | None]:
    if run_dir is not None:
        found = latest(run_dir / "checkpoints")
        return run_dir, found.resolve() if found else None
    runs = sorted((p for p in runs_root.iterdir() if p.is_dir()), reverse=True) if runs_root.is_dir() else []
    for run in runs:
        if (found := latest(run / "checkpoints")) is not None:
            return run.resolve(), found.resolve()
    return None, None


def _from_path(resume: str, run_dir: Path | None) -> tuple[Path | None, Path | None]:
    path = Path(resume).expanduser()
    if not path.is_dir():
        what = "not a directory" if path.exists() else "no such directory"
        raise ResumeError(f"--resume {resume}: {what} (expected a checkpoints/step_<N> directory or a run "
                          "directory that has one)")
    if path.name.endswith(UNFINISHED_SUFFIXES):
        raise ResumeError(f"--resume {resume}: an unfinished checkpoint save (renamed or removed when the save "
                          "finishes); resume from a complete step_<N> directory beside it")
    if (path / "state.json").exists():
        if read_state(path) is None:
            raise ResumeError(f"--resume {resume}: the checkpoint's state.json is unreadable (the checkpoint is "
                              "damaged); use another checkpoint of the run")
        path = path.resolve()
        owner = path.parent.parent if path.parent.name == "checkpoints" else None
        return run_dir or owner, path
    if (found := latest(path / "checkpoints")) is not None:
        return run_dir or path.resolve(), found.resolve()
    raise ResumeError(f"--resume {resume}: no checkpoint there (expected a checkpoints/step_<N> directory or a "
                      "run directory that has one)")
