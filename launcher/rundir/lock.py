"""A run directory has one owner: the launcher running in it holds `<run dir>/launcher.lock`
for its whole life, so two launches never write one run's config, checkpoints and metrics.

The lock is flock(2) on that file. The kernel frees it when the holder exits, however it exits
(SIGKILL included), so a killed launcher leaves no stale lock; the file itself stays. The
descriptor is close-on-exec: workers and the guardian never inherit (and so never keep) it.
The holder writes who it is into the file (pid, start time, and the start time in clock ticks
after boot, which with the pid names one process although pids are reused, and the host); a
launch that finds the lock held reads that, to say whom it waits for. flock works across hosts
on NFS (Linux 2.6.12+), hence the host.

A lock file can be deleted with its directory while its holder runs, and a second launch would
then lock a new one. So the holder also holds a claim that does not live in the directory: an
abstract Unix socket named from the directory's absolute path and the lock's name
(launcher/gpus/claims.py: bound atomically, freed by the kernel when the holder exits, never
inherited by its children, its holder told by the kernel). It is one machine's: across hosts
the file lock alone guards a shared directory. And the holder watches its directory (check_held,
from the supervisor's loop): when the directory or the lock file is gone or is another one (its
device and inode changed), the run stops at once (RunDirLost, exit 74), for anything its workers
wrote there from then on would recreate the directory without its lock, logs and config, or mix
with another run's files.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import socket
import time
import weakref
from dataclasses import dataclass
from pathlib import Path

from launcher.gpus import claims
from launcher.gpus.claims import Claim, ClaimError, started_at
from launcher.errors import UsageError
from launcher.exit_codes import EXIT_RUN_DIR_LOST
from launcher.processes.reaper import start_time
from pretrain.run.files import is_file_at

LOCK_NAME = "launcher.lock"
LOOK_TIMEOUT = 1.0  # seconds to wait for a new holder to write who it is


class RunDirLost(UsageError):
    """The run directory, or its lock file, is gone or another one: the run stopped at once (one line)."""

    exit_code = EXIT_RUN_DIR_LOST


@dataclass(frozen=True)
class LockHolder:
    """Who holds a run directory, as its lock file says; None where it does not say."""

    pid: int | None = None
    started: str | None = None
    start_ticks: int | None = None
    host: str | None = None

    @property
    def elsewhere(self) -> bool:
        return self.host is not None and self.host != socket.gethostname()

    @property
    def current(self) -> bool:
        """Whether the process the file names is the one alive now (always so on another host,
        where this cannot be checked). Not so: the file still names a holder that has ended and
        the lock's new holder has not written itself yet."""
        return self.pid is not None and (self.elsewhere or start_time(self.pid) == self.start_ticks)

    def describe(self) -> str:
        if self.pid is None:
            return "another launcher"
        where = f" on {self.host}" if self.elsewhere else ""
        started = f" (started {self.started})" if self.started else ""
        return f"the launcher pid {self.pid}{where}{started}"


class RunDirLock:
    """A held run directory; release() (or the launcher's exit) frees it."""

    def __init__(self, path: Path, fd: int, made: list[Path], lock_name: str = LOCK_NAME, claim: Claim | None = None) -> None:
        self.path = path
        self.lock_name = lock_name
        self._fd: int | None = fd
        self._made = made  # what this launch created, innermost first
        self._claim = claim
        self._directory = _identity(os.stat(path))
        self._lock_file = _identity(os.fstat(fd))
        _HELD.add(self)

    def lost(self) -> str | None:
        """Why the run directory is no longer this holder's, in words that name it; None while it is."""
        lock = self.path / self.lock_name
        try:
            directory = _identity(os.stat(self.path))
        except OSError:
            return f"run directory {self.path} was deleted or moved away"
        if directory != self._directory:
            return f"run directory {self.path} was deleted or moved away, and another directory made in its place"
        try:
            lock_file = _identity(os.lstat(lock))
        except OSError:
            return f"its lock file {lock} was deleted, so that another launch could take the run directory"
        if lock_file != self._lock_file:
            return f"its lock file {lock} was replaced by another file"
        return None

    def check(self) -> None:
        """RunDirLost when the run directory is no longer this holder's (lost); nothing there
        is then this launch's to remove (abandon)."""
        if (why := self.lost()) is None:
            return
        self._made = []
        raise RunDirLost(
            f"{why} while the run was live; stopped every worker at once, without a checkpoint (writing one "
            "would recreate the directory without its lock, logs and config, or mix with another run's files)"
        )

    def release(self) -> None:
        fd, self._fd = self._fd, None
        claim, self._claim = self._claim, None
        _HELD.discard(self)
        if fd is not None:
            os.close(fd)
        if claim is not None:
            claim.release()

    def abandon(self) -> None:
        """After a launch that ended in an error before it started anything: remove what it
        made here, so a refused or failed launch leaves no empty run directory behind (only
        directories that are empty again; never a file but the lock), then release."""
        if self._fd is None:
            return
        if self.lost() is not None:
            self._made = []  # what is there now is not what this launch made
        for path in self._made:  # the lock file, logs/, the run directory: in that order
            with contextlib.suppress(OSError):
                if path.name == self.lock_name:
                    path.unlink()  # while still held: a launch that opened it tries again (take)
                else:
                    path.rmdir()  # only when empty
        self.release()


_HELD: weakref.WeakSet[RunDirLock] = weakref.WeakSet()
"""The run directory locks this process holds (one let go of without release() drops out)."""


