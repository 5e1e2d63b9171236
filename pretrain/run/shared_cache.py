"""A cache directory that several users share (mode 1777 like /tmp, or 2775 for a group): what one
user creates in it stays usable by the next, and what cannot work says whose cache it is.

A directory is shared when its group or others may write into it. A directory created in a shared
one gets its mode: its write bits, and its sticky and setgid bits (the umask would otherwise make
it 0755, and the next user could add nothing to it). A file created in one gets its read bits
(everyone who may use the cache reads a prepared dataset and opens its lock files; nobody but its
owner may change it). In a private cache the umask decides, as everywhere.

Standard library only: the launcher imports this.
"""

from __future__ import annotations

import errno
import os
import pwd
import stat
from pathlib import Path

from pretrain.run.files import CACHE_DIR_VAR

SHARED_BITS = stat.S_IWGRP | stat.S_IWOTH
OWNER_FILE_BITS = stat.S_IRUSR | stat.S_IWUSR
READ_BITS = stat.S_IRGRP | stat.S_IROTH
PRIVATE_CACHE_FIX = f"use a cache of your own: --cache-dir DIR or {CACHE_DIR_VAR}=DIR"


def shared_mode(directory: Path) -> int | None:
    """The permission bits of directory when others may write into it (a shared cache), else None."""
    mode = stat.S_IMODE(directory.stat().st_mode)
    return mode if mode & SHARED_BITS else None


def mode_in(parent: Path, is_dir: bool) -> int | None:
    """The permissions a directory (is_dir) or file created in parent gets when parent is shared
    (see the module's docstring); None when it is private: the umask decides."""
    mode = shared_mode(parent)
    if mode is None:
        return None
    return mode if is_dir else OWNER_FILE_BITS | (mode & READ_BITS)


def follow_parent(path: Path) -> None:
    """Give path, just created by this process, the permissions its parent's sharing asks for."""
    mode = mode_in(path.parent, path.is_dir())
    if mode is not None:
        os.chmod(path, mode)


def make_dirs(path: Path) -> None:
    """mkdir -p, each directory it creates following its parent's sharing."""
    missing = []
    while not path.is_dir():
        missing.append(path)
        path = path.parent
    for directory in reversed(missing):
        try:
            directory.mkdir()
        except FileExistsError:
            if not directory.is_dir():
                raise
            continue  # another process made it at the same moment, and makes it follow too
        follow_parent(directory)


def share_entry(directory: Path) -> None:
    """Let a finished cache entry (a dataset's directory, not yet renamed into place) and what it
    holds follow the sharing of the directory it goes into."""
    follow_parent(directory)
    for path in sorted(directory.rglob("*")):  # each directory before what it holds
        follow_parent(path)


def user_name(uid: int) -> str:
    """The login name of uid, or the number where the system knows none (a container's user)."""
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return str(uid)


def owner_of(path: Path) -> int:
    """The owner of path, or of its nearest existing ancestor when path does not exist."""
    while True:
        try:
            return path.stat().st_uid
        except FileNotFoundError:
            if path.parent == path:
                raise
            path = path.parent


def concerns(error: OSError, directory: Path) -> bool:
    """Whether error is one writing into the cache directory (or creating it), one the user fixes
    by choosing another cache: a read-only file system, or a directory that is not theirs."""
    if error.errno not in (errno.EROFS, errno.EACCES, errno.EPERM) or not error.filename:
        return False
    path = Path(os.fsdecode(error.filename))
    return path.is_relative_to(directory) or directory.is_relative_to(path)


def refusal(error: OSError, doing: str) -> str:
    """One line for an error that concerns() a cache: the file, the reason, whose cache it is, and
    the fix. doing says what needed the write ("preparing the dataset (not built)")."""
    path = Path(os.fsdecode(error.filename))
    reason = error.strerror or str(error)
    if error.errno == errno.EROFS:
        return (
            f"{path}: {reason}: {doing} needs a writable cache; prepare it where this cache is writable, or {PRIVATE_CACHE_FIX}"
        )
    owner, me = owner_of(path), os.geteuid()
    if owner != me and path.exists() and (shared_mode(path.parent) or 0) & stat.S_ISVTX:
        return (
            f"{path}: {reason}: {doing} replaces it, and in this shared cache (sticky, like /tmp) only its owner, "
            f"user {user_name(owner)}, may; ask them to rebuild it (--force), or {PRIVATE_CACHE_FIX}"
        )
    if owner != me:
        return (
            f"{path}: {reason}: {doing} writes into the cache, which belongs to user {user_name(owner)} and is not "
            f"shared with {user_name(me)}; {PRIVATE_CACHE_FIX}, or ask {user_name(owner)} to share it "
            "(docs/data.md, 'A cache several users share')"
        )
    return f"{path}: {reason}: {doing} writes into the cache; give yourself write access to it, or {PRIVATE_CACHE_FIX}"
