"""A Hugging Face Hub dataset's files: which of them a pattern names, listed by the Hub (names and
sizes) when it can be reached, else found in the Hub cache, and fetched into that cache.

The level below the choice of files (hub.py for text, hub_shards.py for pre-tokenized shards):
it knows patterns, commits, the cache and the Hub, but no config. A download goes through
hub_process.py (a child process that a stop signal ends at once); errors are said in one line
by hub_client.py.

No torch here; huggingface_hub is imported only when a Hub source is used.
"""

from __future__ import annotations

import fnmatch
import glob
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from pretrain.data import DataError, first_line
from pretrain.data.formats import file_format
from pretrain.data.hub_client import access_error, download_command, is_commit, offline_error
from pretrain.data.hub_process import hub_snapshot

if TYPE_CHECKING:
    from huggingface_hub import HfApi

Log = Callable[[str], None]


@dataclass(frozen=True)
class HubFiles:
    """The files of a Hub dataset that match a pattern, in name order."""

    commit: str
    files: list[tuple[str, int]]
    """(path in the repository, bytes)."""
    online: bool
    """Listed by the Hub; False: found in the Hub cache (offline, or the Hub unreachable)."""
    folder: Path | None
    """The cached snapshot of the commit, when there is one."""


# --- listing ---------------------------------------------------------------------------------------


def usable(path: str, pattern: str, suffixes: tuple[str, ...] | None = None) -> bool:
    """A data file (not a README or script) that the pattern names (see named_by)."""
    return named_by(path, pattern) and is_data_file(path, suffixes)


def is_data_file(path: str, suffixes: tuple[str, ...] | None = None) -> bool:
    """A file of a text format, or with one of suffixes when given (pre-tokenized shards)."""
    return path.endswith(suffixes) if suffixes else file_format(path) is not None


def named_by(path: str, pattern: str) -> bool:
    """Whether pattern names the file at path: a glob that matches it, or, as a local path does,
    the file itself or a directory above it (a pattern without wildcards)."""
    if fnmatch.fnmatch(path, pattern):
        return True
    return not glob.has_magic(pattern) and path.startswith(pattern.rstrip("/") + "/")


def is_directory(pattern: str, suffixes: tuple[str, ...] | None = None) -> bool:
    """A pattern that can only name a directory: no wildcards, and not a data file's name."""
    return not glob.has_magic(pattern) and (pattern.endswith("/") or not is_data_file(pattern, suffixes))


def include_pattern(pattern: str, suffixes: tuple[str, ...] | None = None) -> str:
    """What `hf download --include` takes to fetch the files pattern names: a directory's files
    (DIR/*: hf's globs match at any depth), else the pattern itself."""
    return f"{pattern.rstrip('/')}/*" if is_directory(pattern, suffixes) else pattern


def cached_files(repo: str, revision: str, pattern: str, suffixes: tuple[str, ...] | None = None) -> HubFiles | None:
    """The matching files in the Hub cache's snapshot of revision (perhaps none); None when the
    cache holds no snapshot of it."""
    from huggingface_hub import constants
    from huggingface_hub.file_download import repo_folder_name

    storage = Path(constants.HF_HUB_CACHE) / repo_folder_name(repo_id=repo, repo_type="dataset")
    commit = revision
    if not is_commit(revision):
        ref = storage / "refs" / revision
        if not ref.is_file():
            return None
        commit = ref.read_text().strip()
    folder = storage / "snapshots" / commit
    if not folder.is_dir():
        return None
    files = sorted(
        (p.relative_to(folder).as_posix(), p.stat().st_size)
        for p in folder.rglob("*")
        if p.is_file() and usable(p.relative_to(folder).as_posix(), pattern, suffixes)
    )
    return HubFiles(commit, files, online=False, folder=folder)


class Unreachable(Exception):
    """The Hub could not be asked (offline, no network, an error on its side)."""


