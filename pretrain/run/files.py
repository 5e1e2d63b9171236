"""Files of a run: the run directory and atomic writes. Standard library only."""

from __future__ import annotations

import contextlib
import os
import secrets
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

PACKAGE_ROOT = Path(__file__).resolve().parents[2]
"""The directory that holds the launcher and pretrain packages: a clone's root, or site-packages."""
RUNS_DIR_VAR = "PRETRAIN_RUNS_DIR"
"""Where new run directories go (runs/<run-id>/); default: runs/ in the current directory."""
CACHE_DIR_VAR = "PRETRAIN_CACHE_DIR"
"""Where prepared datasets and compiled kernels go; default: cache/ in the current directory."""


def runs_root() -> Path:
    """The directory new runs go into: $PRETRAIN_RUNS_DIR, else ./runs (absolute)."""
    return _root(RUNS_DIR_VAR, "runs")


def cache_root() -> Path:
    """The cache directory (datasets, tokenizers, compiled kernels): $PRETRAIN_CACHE_DIR, else ./cache."""
    return _root(CACHE_DIR_VAR, "cache")


def _root(variable: str, default: str) -> Path:
    # Read at every call, not at import: the launcher's --runs-dir/--cache-dir set the variables.
    return Path(os.environ.get(variable) or default).expanduser().resolve()


def cache_path(path: str | Path) -> Path:
    """A cache path from the config (data.cache_dir): absolute as given, a relative one under the
    cache root. A leading cache/ names the root itself, so the default cache/datasets is
    <cache root>/datasets (./cache/datasets when no root is set, as before roots existed)."""
    path = Path(path).expanduser()
    if path.is_absolute():
        return path
    parts = path.parts[1:] if path.parts[:1] == ("cache",) else path.parts
    return cache_root().joinpath(*parts)


def os_error_message(error: OSError) -> str:
    """One line for a failed file operation: '/path: Permission denied'."""
    reason = error.strerror or str(error)
    return f"{error.filename}: {reason}" if error.filename else reason


@contextlib.contextmanager
def naming(path: str | Path) -> Iterator[None]:
    """Within: an OSError that names no file gets path as its filename. A failed write or flush
    (ENOSPC: a full disk, EIO, EDQUOT) raises one without it, and os_error_message then could
    not say which file."""
    try:
        yield
    except OSError as error:
        if error.filename is None:
            error.filename = str(path)
        raise


def is_file_at(fd: int, path: Path) -> bool:
    """Whether the open file fd is still the file at path. A lock file that its holder deletes
    as it lets go (pretrain/data/cache.py build_lock, launcher/rundir/lock.py) counts only while it
    is: a waiter that got the lock of a file deleted meanwhile must lock the path's new file."""
    try:
        here = os.stat(path)
    except FileNotFoundError:
        return False
    opened = os.fstat(fd)
    return (here.st_dev, here.st_ino) == (opened.st_dev, opened.st_ino)


def atomic_write(path: Path, write: Callable[[Path], object], mode: int = 0o644) -> None:
    """Create or replace path so readers see the old file or the whole new one, never a part.

    write(tmp) fills a temporary file in path's directory (a rename is atomic only within one
    file system); it is flushed to disk, given mode (mkstemp makes it 0600, and run files are
    meant to be read by others) and renamed over path. On any failure, path is untouched and
    the temporary file is removed."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    tmp = Path(name)
    try:
        with naming(path):  # the file meant, not its temporary name
            write(tmp)
            fsync(tmp)
        os.chmod(tmp, mode)
        try:
            os.replace(tmp, path)
        except OSError as error:  # named after the file meant (a directory in its place), not the temporary one
            raise OSError(error.errno, error.strerror, str(path)) from None
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    _fsync_directory(path.parent)


def fsync(path: Path) -> None:
    """Flush a file's (or a directory's) data to disk; a read-only descriptor is enough on POSIX."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_directory(path: Path) -> None:
    """Make a rename in path survive a crash. Best effort: some file systems (network mounts)
    refuse to fsync a directory, and the new file is in place by then either way."""
    with contextlib.suppress(OSError):
        fsync(path)


def atomic_write_text(path: Path, text: str) -> None:
    """Write text (UTF-8) to path atomically (atomic_write)."""
    atomic_write(path, lambda tmp: tmp.write_text(text, encoding="utf-8"))


def new_run_id() -> str:
    """Sortable and unique: 20261121-071502-3fa2."""
    return time.strftime("%Y%m%d-%H%M%S") + "-" + secrets.token_hex(2)


def create_run_dir(run_dir: str | Path | None) -> Path:
    """Create the run directory (default <runs root>/<run-id>/) and its logs/.

    Raises OSError with the path when it cannot be created or written."""
    path = Path(run_dir).expanduser().resolve() if run_dir else runs_root() / new_run_id()
    (path / "logs").mkdir(parents=True, exist_ok=True)
    if not os.access(path, os.W_OK):
        raise PermissionError(f"{path}: run directory is not writable")
    return path
