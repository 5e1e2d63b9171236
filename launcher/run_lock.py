"""A run directory has one owner: the launcher running in it holds `<run dir>/launcher.lock`
for its whole life, so two launches never write one run's config, checkpoints and metrics.

The lock is flock(2) on that file. The kernel frees it when the holder exits, however it exits
(SIGKILL included), so a killed launcher leaves no stale lock; the file itself stays. The
descriptor is close-on-exec: workers and the guardian never inherit (and so never keep) it.
The holder writes who it is into the file (pid, start time, and the start time in clock ticks
after boot, which with the pid names one process although pids are reused, and the host); a
launch that finds the lock held reads that, to say whom it waits for. flock works across hosts
on NFS (Linux 2.6.12+), hence the host.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import socket
import time
from dataclasses import dataclass
from pathlib import Path

from launcher.claims import started_at
from launcher.reaper import start_time
from pretrain.runfiles import is_file_at

LOCK_NAME = "launcher.lock"
LOOK_TIMEOUT = 1.0  # seconds to wait for a new holder to write who it is


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

    def __init__(self, path: Path, fd: int, made: list[Path], lock_name: str = LOCK_NAME) -> None:
        self.path = path
        self.lock_name = lock_name
        self._fd: int | None = fd
        self._made = made  # what this launch created, innermost first

    def release(self) -> None:
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)

    def abandon(self) -> None:
        """After a launch that ended in an error before it started anything: remove what it
        made here, so a refused or failed launch leaves no empty run directory behind (only
        directories that are empty again; never a file but the lock), then release."""
        if self._fd is None:
            return
        for path in self._made:  # the lock file, logs/, the run directory: in that order
            with contextlib.suppress(OSError):
                if path.name == self.lock_name:
                    path.unlink()  # while still held: a launch that opened it tries again (take)
                else:
                    path.rmdir()  # only when empty
        self.release()


def take(run_dir: Path, lock_name: str = LOCK_NAME) -> RunDirLock | LockHolder:
    """Create the run directory if need be and lock it for this process; or say who holds it.
    OSError when it cannot be created or locked. lock_name: node_lock_name(r) for node r > 0 of
    a job of several nodes, whose launchers share one run directory (a shared filesystem)."""
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
        return RunDirLock(run_dir, fd, made, lock_name)


def node_lock_name(node_rank: int) -> str:
    """The lock a node's launcher holds in a run directory that several nodes share."""
    return LOCK_NAME if node_rank == 0 else f"launcher.node{node_rank}.lock"


def holder_of(run_dir: Path) -> LockHolder | None:
    """Who holds the run directory, or None when it is free (a look, not a lock)."""
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
