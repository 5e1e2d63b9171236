"""The cache of prepared datasets: checking one, and replacing one safely.

A prepared dataset is a directory holding meta.json (format FORMAT_VERSION) and the files it
lists, each with its size and sha256. Checking one is cheap (inspect_dataset reads meta.json and
stats the files); verify re-hashes them. Builds go into a temporary directory beside the final
one, hold `<final>.lock` while they run (deleted when let go: build_lock), and are renamed into
place (replace_dir), so the final name only ever holds a complete dataset. What goes into a
dataset is prepare.py's business.

Standard library only: the launcher imports this and has to start fast.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from pretrain.data import DataError
from pretrain.data.tokenizer import file_sha256
from pretrain.data.windows import DTYPES, REBUILD_HINT
from pretrain.run.exit_codes import by_signal
from pretrain.run.files import fsync, is_file_at, naming
from pretrain.run.raising_signals import signals_raise
from pretrain.run.shared_cache import mode_in

FORMAT_VERSION = 2
SPLITS = ("train", "val")
META_FILE = "meta.json"

Log = Callable[[str], None]


@contextmanager
def sigterm_as_exit() -> Iterator[None]:
    """Within: SIGTERM or SIGHUP (a closed terminal) raises SystemExit(by_signal(signal): 143, 129),
    so a build that is stopped removes its temporary directory (possibly gigabytes) instead of
    leaving it in the cache. For entry points, in the main thread; the previous handlers come
    back afterwards. (SIGINT already raises KeyboardInterrupt.) A signal that lands in a finalizer,
    where Python drops what it raises, is sent again (pretrain/run/raising_signals.py)."""
    with signals_raise((signal.SIGTERM, signal.SIGHUP), lambda signum: SystemExit(by_signal(signum))):
        yield


def verify(dataset_dir: str | Path) -> None:
    """Check a prepared dataset completely, the sha256 of every file it uses included.

    Raises DataError naming the first problem found."""
    dataset_dir = Path(dataset_dir)
    try:
        meta = _load_meta(dataset_dir)
        _check_files(dataset_dir, meta)
        for name, expected in meta["files"].items():
            actual = file_sha256(dataset_dir / name)
            if actual != expected["sha256"]:
                raise _Damage(
                    f"{name} does not match its sha256 in meta.json (expected {expected['sha256'][:12]}..., got {actual[:12]}...)"
                )
    except _Damage as damage:
        raise DataError(f"{dataset_dir}: {damage}; {REBUILD_HINT}") from None


def read_meta(dataset_dir: str | Path) -> dict[str, Any]:
    """The parsed meta.json of a prepared dataset; DataError when it is missing or unreadable."""
    dataset_dir = Path(dataset_dir)
    try:
        return _load_meta(dataset_dir)
    except _Damage as damage:
        raise DataError(f"{dataset_dir}: not a usable prepared dataset ({damage}); {REBUILD_HINT}") from None


@contextmanager
def build_lock(final: Path, log: Log) -> Iterator[None]:
    """Hold `<final>.lock` (flock: the kernel frees it when the holder dies, however it dies);
    say so when waiting, or a waiting rank looks hung.

    The holder deletes the file before it lets go, so no empty `.lock` stays beside every cache
    entry. That is safe because a lock counts only while its file is still the one at the path:
    a waiter that gets the lock of a file deleted meanwhile locks the path's new file instead
    (below), so two processes never both hold `<final>.lock`. And a process that comes after the
    deletion finds the entry complete: it appears by an atomic rename (replace_dir) before the
    lock is let go, and every holder checks completeness again under the lock."""
    import fcntl  # here: a cache hit does not need it

    path = Path(f"{final}.lock")
    waiting = False
    while True:
        fd = _open_lock_file(path)
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                if not waiting:
                    log(f"dataset: waiting for another process to finish preparing {final}")
                    waiting = True
                fcntl.flock(fd, fcntl.LOCK_EX)
            if is_file_at(fd, path):
                break
        except BaseException:
            os.close(fd)
            raise
        os.close(fd)  # its holder deleted that file: lock the one at the path now
    try:
        yield
    finally:
        try:
            path.unlink()  # while still held: see above
        except OSError:
            pass  # gone already, or a read-only directory: a file left behind is harmless
        os.close(fd)


def _open_lock_file(path: Path) -> int:
    """Open path read-only (flock needs no write access), creating it when missing. An existing
    one is opened without O_CREAT: in a sticky shared directory (/tmp-like), Linux refuses
    O_CREAT on another user's file where fs.protected_regular is set, though reading it is allowed.
    A file this process creates follows the directory's sharing, so other users can open it."""
    while True:
        try:
            return os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            pass
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CREAT | os.O_EXCL, 0o666)
        except FileExistsError:
            continue  # another process created it just now: open theirs
        try:
            if (mode := mode_in(path.parent, is_dir=False)) is not None:
                os.fchmod(fd, mode)  # the file opened, whatever is at the path by now
        except BaseException:
            os.close(fd)
            raise
        return fd