def listed_files(repo: str, revision: str, pattern: str, suffixes: tuple[str, ...] | None = None) -> HubFiles:
    """The matching files as the Hub lists them, with sizes. Unreachable, or DataError for a
    repository or revision that does not exist."""
    from huggingface_hub import HfApi, errors
    from huggingface_hub.hf_api import RepoFile

    where = f"dataset {repo}@{revision}"
    # List only below the pattern's fixed directories: a large dataset holds thousands of files.
    fixed = []
    for part in pattern.split("/")[:-1]:
        if glob.has_magic(part):
            break
        fixed.append(part)
    api = HfApi()
    try:
        commit = _commit_of(api, repo, revision)
        entries = api.list_repo_tree(
            repo, path_in_repo="/".join(fixed) or None, recursive=True, revision=commit, repo_type="dataset"
        )
        files = sorted((e.path, e.size) for e in entries if isinstance(e, RepoFile) and usable(e.path, pattern, suffixes))
    # RemoteEntryNotFoundError is new in huggingface_hub 1.0 (requirements allow older): an
    # attribute error here would hide every other failure, offline mode included.
    except (errors.EntryNotFoundError, getattr(errors, "RemoteEntryNotFoundError", errors.EntryNotFoundError)):
        # the pattern's directory does not exist
        files = []
    except Exception as error:  # offline mode, no network, the Hub down: the caller falls back to the cache
        raise access_error(error, where) or Unreachable(first_line(error)) from None
    return HubFiles(commit, files, online=True, folder=None)


def _commit_of(api: HfApi, repo: str, revision: str) -> str:
    """The commit a revision of a dataset repository names now."""
    commit = api.repo_info(repo, repo_type="dataset", revision=revision).sha
    if commit is None:  # the Hub always names one; its client types it optional
        raise Unreachable(f"the Hub named no commit for dataset {repo}@{revision}")
    return commit


def matching_files(
    repo: str, revision: str, pattern: str, wanted: int | None, suffixes: tuple[str, ...] | None = None
) -> HubFiles:
    """The files of a dataset matching pattern (see usable): listed by the Hub, else (offline)
    those in the Hub cache. A pinned commit whose cache already holds the wanted count of them
    asks nothing. Unreachable when the Hub cannot be asked and the cache holds no snapshot."""
    cached = cached_files(repo, revision, pattern, suffixes)
    if cached is not None and is_commit(revision) and wanted and len(cached.files) >= wanted:
        return cached  # a commit never changes, and the workers of a run land here
    try:
        return listed_files(repo, revision, pattern, suffixes)
    except Unreachable:
        if cached is None:
            raise
        return cached


# --- fetching --------------------------------------------------------------------------------------


def selected(
    repo: str, pattern: str, wanted: int | None, found: HubFiles, suffixes: tuple[str, ...] | None = None
) -> list[tuple[str, int]]:
    """The first wanted (data.hub_max_files) files (all for 0 or None). Offline, DataError when
    the cache holds fewer than that: a run must not quietly train on less than it was set up for."""
    if wanted and len(found.files) < wanted and not found.online:
        raise DataError(
            f"data.hub_max_files is {wanted}, but the Hugging Face cache holds only {len(found.files)} "
            f"file(s) of dataset {repo} matching {pattern} and the Hub cannot be "
            "reached; lower it, or fetch more where there is network "
            f"({download_command(repo, found.commit, 'dataset', include=[include_pattern(pattern, suffixes)])})"
        )
    return found.files[:wanted] if wanted else list(found.files)


def fetch(repo: str, found: HubFiles, files: list[tuple[str, int]], log: Log | None = None) -> Path:
    """The snapshot folder holding files, downloading those not in the Hub cache yet (said in a
    line to log; a stop signal ends the download at once, see hub_process.py)."""
    if found.folder is not None and all((found.folder / name).is_file() for name, _ in files):
        return found.folder
    if not found.online:
        missing = next(name for name, _ in files if found.folder is None or not (found.folder / name).is_file())
        raise offline_error(
            f"{missing} of dataset {repo}@{found.commit[:12]}",
            download_command(repo, found.commit, "dataset", include=[glob.escape(missing)]),
            "lower data.hub_max_files",
        )
    # Exact names, escaped: only these files are downloaded, whatever else the pattern matches.
    return hub_snapshot(repo, found.commit, [glob.escape(name) for name, _ in files], log=log)


def byte_count(n: int) -> str:
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} bytes"
