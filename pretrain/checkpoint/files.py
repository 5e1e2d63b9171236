"""A run's checkpoint directories on disk: which are complete, what their state.json says, and
the renames that keep each one complete or absent. Standard library only: the launcher chooses
the checkpoint to resume with it before any worker (and torch) starts.

<run dir>/checkpoints/ holds
    step_<N>/             a complete checkpoint after N steps (save() may also use another name)
    step_<N>.tmp/         a save in progress, or killed: removed by the next save
    step_<N>.old/         a complete checkpoint being replaced by a new step_<N>: removed once the
                          new one is in place; alone (killed mid-replace) it still counts as step_<N>
    step_<N>.deleting/    a checkpoint being pruned: removed by the next save, never read
    step_<N>.superseded/  a later checkpoint of a continuation abandoned by resuming an earlier one:
                          kept for the user, never resumed or pruned automatically

A checkpoint is complete for a run when every file a resume by that run reads is there and
whole (checkpoint_problem): state.json, config.json, the model and optimizer (model.pt and
optimizer.pt for a single process or DDP; dcp/.metadata, written last by DCP, and every shard it
names for FSDP or HSDP) and rng_rank<r>.pt of each rank r the resuming run has and the saving run had
(a rank the saving run did not have seeds its generators afresh). --resume auto passes over any
other with a warning; --resume naming it is refused. A reader of the model alone (export,
generation) needs state.json, config.json and the model. What "whole" means is what can be told
without torch: present, a regular file, not empty, a zip archive for a .pt (torch.save's format,
whose directory is at the end of the file, so a truncated one is not one), JSON for config.json
and a pickle that parses for dcp/.metadata.
"""

from __future__ import annotations

import json
import os
import pickletools
import re
import shutil
import stat
import zipfile
from collections.abc import Iterable, Iterator
from pathlib import Path

from pretrain.config import SHARDED_MODES
from pretrain.run.refusal import Refusal
from pretrain.run.files import fsync

FORMAT_VERSION = 2
"""2: optimizer state keyed by parameter name, Python and NumPy RNG, DCP for FSDP. 1 (the
optimizer's own integer keys, torch RNG only) is still read."""

STEP_NAME = re.compile(r"step_(\d+)")
OLD, TMP, DELETING, SUPERSEDED = ".old", ".tmp", ".deleting", ".superseded"
UNFINISHED_SUFFIXES = (TMP, OLD, DELETING)
"""Directories no one resumes from (an alone .old is the exception: see is_unfinished)."""


class CheckpointError(Refusal, ValueError):
    """A checkpoint that cannot be used here; the message is one line that says what to do."""


class StateError(CheckpointError):
    """state.json is missing or unusable. problem is the message without the leading
    "checkpoint <path>: ", for callers that name the path their own way."""

    def __init__(self, path: Path, problem: str) -> None:
        super().__init__(f"checkpoint {path}: {problem}")
        self.path, self.problem = path, problem

    def __reduce__(self):  # picklable (collectives gather exceptions), with both arguments
        return type(self), (self.path, self.problem)


def first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


# --- reading --------------------------------------------------------------------------


def read_state(path: Path) -> dict:
    """The checkpoint's state.json; StateError when path is not a checkpoint this code reads."""
    try:
        state = json.loads((path / "state.json").read_text(encoding="utf-8"))
    except FileNotFoundError:
        what = "no such directory" if not path.exists() else "no state.json (not a checkpoint, or an unfinished save)"
        raise StateError(path, f"{what}; give a <run dir>/checkpoints/step_<N> directory") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise StateError(path, f"state.json is unreadable ({first_line(error)}); use another checkpoint of the run") from None
    version = state.get("format_version", 1) if isinstance(state, dict) else 1
    if _is_int(version) and version > FORMAT_VERSION:
        raise StateError(
            path, f"format version {version} is newer than this code reads ({FORMAT_VERSION}); update the code or start fresh"
        )
    if (problem := state_problem(state, path.name)) is not None:
        raise StateError(
            path,
            f"state.json: {problem}; the checkpoint is damaged: resume from an earlier one "
            "with --resume <run dir>/checkpoints/step_<N>, or start fresh",
        )
    return state


# What state.json holds; save_restore.py's _state writes it. Every key this code reads is checked
# here, so a damaged or hand-edited file is one line naming the key instead of a traceback or,
# worse, a resume "at step -1" that sets the run's checkpoints aside. Keys beyond these are
# ignored: a later version may add informational ones (it bumps format_version to change these).
LOADER_KEYS = ("epoch", "batch_index")
PARALLELISM = ("single", "ddp", *SHARDED_MODES)


