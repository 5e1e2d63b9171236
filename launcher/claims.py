"""Claims: a launcher holds one lock per GPU it runs on, for the life of the run, so two
launches on one machine never get the same GPU, even when they choose at the same moment.

A claim is an flock on <claims dir>/<GPU UUID>.lock. The kernel drops it when the launcher
exits, however it exits (SIGKILL included), so a crashed launcher leaves no stale claim.
The file also says who holds it (pid, user, since when), for the GPU table. The directory
is shared by every user of the machine (sticky and world-writable, like /tmp), or set by
LAUNCHER_CLAIMS_DIR (a directory every container on the host mounts, for example).
"""

from __future__ import annotations

import errno
import fcntl
import getpass
import json
import os
import stat
import time
from dataclasses import dataclass
from pathlib import Path

CLAIMS_DIR_VAR = "LAUNCHER_CLAIMS_DIR"
DEFAULT_CLAIMS_DIR = Path("/tmp/gpu-launcher-claims")
# A reader of the table takes a shared lock for an instant; a claimer that meets it tries again.
CLAIM_ATTEMPTS = 5
CLAIM_RETRY_DELAY = 0.01


class ClaimError(OSError):
    """The claims directory or a claim file cannot be used (one line)."""


@dataclass(frozen=True)
class Holder:
    """Who holds a claim, as its file says; empty fields when it has not written them yet."""
    pid: int | None = None
    user: str | None = None
    since: str | None = None

    def describe(self) -> str:
        if self.pid is None:
            return "claimed by another launcher"
        return f"claimed by launcher pid {self.pid} ({self.user or '?'}) since {self.since or '?'}"


def claims_dir() -> Path:
    return Path(os.environ.get(CLAIMS_DIR_VAR) or DEFAULT_CLAIMS_DIR)


class Claim:
    """One held GPU claim; release() (or the process's exit) gives it back."""

    def __init__(self, uuid: str, fd: int) -> None:
        self.uuid = uuid
        self._fd: int | None = fd

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing the only descriptor drops the flock
            self._fd = None


def try_claim(uuid: str) -> Claim | Holder:
    """Claim the GPU with this UUID, or say who holds it."""
    fd = _open_claim_file(uuid)
    for attempt in range(CLAIM_ATTEMPTS):
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            break
        except BlockingIOError:
            if attempt + 1 < CLAIM_ATTEMPTS:
                time.sleep(CLAIM_RETRY_DELAY)
    else:
        holder = _read_holder(fd)
        os.close(fd)
        return holder
    record = {"pid": os.getpid(), "user": _user(), "since": time.strftime("%Y-%m-%d %H:%M:%S")}
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, (json.dumps(record) + "\n").encode(), 0)
    except OSError:
        pass  # the record is for people reading the table; the lock is the claim
    return Claim(uuid, fd)


def holder_of(uuid: str) -> Holder | None:
    """Who holds the claim on this GPU, or None when it is free (a look, not a claim)."""
    try:
        fd = _open_claim_file(uuid, create=False)
    except FileNotFoundError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return _read_holder(fd)
    finally:
        os.close(fd)  # drops the shared lock too
    return None


def _open_claim_file(uuid: str, create: bool = True) -> int:
    """A descriptor for the claim file, created readable and writable by everyone. Never
    follows a symlink. Opens without O_CREAT first: in a sticky directory the kernel
    (fs.protected_regular) refuses O_CREAT on another user's existing file."""
    if not uuid or "/" in uuid or uuid.startswith("."):
        raise ClaimError(f"cannot claim a GPU with UUID {uuid!r}")
    directory = _ensure_dir() if create else claims_dir()
    path = directory / f"{uuid}.lock"
    flags = os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC
    for _ in range(3):
        try:
            return os.open(path, flags)
        except FileNotFoundError:
            if not create:
                raise
        except OSError as error:
            raise _claim_error(path, error) from None
        try:
            fd = os.open(path, flags | os.O_CREAT | os.O_EXCL, 0o666)
        except FileExistsError:
            continue  # another launcher created it just now
        except OSError as error:
            raise _claim_error(path, error) from None
        os.fchmod(fd, 0o666)  # the umask must not lock other users out
        return fd
    raise ClaimError(f"cannot open claim file {path}")


def _ensure_dir() -> Path:
    directory = claims_dir()
    try:
        directory.mkdir(exist_ok=True)  # not its parents: they would get this user's umask
        info = directory.lstat()
        if stat.S_ISLNK(info.st_mode):
            raise ClaimError(f"claims directory {directory} is a symlink; set {CLAIMS_DIR_VAR} to the directory itself")
        if not stat.S_ISDIR(info.st_mode):
            raise ClaimError(f"claims directory {directory} is not a directory; remove it or set {CLAIMS_DIR_VAR}")
        if info.st_uid == os.getuid() and stat.S_IMODE(info.st_mode) != 0o1777:
            os.chmod(directory, 0o1777)  # shared by every user, each keeping their own files
    except ClaimError:
        raise
    except OSError as error:
        raise ClaimError(f"cannot use the GPU claims directory {directory}: {error.strerror or error}; "
                         f"create it, or set {CLAIMS_DIR_VAR} to another directory") from None
    return directory


def _claim_error(path: Path, error: OSError) -> ClaimError:
    reason = "it is a symlink" if error.errno == errno.ELOOP else (error.strerror or str(error))
    return ClaimError(f"cannot use GPU claim file {path}: {reason}; "
                      f"fix its permissions or set {CLAIMS_DIR_VAR} to another directory")


def _read_holder(fd: int) -> Holder:
    try:
        record = json.loads(os.pread(fd, 4096, 0).decode(errors="replace"))
        user, since = record.get("user"), record.get("since")
        return Holder(pid=int(record["pid"]), user=None if user is None else str(user),
                      since=None if since is None else str(since))
    except (OSError, ValueError, KeyError, TypeError):
        return Holder()  # being written, or not a record of ours


def _user() -> str:
    try:
        return getpass.getuser()
    except (KeyError, OSError):
        return str(os.getuid())