def check_held(run_dir: Path | None) -> None:
    """RunDirLost when this process holds run_dir and it is no longer its own: the directory or
    its lock file was deleted, moved or replaced (RunDirLock.lost). For the supervisor's loop:
    two stat calls."""
    for held in list(_HELD):
        if held.path == run_dir:
            held.check()


def take(run_dir: Path, lock_name: str = LOCK_NAME) -> RunDirLock | LockHolder:
    """Create the run directory if need be and lock it for this process; or say who holds it.
    OSError when it cannot be created or locked. lock_name: node_lock_name(r) for node r > 0 of
    a job of several nodes, whose launchers share one run directory (a shared filesystem)."""
    try:
        claim = claims.try_claim(claim_id(run_dir, lock_name))
    except ClaimError as error:
        raise OSError(f"cannot lock it: {error}") from None
    if isinstance(claim, claims.Holder):  # first: a launcher whose lock file was deleted holds this still
        return _holder_from_claim(claim)
    try:
        taken = _take_file(run_dir, lock_name, claim)
    except BaseException:
        claim.release()
        raise
    if isinstance(taken, LockHolder):
        claim.release()
    return taken


def _take_file(run_dir: Path, lock_name: str, claim: Claim) -> RunDirLock | LockHolder:
    path = run_dir / lock_name
    made: list[Path] = []
    deadline = time.monotonic() + LOOK_TIMEOUT
    while True:
        made += _make_dir(run_dir)  # again if a launch that gave it up (abandon) removed it meanwhile
        had_logs, existed = (run_dir / "logs").exists(), path.exists()
        try:
            # O_NOFOLLOW: never truncate whatever file a planted symlink points to
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o644)
        except FileNotFoundError:
            if run_dir.is_dir():
                raise
            continue  # removed again meanwhile, as above
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _read(fd)
            os.close(fd)
            if holder.current or time.monotonic() > deadline:
                return holder
            time.sleep(0.01)  # the new holder is writing who it is
            continue
        except BaseException:
            os.close(fd)
            raise
        if not is_file_at(fd, path):
            os.close(fd)  # its last holder removed it (abandon) after we opened it: lock the new one
            continue
        _write_self(fd)
        # create_run_dir makes logs/ next; abandon() removes it again while empty
        made = ([] if existed else [path]) + ([] if had_logs else [run_dir / "logs"]) + made
        try:
            return RunDirLock(run_dir, fd, made, lock_name, claim)
        except BaseException:  # the directory went again before it could be watched
            os.close(fd)
            raise


def node_lock_name(node_rank: int) -> str:
    """The lock a node's launcher holds in a run directory that several nodes share."""
    return LOCK_NAME if node_rank == 0 else f"launcher.node{node_rank}.lock"


def claim_id(run_dir: Path, lock_name: str) -> str:
    """The name of the claim a holder of run_dir's lock lock_name holds besides it: a digest of
    the directory's absolute path and the lock's name (a claim name is short, and plain)."""
    where = f"{Path(os.path.abspath(run_dir))}/{lock_name}".encode(errors="surrogateescape")
    return "run-" + hashlib.sha256(where).hexdigest()[:40]


def _holder_from_claim(holder: claims.Holder) -> LockHolder:
    ticks = start_time(holder.pid) if holder.pid is not None else None
    return LockHolder(pid=holder.pid, started=holder.since, start_ticks=ticks, host=socket.gethostname())


def holder_of(run_dir: Path) -> LockHolder | None:
    """Who holds the run directory, or None when it is free (a look, not a lock)."""
    try:
        claimed = claims.holder_of(claim_id(run_dir, LOCK_NAME))
    except ClaimError:
        claimed = None
    if claimed is not None:
        return _holder_from_claim(claimed)
    try:
        fd = os.open(run_dir / LOCK_NAME, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
    except (FileNotFoundError, NotADirectoryError):
        return None
    try:
        deadline = time.monotonic() + LOOK_TIMEOUT
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = _read(fd)
                if holder.current or time.monotonic() > deadline:
                    return holder
                time.sleep(0.01)
                continue
            fcntl.flock(fd, fcntl.LOCK_UN)
            return None
    finally:
        os.close(fd)


def _make_dir(run_dir: Path) -> list[Path]:
    """Create run_dir and missing parents; return those it created, innermost first."""
    missing = []
    for path in [run_dir, *run_dir.parents]:
        if path.exists():
            break
        missing.append(path)
    run_dir.mkdir(parents=True, exist_ok=True)
    return missing[:1]  # parents (runs/, say) stay: other runs may go there at the same moment


def _identity(info: os.stat_result) -> tuple[int, int]:
    return info.st_dev, info.st_ino


def _write_self(fd: int) -> None:
    pid = os.getpid()
    record = {"pid": pid, "started": started_at(pid), "start_ticks": start_time(pid), "host": socket.gethostname()}
    data = (json.dumps(record, indent=2) + "\n").encode()
    os.ftruncate(fd, 0)
    os.pwrite(fd, data, 0)


def _read(fd: int) -> LockHolder:
    """What the lock file says; an empty LockHolder while it is being (re)written."""
    try:
        record = json.loads(os.pread(fd, 4096, 0))
        pid, ticks = record["pid"], record.get("start_ticks")
        if not isinstance(pid, int) or not (ticks is None or isinstance(ticks, int)):
            return LockHolder()
        started, host = record.get("started"), record.get("host")
        return LockHolder(
            pid=pid,
            start_ticks=ticks,
            started=started if isinstance(started, str) else None,
            host=host if isinstance(host, str) else None,
        )
    except (OSError, ValueError, KeyError, TypeError):
        return LockHolder()