def state_problem(state: object, directory_name: str = "") -> str | None:
    """What is wrong with a parsed state.json, as a phrase naming the key; None when usable.
    directory_name: the checkpoint's; a step_<N> directory must hold N steps done."""
    if not isinstance(state, dict):
        return f"not a JSON object (got {_json_type(state)})"
    version = state.get("format_version", 1)
    if not _is_int(version) or version < 1:
        return f"format_version must be an integer from 1 to {FORMAT_VERSION} (got {_show(version)})"
    required = ["steps_done", "world_size", "loader"] + (["parallelism"] if version >= 2 else [])
    if missing := [key for key in required if key not in state]:
        return f"{missing[0]} is missing"
    steps, world_size, loader = state["steps_done"], state["world_size"], state["loader"]
    if not _is_int(steps) or steps < 0:
        return f"steps_done must be a non-negative integer (got {_show(steps)})"
    if not _is_int(world_size) or world_size < 1:
        return f"world_size must be a positive integer (got {_show(world_size)})"
    if not isinstance(loader, dict):
        return f"loader must be an object with {' and '.join(LOADER_KEYS)} (got {_show(loader)})"
    for key in LOADER_KEYS:
        if key not in loader:
            return f"loader.{key} is missing"
        if not _is_int(loader[key]) or loader[key] < 0:
            return f"loader.{key} must be a non-negative integer (got {_show(loader[key])})"
    if "parallelism" in state and state["parallelism"] not in PARALLELISM:
        return f"parallelism must be one of {', '.join(PARALLELISM)} (got {_show(state['parallelism'])})"
    if "lr_schedule" in state:
        schedule = state["lr_schedule"]
        lr = schedule.get("lr") if isinstance(schedule, dict) else None
        if not isinstance(schedule, dict) or not (
            lr is None or (isinstance(lr, (int, float)) and not isinstance(lr, bool) and lr >= 0)
        ):
            return f"lr_schedule must be an object whose lr is a non-negative number (got {_show(schedule)})"
    name = directory_name.removesuffix(OLD)
    if (match := STEP_NAME.fullmatch(name)) and int(match[1]) != steps:
        # The number in the name is what latest() and pruning go by, steps_done what a resume does.
        return f"steps_done is {steps}, but the directory is {name}"
    return None


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)  # true is no count


def _json_type(value: object) -> str:
    names = {list: "an array", str: "a string", bool: "a boolean", int: "a number", float: "a number"}
    return "null" if value is None else names.get(type(value), type(value).__name__)


def _show(value: object) -> str:
    """A value as JSON, shortened: it goes into a one-line message."""
    text = json.dumps(value)
    return text if len(text) <= 40 else text[:37] + "..."


def checkpoint_problem(path: Path, world_size: int | None = None, ranks: Iterable[int] | None = None) -> str | None:
    """What makes checkpoint path unusable for a resume on world_size ranks, as a phrase that
    names the file and ends with what to do ("optimizer.pt is missing (an incomplete
    checkpoint); use another checkpoint of the run"); None when every file such a resume reads
    is there and whole. world_size None: a reader of the model alone (export, generation),
    which needs neither optimizer.pt nor the random generators. ranks: the ranks whose random
    generators path holds (a node's local checkpoint, pretrain/checkpoint/tiers.py); None: every one."""
    try:
        state = read_state(path)
    except StateError as error:
        return error.problem
    required = _required_files(path, state, world_size, ranks)
    problem = next(filter(None, (_file_problem(path, name) for name in required)), None)
    return None if problem is None else f"{problem}; use another checkpoint of the run"


def _required_files(path: Path, state: dict, world_size: int | None, ranks: Iterable[int] | None) -> Iterator[str]:
    """The files (relative to path) a resume reads. A sharded checkpoint's shards are those its
    dcp/.metadata names: listed once that has passed its own check (so it parses)."""
    yield "config.json"
    sharded = (path / "dcp").is_dir() or state.get("parallelism") in SHARDED_MODES
    if sharded:
        yield "dcp/.metadata"
    else:
        yield from ("model.pt",) if world_size is None else ("model.pt", "optimizer.pt")
    saved = 0 if world_size is None else min(world_size, state["world_size"])
    yield from (f"rng_rank{rank}.pt" for rank in (range(saved) if ranks is None else ranks) if rank < saved)
    if sharded:
        yield from (f"dcp/{name}" for name in sorted(_dcp_shards((path / "dcp" / ".metadata").read_bytes())))


def _file_problem(path: Path, name: str) -> str | None:
    """Why the checkpoint's file name is not whole, as a phrase naming it; None when it is."""
    file = path / name
    try:
        info = file.stat()
        if not stat.S_ISREG(info.st_mode):
            return f"{name} is not a file (a damaged checkpoint)"
        if info.st_size == 0:
            return f"{name} is empty (a damaged checkpoint)"
        if name.endswith(".pt") and not zipfile.is_zipfile(file):
            return f"{name} is damaged (not a whole torch.save file)"
        if name == "config.json" and not isinstance(json.loads(file.read_text(encoding="utf-8")), dict):
            return f"{name} is not a JSON object (a damaged checkpoint)"
        if name.endswith(".metadata"):
            _dcp_shards(file.read_bytes())
    except FileNotFoundError:
        return f"{name} is missing (an incomplete checkpoint)"
    except ValueError as error:  # JSON, UTF-8 or the pickle's opcodes
        return f"{name} is damaged ({first_line(error)})"
    except OSError as error:
        return f"{name} is unreadable ({error.strerror or error})"
    return None


