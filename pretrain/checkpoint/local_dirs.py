"""Where a run's local checkpoint tier lives on a node (pretrain/checkpoint/tiers.py), whose it is,
and removing it. Standard library only (the launcher uses it before any worker starts).

<local root>/<run dir's name>-<hash of its path>/ is a run's (the root: --local-checkpoint-dir, by
default /dev/shm/pretrain-<user>/); on several nodes each node's part is node<k>/ in it. Each
node's directory holds owner.json: the run directory it belongs to and the process that owns it
(the node's launcher, or without one the node's first worker), written before any checkpoint goes
there and checked before any is taken from it, so that two runs whose directories share a name
never take or prune each other's. Removing a tier removes only what the tier itself puts there
(step_<N> checkpoints and their unfinished forms, owner.json, its own probes), then the
directories it made, each only when empty: never a whole directory it did not make.
"""

from __future__ import annotations

import getpass
import hashlib
import json
import os
import re
import shutil
import socket
from pathlib import Path

from pretrain.checkpoint.files import STEP_NAME, read_state
from pretrain.run.files import atomic_write_text

__all__ = [
    "OWNER",
    "SHM",
    "claim",
    "default_root",
    "discard_later",
    "local_root_of",
    "node_directory",
    "overlap",
    "owned_by",
    "remove_empty",
    "remove_tier",
    "resumed_steps",
    "run_key",
    "sweep_stale",
]

SHM = Path("/dev/shm")
"""Where the local tier goes by default: memory, per node, gone at a reboot."""
OWNER = "owner.json"
"""A node's local directory's owner: {"run_dir", "host", "pid", "started"}."""
_OURS = re.compile(r"step_\d+(\.tmp|\.old|\.deleting|\.superseded(\.\d+)?)?|\.probe-\d+|\.owner\.json\..*\.tmp")
"""What a tier puts in its directory (beside owner.json): removed with it; anything else stays."""
_NODE = re.compile(r"node\d+")


def _user() -> str:
    try:
        return getpass.getuser()
    except (KeyError, OSError):  # no name for this uid (a container)
        return str(os.getuid())


def default_root() -> Path:
    """/dev/shm/pretrain-<user>/: per user (another user's is not writable)."""
    return SHM / f"pretrain-{_user()}"


def local_root_of(named: str) -> Path:
    """The local tiers' root: the directory named (training.local_checkpoint_dir), else the default."""
    return Path(named).expanduser().absolute() if named else default_root()


def run_key(run_dir: Path) -> str:
    """The run's directory name under the root: its name, and a hash of its whole path, so that
    /a/exp and /b/exp never share one."""
    path = str(run_dir.expanduser().resolve())
    return f"{run_dir.name}-{hashlib.sha256(path.encode()).hexdigest()[:12]}"


def node_directory(base: Path, nodes: int, node_rank: int) -> Path:
    """The node's own checkpoints directory under base: base itself on one node."""
    return base if nodes <= 1 else base / f"node{node_rank}"


def overlap(root: Path, run_dir: Path, runs_root: Path) -> str | None:
    """Why root cannot hold local tiers: it is, holds or is inside the run directory or the runs
    root (removing a local tier there would reach into runs); None when apart."""
    mine = root.expanduser().resolve()
    named = (("the run directory", run_dir), ("the runs root", runs_root))
    others = [(what, other.expanduser().resolve()) for what, other in named]
    for relation, holds in (("is", lambda theirs: mine == theirs), ("holds", lambda theirs: mine in theirs.parents)):
        for what, theirs in others:
            if holds(theirs):
                return f"it {relation} {what} {theirs}"
    for what, theirs in others:
        if theirs in mine.parents:
            return f"it is inside {what} {theirs}"
    return None


# --- the owner ------------------------------------------------------------------------


def _started(pid: int) -> str | None:
    """When process pid started (Linux: /proc/<pid>/stat's 22nd field), to tell it from a later
    process given the same pid; None where that cannot be read."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rpartition(")")[2].split()[19]


def claim(directory: Path, run_dir: Path, pid: int | None = None) -> None:
    """Write directory's owner: run_dir's, this host's process pid (default: this one)."""
    pid = os.getpid() if pid is None else pid
    owner = {"run_dir": str(run_dir.expanduser().resolve()), "host": socket.gethostname(), "pid": pid, "started": _started(pid)}
    directory.mkdir(parents=True, exist_ok=True)
    atomic_write_text(directory / OWNER, json.dumps(owner) + "\n")


