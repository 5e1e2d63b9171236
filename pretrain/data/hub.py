"""Hugging Face Hub datasets: which of a dataset's files a run uses, and fetching only those.

A Hub dataset is often far larger than a run reads (FineWeb-Edu's sample/10BT: 14 Parquet files,
28.5 GB, ~10B GPT-2 tokens). data.hub_max_files takes the first N files matching data.hub_files
in name order. When it is null, choose_hub_files estimates N from the run's length and the files'
sizes; the launcher calls it once, before any worker starts, and writes the number (and later
the commit, see fitting.py) into the config the workers get, so every rank prepares exactly the
same files.

The files are listed by the Hub (names and sizes) when it can be reached, else read from the Hub
cache: offline, a run can use only what is cached, and a dataset that is not cached at all stops
the run with one line saying how to fetch it.

No torch here; huggingface_hub is imported only when a Hub source is used.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import glob
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pretrain import registry
from pretrain.config.schema import SHARD_SOURCES
from pretrain.data import DataError, first_line
from pretrain.data.formats import file_format
from pretrain.data.hub_client import (
    LOCAL_FILES_INSTEAD,
    access_error,
    download_command,
    hub_snapshot,
    is_commit,
    offline_error,
)
from pretrain.data.windows import token_count

if TYPE_CHECKING:
    from huggingface_hub import HfApi

    from pretrain.config import Config, DataConfig

GZIP_TOKENS_PER_BYTE = 0.3
"""Tokens per byte of a gzipped file, as Parquet's (compressed text; gzip packs more). Each format's
own figure is in pretrain/registry.py (TEXT_FORMATS), low on purpose (a low value fetches more
files, never too few), to estimate how many files a run reads. Parquet: FineWeb-Edu's
sample/10BT holds 10B GPT-2 tokens in 28.5 GB (0.35), and Llama-3's larger vocabulary makes ~15%
fewer tokens of the same text. Plain text and JSON Lines: English is ~4 bytes per token."""
MARGIN = 1.1
"""The estimate of the tokens needed is raised by this much before counting files."""

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


# --- listing --------------------------------------------------------------------------------------


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


def find_files(cfg: DataConfig, preset: str | None = None, world_size: int = 1) -> HubFiles:
    """The files of cfg's Hub dataset matching data.hub_files: listed by the Hub, else (offline)
    those in the Hub cache. A pinned commit whose cache already holds the files needed asks
    nothing. DataError when there are none."""
    repo, revision, pattern = cfg.hub_repo, cfg.hub_revision, cfg.hub_files
    try:
        found = matching_files(repo, revision, pattern, cfg.hub_max_files)
    except Unreachable as error:
        raise not_cached_error(cfg, preset, world_size, str(error)) from None
    if not found.files:
        where = "" if found.online else " in the Hugging Face cache (the Hub cannot be reached)"
        raise DataError(
            f"data.hub_files: no .parquet, .jsonl, .json or .txt file of dataset {repo}@{revision}"
            f"{where} matches {pattern!r}; set data.hub_files to a pattern of its data files"
        )
    return found


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


def not_cached_error(cfg: DataConfig, preset: str | None, world_size: int, reason: str) -> DataError:
    ranks = f" --world-size {world_size}" if world_size > 1 else ""
    prepare = (
        (
            f"`python3 prepare_dataset.py --preset {preset}{ranks}` (with this run's other options: only the "
            "files it needs, and the tokenizer) or "
        )
        if preset
        else ""
    )
    return offline_error(
        f"dataset {cfg.hub_repo}{'' if cfg.hub_revision == 'main' else '@' + cfg.hub_revision} ({cfg.hub_files})",
        prepare + download_command(cfg.hub_repo, cfg.hub_revision, "dataset", include=[include_pattern(cfg.hub_files)]),
        LOCAL_FILES_INSTEAD,
        reason,
    )


# --- the files a run uses -------------------------------------------------------------------------


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


def run_tokens(config: Config, world_size: int) -> int | None:
    """Tokens the run reads (steps x batch x context x accumulation x ranks); None when it is set
    in epochs (it reads everything prepared, however much)."""
    from pretrain.config import batch_split

    t = config.training
    if t.epochs > 0:
        return None
    batch, accum = batch_split(config, world_size)  # grad_accum_nums "auto": any split, the same global batch
    return t.max_steps * batch * config.data.context_length * accum * world_size


def estimated_tokens(name: str, size: int) -> float:
    if name.endswith(".gz"):
        return size * GZIP_TOKENS_PER_BYTE
    return size * registry.TEXT_FORMATS[file_format(name) or "text"].tokens_per_byte


def files_for_tokens(files: list[tuple[str, int]], tokens: int, val_fraction: float) -> int:
    """How many of files (in order) hold the tokens a run reads, its validation share and MARGIN
    (all of them when even that is too few)."""
    wanted = tokens / (1 - val_fraction) * MARGIN
    held = 0.0
    for count, (name, size) in enumerate(files, 1):
        held += estimated_tokens(name, size)
        if held >= wanted:
            return count
    return len(files)


def choose_hub_files(config: Config, world_size: int, log: Log) -> Config:
    """config with data.hub_max_files made concrete for a Hub source: the number of files this run
    uses, every rank alike. Lists the files (Hub, else cache) but downloads nothing."""
    from pretrain.data.hub_shards import choose_hub_shards

    data = config.data
    if data.source in SHARD_SOURCES:
        return choose_hub_shards(config, world_size, log)  # an hf:// data.path; others unchanged
    if data.source != "hub" or data.hub_max_files:  # set by the user, or by the launcher for its workers
        return config
    found = find_files(data, config.preset, world_size)
    where = f"dataset {data.hub_repo}: {len(found.files)} file(s) match {data.hub_files}"
    if not found.online:
        where += " in the Hugging Face cache (the Hub cannot be reached)"
    if data.hub_max_files == 0 or (tokens := run_tokens(config, world_size)) is None:
        count, why = len(found.files), "all of them (data.hub_max_files 0, or a run set in epochs)"
    else:
        count = files_for_tokens(found.files, tokens, data.val_fraction)
        held = sum(estimated_tokens(*f) for f in found.files[:count])
        why = (
            f"the run reads {token_count(tokens)} tokens, these hold ~{token_count(round(held))} (estimated "
            "from their size); data.hub_max_files sets the count"
        )
        if held < tokens / (1 - data.val_fraction) * MARGIN:
            why += "; too few for the run, which will repeat its data"
            if not found.online:
                why += (
                    f" (fetch more where there is network: `python3 prepare_dataset.py --preset "
                    f"{config.preset}` with this run's options, then copy the Hugging Face cache here)"
                )
    log(f"{where}; using the first {count} ({byte_count(sum(s for _, s in found.files[:count]))}): {why}")
    return dataclasses.replace(config, data=dataclasses.replace(data, hub_max_files=count))


def follow_checkpoint(config: Config) -> Config:
    """config reading the same Hub files as the checkpoint it resumes (training.resume, a path
    once resolved): data.hub_max_files and data.hub_revision (for shards, the commit in an hf://
    data.path: hub_shards.follow_checkpoint_shards) come from the checkpoint's config unless set
    here. Without this, a resume with more steps or another number of GPUs would size the
    download anew, prepare other files, and continue at a data position that means other
    windows (pretrain/checkpoint/save_restore.py refuses such a resume of a Hub text dataset)."""
    from pretrain.config import ConfigError, DataConfig, load
    from pretrain.data.hub_shards import follow_checkpoint_shards, is_hub_path

    data, resume = config.data, config.training.resume
    shards_on_hub = data.source in SHARD_SOURCES and is_hub_path(data.path)
    if (
        not (data.source == "hub" or shards_on_hub)
        or not resume
        or resume == "auto"
        or not (Path(resume) / "config.json").is_file()
    ):
        return config
    try:
        saved = load(Path(resume) / "config.json").data
    except ConfigError:
        return config  # restoring it says what is wrong with it
    if shards_on_hub:
        return dataclasses.replace(config, data=follow_checkpoint_shards(data, saved))
    if (saved.source, saved.hub_repo, saved.hub_files) != (data.source, data.hub_repo, data.hub_files):
        return config
    changes: dict[str, Any] = {}
    if data.hub_max_files is None and saved.hub_max_files is not None:
        changes["hub_max_files"] = saved.hub_max_files
    if data.hub_revision == DataConfig().hub_revision and is_commit(saved.hub_revision):
        changes["hub_revision"] = saved.hub_revision
    return dataclasses.replace(config, data=dataclasses.replace(data, **changes)) if changes else config