def _dcp_shards(metadata: bytes) -> set[str]:
    """The shard files (__<rank>_<n>.distcp) DCP's pickled metadata names, read from the
    pickle's opcodes without unpickling it (so without torch, and running nothing). ValueError
    when it is not a whole pickle."""
    return {arg for _op, arg, _pos in pickletools.genops(metadata) if isinstance(arg, str) and arg.endswith(".distcp")}


def is_unfinished(path: Path) -> bool:
    """A save in progress or killed, or a checkpoint being pruned or replaced. A .old whose
    replacement never arrived is the complete checkpoint it was, so it does not count."""
    if path.name.endswith(OLD):
        return path.with_name(path.name.removesuffix(OLD)).exists()
    return path.name.endswith(UNFINISHED_SUFFIXES)


def is_complete(path: Path, world_size: int | None = None) -> bool:
    """Whether a resume on world_size ranks may continue path (checkpoint_problem)."""
    return not is_unfinished(path) and checkpoint_problem(path, world_size) is None


def step_checkpoints(checkpoints_dir: Path) -> list[tuple[int, Path]]:
    """Every step_<N> directory (complete or not) as (N, path), lowest N first; a step_<N>.old
    left alone by a killed replace stands for step_<N>."""
    if not checkpoints_dir.is_dir():
        return []
    found = []
    for child in checkpoints_dir.iterdir():
        name = child.name.removesuffix(OLD) if child.name.endswith(OLD) else child.name
        if (match := STEP_NAME.fullmatch(name)) and child.is_dir() and not is_unfinished(child):
            found.append((int(match[1]), child))
    return sorted(found)


def latest(checkpoints_dir: Path, world_size: int | None = None) -> Path | None:
    """The step_<N> checkpoint with the highest N that is complete for a resume on world_size
    ranks (checkpoint_problem), or None."""
    newest_first = (path for _, path in reversed(step_checkpoints(checkpoints_dir)))
    return next((path for path in newest_first if is_complete(path, world_size)), None)


# --- changing ---------------------------------------------------------------------------


def remove(path: Path) -> None:
    """Delete a checkpoint directory: first renamed to .deleting, so a delete cut short leaves
    nothing that looks like a checkpoint. Never raises: a leftover must not end a run."""
    doomed = path.with_name(path.name + DELETING)
    try:
        os.rename(path, doomed)
    except OSError:
        doomed = path
    shutil.rmtree(doomed, ignore_errors=True)


def clean_unfinished(checkpoints_dir: Path) -> None:
    """Remove what killed saves and prunes left (.tmp, .deleting). A .old is a complete
    checkpoint being replaced: removed when its replacement is in place, else renamed back."""
    if not checkpoints_dir.is_dir():
        return
    for path in checkpoints_dir.iterdir():
        if path.name.endswith((TMP, DELETING)):
            shutil.rmtree(path, ignore_errors=True)
        elif path.name.endswith(OLD):
            final = path.with_name(path.name.removesuffix(OLD))
            if final.exists():
                remove(path)
            else:
                os.rename(path, final)


def prune(checkpoints_dir: Path, keep: int, just_written: Path) -> list[Path]:
    """Delete step_<N> checkpoints so that `keep` remain: the one just written and the newest
    others. Checkpoints with other names (and superseded ones) are never deleted. Returns
    what was deleted."""
    steps = [path for _, path in step_checkpoints(checkpoints_dir)]
    others = [path for path in steps if path != just_written]
    room = keep - 1 if just_written in steps else keep
    doomed = others[: max(0, len(others) - room)]
    for path in doomed:
        remove(path)
    return doomed


def supersede_after(checkpoints_dir: Path, steps_done: int) -> list[Path]:
    """Rename every step_<N> with N > steps_done to step_<N>.superseded (or .superseded.2, ...
    when that exists) and return the new paths. Resuming an earlier checkpoint abandons them:
    left as they were, pruning would keep them over the new run's own checkpoints and
    --resume auto would continue them."""
    renamed = []
    for steps, path in step_checkpoints(checkpoints_dir):
        if steps > steps_done:
            target = _free_name(checkpoints_dir / f"step_{steps}{SUPERSEDED}")
            os.rename(path, target)
            renamed.append(target)
    if renamed:
        fsync_dir(checkpoints_dir)
    return renamed


def _free_name(path: Path) -> Path:
    candidate, number = path, 1
    while candidate.exists():
        number += 1
        candidate = path.with_name(f"{path.name}.{number}")
    return candidate


def replace_dir(new: Path, final: Path) -> None:
    """Rename new to final; an existing final is moved aside to final.old first and removed
    last, so a complete checkpoint exists at every moment (clean_unfinished and latest know
    what a kill in between leaves)."""
    old = final.with_name(final.name + OLD)
    if final.exists():
        if old.exists():  # a leftover of an earlier replace; final is complete
            remove(old)
        os.rename(final, old)
    os.rename(new, final)
    fsync_dir(final.parent)  # the rename itself survives a power loss
    if old.exists():
        remove(old)


def fsync_dir(directory: Path) -> None:
    """Make the directory's entries (files created or renamed in it) durable."""
    fsync(directory)
