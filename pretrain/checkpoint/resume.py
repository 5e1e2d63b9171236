"""Which run directory and which checkpoint `--resume` means. Standard library only: the
launcher resolves it too, before any worker (and torch) starts. What makes a checkpoint
directory complete is pretrain/checkpoint/files.py's business.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from pretrain.checkpoint import tiers
from pretrain.run.refusal import Refusal
from pretrain.checkpoint.files import (
    OLD,
    STEP_NAME,
    UNFINISHED_SUFFIXES,
    checkpoint_problem,
    is_unfinished,
    latest,
    step_checkpoints,
)

if TYPE_CHECKING:
    from pretrain.config import Config

__all__ = [
    "UNFINISHED_SUFFIXES",
    "ResumeError",
    "checkpoint_at",
    "latest",
    "damaged",
    "damaged_after",
    "resolve_resume",
    "run_results",
]

# What a run leaves in its run directory that a new run started there would overwrite or mix
# with its own. (logs/, config.json and workers.json are written before training starts.)
RESULTS = ("checkpoints", "metrics.jsonl", "tensorboard", "export", "debug")


class ResumeError(Refusal, ValueError):
    """--resume names nothing to resume from; the message is one line."""


def resolve_resume(
    resume: str,
    run_dir_arg: str | None,
    runs_root: Path,
    world_size: int | None = None,
    config: Config | None = None,
    say: Callable[[str], None] | None = None,
) -> tuple[Path | None, Path | None]:
    """(run directory to use, checkpoint to resume from) for training.resume, on world_size ranks.

    "" starts fresh in run_dir_arg (None: a new run directory). "auto" continues the latest
    complete checkpoint of run_dir_arg (a fresh start there when it has none; ResumeError when it
    has checkpoints but every one is damaged) or, without one,
    of the run under runs_root whose latest complete checkpoint was written last. A path names a
    checkpoint directory, refused (ResumeError) unless complete, or a run directory, for its
    latest complete checkpoint; training continues in run_dir_arg when given, else in the run
    directory the checkpoint belongs to. Complete: every file a resume on world_size ranks reads
    is there and whole (pretrain/checkpoint/files.py, checkpoint_problem).

    With config (the run's), its local tier counts too (pretrain/checkpoint/tiers.py): "auto" in a
    run directory takes the newest complete checkpoint of either tier (on one node: several
    agree through their launchers), a damaged local one passed over, said through say; a path
    to another node's local checkpoint means this node's copy of it."""
    run_dir = Path(run_dir_arg) if run_dir_arg else None
    if not resume:
        return run_dir, None
    place = tiers.this_node()
    local_dir = tiers.local_dir_of(config, run_dir, place) if config is not None and run_dir is not None else None
    if resume == "auto":
        return _auto(run_dir, runs_root, world_size, local_dir if place.nodes == 1 else None, say)
    path, ranks = Path(resume).expanduser(), None
    if local_dir is not None and place.nodes > 1 and (mine := tiers.on_this_node(path, local_dir)).parent == local_dir:
        path, ranks = mine, place.ranks  # a node's local checkpoint: this node's copy, its ranks' generators
    try:
        path = checkpoint_at(path, world_size, ranks)
    except ResumeError as error:
        raise ResumeError(f"--resume {error}") from None
    owner = path.parent.parent if path.parent.name == "checkpoints" else None
    return run_dir or owner, path


def checkpoint_at(path: Path, world_size: int | None = None, ranks: range | None = None) -> Path:
    """The checkpoint path names, made absolute: path itself when it is a complete checkpoint
    directory, else the latest complete checkpoint of the run directory path (complete for a
    resume on world_size ranks; None: for a reader of the model alone). ResumeError otherwise,
    its message starting with the path so that a caller can put its option's name in front
    (`--resume <path>: ...`)."""
    if not path.is_dir():
        what = "not a directory" if path.exists() else "no such directory"
        raise ResumeError(f"{path}: {what}; give a checkpoint (<run dir>/checkpoints/step_<N>) or a run directory")
    if is_unfinished(path):
        raise ResumeError(
            f"{path}: an unfinished checkpoint save (renamed or removed when the save finishes); "
            "use a complete step_<N> directory beside it"
        )
    if (path / "state.json").exists():  # (a run directory has a config.json too)
        if (problem := checkpoint_problem(path, world_size, ranks)) is not None:
            raise ResumeError(f"{path}: {problem}")
        return path.resolve()
    if not (path / "checkpoints").is_dir():
        raise ResumeError(
            f"{path}: neither a checkpoint (no state.json) nor a run directory (no checkpoints/); "
            "give <run dir>/checkpoints/step_<N> or a run directory"
        )
    if (found := latest(path / "checkpoints", world_size)) is None:
        raise ResumeError(f"{path}: the run has no complete checkpoint yet; give a checkpoint directory")
    return found.resolve()


def _auto(
    run_dir: Path | None,
    runs_root: Path,
    world_size: int | None,
    local_dir: Path | None = None,
    say: Callable[[str], None] | None = None,
) -> tuple[Path | None, Path | None]:
    if run_dir is not None:
        found = tiers.newest(run_dir / "checkpoints", local_dir, world_size, say)
        if found is None and (problems := damaged(run_dir / "checkpoints", world_size=world_size)):
            raise ResumeError(nothing_to_resume(run_dir, problems))
        return run_dir, found.resolve() if found else None
    runs = [p for p in runs_root.iterdir() if p.is_dir()] if runs_root.is_dir() else []
    # By when their latest checkpoint was written, not by name: run ids sort by time, but a
    # run directory the user named sorts after every one of them.
    candidates = [(_written_at(found), run, found) for run in runs if (found := latest(run / "checkpoints", world_size))]
    if not candidates:
        return None, None
    _, run, found = max(candidates, key=lambda candidate: candidate[0])
    return run.resolve(), found.resolve()


def nothing_to_resume(run_dir: Path, problems: list[str]) -> str:
    """The refusal of --resume auto in a run directory whose checkpoints are all damaged: starting at
    step 0 there would be no resume, and would add a second series from step 0 to its metrics."""
    # Each problem's own advice ("use another checkpoint of the run") has nothing to point to here.
    what = "; ".join(problem.split("; ")[0] for problem in problems)
    them = "it" if len(problems) == 1 else "them"
    return (
        f"--resume auto: {run_dir} has no complete checkpoint to resume from ({what}); to start over on "
        f"purpose, choose another --run-dir, or remove {them} from {run_dir / 'checkpoints'} to start at step 0 there"
    )


def _written_at(checkpoint: Path) -> int:
    """When the checkpoint's state.json was written (ns); -1 when it has gone since."""
    try:
        return (checkpoint / "state.json").stat().st_mtime_ns
    except OSError:
        return -1


def run_results(run_dir: Path) -> list[str]:
    """What of a run's results run_dir holds, by name ("checkpoints/step_10", "metrics.jsonl",
    "export/"); empty when a new run may start there: a new or empty directory, or one a launch
    wrote into but whose training never saved or logged a step."""
    found = []
    for name in RESULTS:
        path = run_dir / name
        try:
            holds = any(path.iterdir()) if path.is_dir() else path.stat().st_size > 0
        except FileNotFoundError:
            continue
        if holds and name == "checkpoints" and (newest := latest(path)) is not None:
            found.append(f"checkpoints/{newest.name}")
        elif holds:
            found.append(name + ("/" if path.is_dir() else ""))
    return found


def damaged_after(checkpoint: Path, world_size: int | None = None) -> list[str]:
    """The later checkpoints of checkpoint's run that a resume on world_size ranks passed over
    (damaged), as damaged() lists them: a user should hear why the latest one was not taken."""
    match = STEP_NAME.fullmatch(checkpoint.name.removesuffix(OLD))
    return damaged(checkpoint.parent, int(match[1]) if match else -1, world_size)


def damaged(checkpoints_dir: Path, after: int = -1, world_size: int | None = None) -> list[str]:
    """Each step_<N> checkpoint with N > after that a resume on world_size ranks cannot use, as
    "step_<N>: <problem>" naming the missing or damaged file (pretrain/checkpoint/files.py,
    checkpoint_problem). Unfinished saves (.tmp and the like, cut short by a crash) are
    expected and not listed, nor is an empty step_<N> directory (nothing of a checkpoint)."""
    found = []
    for n, path in step_checkpoints(checkpoints_dir):
        if n <= after or _is_empty(path):
            continue
        if (problem := checkpoint_problem(path, world_size)) is not None:
            found.append(f"{path.name}: {problem}")
    return found


def _is_empty(directory: Path) -> bool:
    try:
        return not any(directory.iterdir())
    except OSError:  # unreadable: checkpoint_problem names the file it cannot read
        return False