# --- checking a cache -------------------------------------------------------------------------


class _Damage(Exception):
    """What is wrong with a cache directory, as a short phrase."""


def inspect_dataset(dataset_dir: Path, key: dict[str, Any]) -> tuple[dict[str, Any] | None, str]:
    """(meta, "") when dataset_dir holds a complete dataset for key, else (None, what is wrong).
    Reads meta.json and stats files: cheap whatever the size."""
    if not dataset_dir.is_dir():
        return None, "not built"
    try:
        meta = _load_meta(dataset_dir)
        if meta["key"] != json.loads(json.dumps(key)):
            raise _Damage("meta.json was built from other inputs")
        _check_files(dataset_dir, meta)
    except _Damage as damage:
        return None, str(damage)
    return meta, ""


def _load_meta(dataset_dir: Path) -> dict[str, Any]:
    path = dataset_dir / META_FILE
    try:
        meta = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise _Damage("meta.json is missing") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise _Damage(f"meta.json is unreadable ({error})") from None
    if not isinstance(meta, dict):
        raise _Damage("meta.json is not a JSON object")
    if meta.get("format_version") != FORMAT_VERSION:
        raise _Damage(f"meta.json has format_version {meta.get('format_version')!r}, expected {FORMAT_VERSION}")
    for field, kind in (("key", dict), ("files", dict), ("splits", dict), ("tokens", dict), ("vocab_size", int)):
        if not isinstance(meta.get(field), kind):
            raise _Damage(f"meta.json has no valid {field}")
    for split in SPLITS:
        if not _is_count(meta["tokens"].get(split)):
            raise _Damage(f"meta.json has no token count for {split}")
    for name, recorded in meta["files"].items():
        if not (isinstance(recorded, dict) and _is_count(recorded.get("bytes")) and isinstance(recorded.get("sha256"), str)):
            raise _Damage(f"meta.json has no size and sha256 for {name}")
    for split in SPLITS:
        segments = meta["splits"].get(split)
        if not isinstance(segments, list) or not segments:
            raise _Damage(f"meta.json has no segments for {split}")
        for segment in segments:
            if (
                not isinstance(segment, dict)
                or segment.get("dtype") not in DTYPES
                or not all(isinstance(segment.get(f), int) for f in ("offset", "tokens"))
                or not isinstance(segment.get("file"), str)
            ):
                raise _Damage(f"meta.json has a malformed {split} segment")
    return meta


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _check_files(dataset_dir: Path, meta: dict[str, Any]) -> None:
    """Every file meta.json lists exists with its recorded size, and every segment lies in one."""
    for name, recorded in meta["files"].items():
        path = dataset_dir / name
        try:
            size = path.stat().st_size
        except FileNotFoundError:
            raise _Damage(f"{name} is missing") from None
        if size != recorded["bytes"]:
            raise _Damage(f"{name} has {size} bytes, expected {recorded['bytes']}")
    for split in SPLITS:
        for segment in meta["splits"][split]:
            recorded = meta["files"].get(segment["file"])
            end = segment["offset"] + segment["tokens"] * DTYPES[segment["dtype"]].itemsize
            if recorded is None or end > recorded["bytes"]:
                raise _Damage(f"a {split} segment reaches past the end of {segment['file']}")


# --- files ------------------------------------------------------------------------------------


def write_synced(path: Path, data: bytes) -> None:
    with naming(path), open(path, "wb") as file:  # a failed write's OSError names no file
        file.write(data)
        file.flush()
        os.fsync(file.fileno())


def replace_dir(new: Path, final: Path) -> None:
    """Move new to final; an existing final is moved aside first and deleted afterwards, so
    the final name never holds a partly deleted or partly written dataset."""
    old = final.parent / f".{final.name}.old-{os.getpid()}-{secrets.token_hex(4)}"
    if final.exists():
        os.rename(final, old)
    os.rename(new, final)
    fsync(final.parent)
    shutil.rmtree(old, ignore_errors=True)


def remove_leftovers(final: Path) -> None:
    """Delete temporary directories of preparers that died mid-build. Call with the lock held:
    then no live preparer is using any of them."""
    for pattern in (f".{final.name}.tmp-*", f".{final.name}.old-*"):
        for leftover in final.parent.glob(pattern):
            shutil.rmtree(leftover, ignore_errors=True)