def _owner(directory: Path) -> dict | None:
    try:
        owner = json.loads((directory / OWNER).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return owner if isinstance(owner, dict) else None


def owned_by(directory: Path, run_dir: Path) -> bool:
    """Whether directory's owner.json names run_dir (a local checkpoint is taken only then)."""
    owner = _owner(directory)
    return owner is not None and owner.get("run_dir") == str(run_dir.expanduser().resolve())


def _stale(directory: Path) -> bool:
    """Whether directory is a local tier of this user on this host whose run has ended without
    removing it: its run directory is gone, or its owning process is (a launcher killed by
    SIGKILL, a worker that crashed). Another host's, another user's, or one whose owner cannot
    be told: not stale."""
    owner = _owner(directory)
    if owner is None or owner.get("host") != socket.gethostname():
        return False
    try:
        if (directory / OWNER).stat().st_uid != os.getuid():
            return False
    except OSError:
        return False
    if not Path(str(owner.get("run_dir", ""))).is_dir():
        return True
    pid = owner.get("pid")
    if not isinstance(pid, int) or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except OSError:  # alive, another user's (a pid reused)
        return False
    started = owner.get("started")
    return started is not None and _started(pid) not in (None, started)


# --- removing ---------------------------------------------------------------------------


def resumed_steps(resume: str) -> int | None:
    """The steps of the checkpoint training.resume names ("": none, -1), None when it cannot be
    told (nothing is discarded then)."""
    if not resume:
        return -1
    path = Path(resume)
    try:
        steps = read_state(path).get("steps_done")
    except Exception:  # noqa: BLE001  (any unreadable state: go by the name)
        steps = None
    if isinstance(steps, int):
        return steps
    match = STEP_NAME.fullmatch(path.name)
    return int(match[1]) if match else None


def discard_later(local_dir: Path | None, steps_done: int) -> list[Path]:
    """Remove the local checkpoints of local_dir after steps_done (every one for -1, a start at
    step 0), unfinished ones too: a resume from an earlier one abandons them (they are of another
    continuation, and a later restart must not take them)."""
    if local_dir is None or not local_dir.is_dir():
        return []
    doomed = []
    for path in local_dir.iterdir():
        match = STEP_NAME.match(path.name)
        if match and _OURS.fullmatch(path.name) and int(match[1]) > steps_done:
            _remove_entry(path)
            doomed.append(path)
    return sorted(doomed)


def _remove_entry(path: Path) -> None:
    if path.is_symlink() or not path.is_dir():
        path.unlink(missing_ok=True)
    else:
        shutil.rmtree(path, ignore_errors=True)


def _empty_tier(directory: Path) -> None:
    """Remove what a tier put in directory, then directory itself if that left it empty."""
    try:
        entries = list(directory.iterdir())
    except OSError:
        return
    for path in entries:
        if path.name == OWNER or _OURS.fullmatch(path.name):
            try:
                _remove_entry(path)
            except OSError:
                pass
    _rmdir(directory)


def _rmdir(directory: Path) -> bool:
    try:
        directory.rmdir()
    except OSError:  # not empty (something not the tier's), or gone already
        return not directory.exists()
    return True


def remove_empty(base: Path) -> None:
    """base (a run's tier: a check that made it found it unusable), and the default root above it,
    each when empty."""
    if _rmdir(base) and base.parent == default_root():
        _rmdir(base.parent)


def remove_tier(base: Path, run_dir: Path | None = None) -> None:
    """Remove a run's local tier, base (its node<k>/ parts in it too), of run_dir (None: whoever's):
    a part another run owns stays. Then the default root once empty. Never raises."""
    if not base.is_dir() or base.is_symlink():
        return
    parts = [path for path in base.iterdir() if _NODE.fullmatch(path.name) and path.is_dir() and not path.is_symlink()]
    for part in [*parts, base]:
        if run_dir is None or not (part / OWNER).exists() or owned_by(part, run_dir):
            _empty_tier(part)
    if base.parent == default_root():
        _rmdir(base.parent)


def sweep_stale(roots: list[Path], keep: Path | None) -> list[Path]:
    """Remove, under each root, the local tiers of runs that ended without removing theirs
    (_stale), except keep (this run's base). The tiers removed (each node's part on its own)."""
    removed: list[Path] = []
    for root in dict.fromkeys(roots):
        try:
            bases = [path for path in root.iterdir() if path.is_dir() and not path.is_symlink()]
        except OSError:
            continue
        for base in bases:
            if keep is not None and base == keep:
                continue
            try:
                parts = [base, *(p for p in base.iterdir() if _NODE.fullmatch(p.name) and p.is_dir() and not p.is_symlink())]
            except OSError:
                continue
            stale = [part for part in parts if (part / OWNER).exists() and _stale(part)]
            for part in stale:
                _empty_tier(part)
                removed.append(part)
            if stale and base.exists():
                _rmdir(base)
        if root == default_root() and removed:
            _rmdir(root)
    return removed
