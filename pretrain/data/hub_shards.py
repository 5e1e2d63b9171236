"""Pre-tokenized shards in a Hugging Face dataset, named by a path hf://datasets/OWNER/NAME/PATTERN
(hf://datasets/OWNER/NAME@REVISION/PATTERN for a branch, tag or commit other than main), as
modded-nanogpt's cached_fineweb10B.py fetches kjj0/fineweb10B-gpt2's fineweb_train_*.bin.

Like a Hub text dataset (hub.py), only the files a run reads are fetched (hub_files.py), through
the Hub cache, offline-aware, in a child process that a stop signal ends at once; unlike one,
nothing is tokenized: the shards are read in place from the cache. choose_hub_shards sizes the
download before any worker starts: shards hold an exact number of tokens (their size, less
llm.c's header, over the token's width, read from the first shard), so the run's windows decide
how many. The count goes into data.hub_max_files, and the commit into the path the workers get
(pinned_paths), so every rank finds the same files in the cache and asks the Hub nothing.

A PATTERN without wildcards names a file, or a directory as a local data.path does
(shard_files.py): nanoGPT's layout (train.bin, validated on val.bin beside it) when it holds
train.bin, else all its .bin files; read from the Hub's listing, or offline the cache's snapshot.

Below hub.py, which hands an hf:// data.path over to choose_hub_shards and
follow_checkpoint_shards; it imports nothing of hub.py. No torch here; huggingface_hub is
imported only when such a path is used.
"""

from __future__ import annotations

import dataclasses
import glob
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any
from urllib.parse import unquote

from pretrain.data import DataError
from pretrain.data.cache import sigterm_as_exit
from pretrain.data.formats import SHARD_SUFFIXES
from pretrain.data.hub_client import download_command, is_commit, offline_error
from pretrain.data.hub_files import (
    HubFiles,
    Unreachable,
    byte_count,
    fetch,
    include_pattern,
    is_directory,
    matching_files,
    selected,
)
from pretrain.data.shards import Shard, token_file
from pretrain.data.token_budget import run_tokens
from pretrain.data.windows import token_count

if TYPE_CHECKING:
    from pretrain.config import Config, DataConfig

HUB_SCHEME = "hf://"
DATASETS = "hf://datasets/"
EXAMPLE = "hf://datasets/kjj0/fineweb10B-gpt2/fineweb_train_*.bin"
SUFFIXES = SHARD_SUFFIXES["llmc"]
NANOGPT_TRAIN, NANOGPT_VAL = "train.bin", "val.bin"
"""nanoGPT's layout: a directory holding train.bin trains on it and validates on val.bin beside it."""

Log = Callable[[str], None]


def is_hub_path(path: str) -> bool:
    return path.startswith(HUB_SCHEME)


@dataclass(frozen=True)
class HubPath:
    repo: str
    revision: str
    pattern: str
    """Glob of the files, relative to the repository's root."""

    def __str__(self) -> str:
        at = "" if self.revision == "main" else f"@{self.revision}"
        return f"{DATASETS}{self.repo}{at}/{self.pattern}"

    def at(self, commit: str) -> HubPath:
        return dataclasses.replace(self, revision=commit)

    @property
    def include(self) -> str:
        """The `hf download --include` pattern that fetches what the path names."""
        return include_pattern(self.pattern, SUFFIXES)


def parse_hub_path(path: str, key: str) -> HubPath:
    """hf://datasets/OWNER/NAME[@REVISION]/PATTERN; DataError, one line, for anything else."""
    if not path.startswith(DATASETS):
        raise DataError(
            f"{key}: {path!r} is not a Hugging Face dataset path; expected hf://datasets/OWNER/NAME/PATTERN ({EXAMPLE})"
        )
    owner, _, rest = path[len(DATASETS) :].partition("/")
    name, _, pattern = rest.partition("/")
    name, _, revision = name.partition("@")
    if not (owner and name and pattern):
        raise DataError(f"{key}: {path!r} names no files; expected hf://datasets/OWNER/NAME/PATTERN ({EXAMPLE})")
    return HubPath(f"{owner}/{name}", unquote(revision) or "main", pattern)


# --- finding and fetching -----------------------------------------------------------------------


def find_shards(hub: HubPath, wanted: int | None, key: str, *, every: bool = False) -> HubFiles:
    """The .bin files hub's pattern names (a directory's: all of them): listed by the Hub, else
    those in the Hub cache (every: all of them, as the Hub lists them when it can be reached,
    whatever is cached). DataError when there are none, or when the Hub cannot be reached and
    nothing is cached."""
    fetch_them = download_command(hub.repo, hub.revision, "dataset", include=[hub.include])
    instead = f"copy the shards here and set {key} to them"
    # At a commit (the workers' paths), the cache answers once it holds the wanted count, or for
    # all of them (wanted None: validation) any: the launcher fetched every one before they start.
    cached_enough = None if every else wanted or (1 if is_commit(hub.revision) else None)
    try:
        found = matching_files(hub.repo, hub.revision, hub.pattern, cached_enough, SUFFIXES)
    except Unreachable as error:
        at = "" if hub.revision == "main" else f"@{hub.revision}"
        raise offline_error(f"dataset {hub.repo}{at} ({hub.pattern})", fetch_them, instead, str(error)) from None
    if found.files:
        return found
    at = f"dataset {hub.repo}@{found.commit[:12]}"
    if glob.has_magic(hub.pattern):
        if not found.online:  # the dataset is cached, but not these files
            raise offline_error(f"{key} {hub.pattern} of {at}", fetch_them, instead)
        raise DataError(
            f"{key}: no .bin file of {at} matches {hub.pattern!r}; set it to a pattern of the dataset's shards ({EXAMPLE})"
        )
    if not found.online:
        raise offline_error(f"{key}: the file or directory {hub.pattern!r} of {at}", fetch_them, instead)
    raise DataError(
        f"{key}: {at} has no file or directory {hub.pattern!r} holding .bin shards; set it to a file, "
        f"directory or pattern of the dataset's shards ({EXAMPLE})"
    )


@dataclass(frozen=True)
class Layout:
    """What a path's files give each split, as for a local path (shard_files.py)."""

    train: HubFiles
    beside: HubFiles
    """val.bin beside nanoGPT's train.bin (validation, unless data.val_path is set); else none."""
    nanogpt: bool


def layout(hub: HubPath, found: HubFiles) -> Layout:
    """nanoGPT's layout for a directory holding train.bin; else every file found trains."""
    folder = hub.pattern.rstrip("/")
    sizes = dict(found.files)
    train, val = f"{folder}/{NANOGPT_TRAIN}", f"{folder}/{NANOGPT_VAL}"
    if not is_directory(hub.pattern, SUFFIXES) or train not in sizes:
        return Layout(found, dataclasses.replace(found, files=[]), nanogpt=False)
    return Layout(
        dataclasses.replace(found, files=[(train, sizes[train])]),
        dataclasses.replace(found, files=[(val, sizes[val])] if val in sizes else []),
        nanogpt=True,
    )


@dataclass(frozen=True)
class HubShards:
    shards: list[Shard]
    stamps: list[list[Any]]
    """[hf://datasets/OWNER/NAME@COMMIT/FILE, bytes] for each: the commit names the contents."""
    pinned: str
    """The path at its commit: what the workers are given."""


def hub_shards(path: str, wanted: int | None, key: str, log: Log | None = None, *, beside: bool = False) -> HubShards:
    """The first wanted (all for 0 or None) shards an hf:// path gives the train split (beside:
    the val.bin beside nanoGPT's train.bin, perhaps none), fetched into the Hub cache when not
    there yet, and read where they lie in it."""
    hub = parse_hub_path(path, key)
    if beside and not is_directory(hub.pattern, SUFFIXES):  # only a directory has a val.bin beside
        return HubShards([], [], str(hub))
    split = layout(hub, find_shards(hub, wanted, key))
    found = split.beside if beside else split.train
    files = selected(hub.repo, hub.include, wanted, found, SUFFIXES)
    folder = fetch(hub.repo, found, files, log) if files else None
    return HubShards(
        [token_file(folder / name) for name, _ in files] if folder else [],
        [[f"{DATASETS}{hub.repo}@{found.commit}/{name}", size] for name, size in files],
        str(hub.at(found.commit)),
    )


# --- how many the run reads ---------------------------------------------------------------------


def choose_hub_shards(config: Config, world_size: int, log: Log) -> Config:
    """config with data.hub_max_files made concrete for an hf:// data.path: the fewest shards,
    in name order, whose windows fill the run (and its validation share when validation is their
    tail); every shard for a run set in epochs. Fetches the first shard (it is read in any case)
    to learn the shards' layout; says in one line how many of how many."""
    data = config.data
    if data.hub_max_files is not None or not is_hub_path(data.path):  # set by the user, or by the launcher
        return config
    hub = parse_hub_path(data.path, "data.path")
    split = layout(hub, find_shards(hub, None, "data.path", every=True))
    found = split.train
    where = f"dataset {hub.repo}: {_described(hub, split)}"
    if not found.online:
        where += " in the Hugging Face cache (the Hub cannot be reached)"
    tokens = run_tokens(config, world_size)
    if tokens is None:
        count, why = len(found.files), "all of them (a run set in epochs)"
    else:
        held = _tokens_held(hub, found, log)
        windows = tokens // data.context_length
        share = 0.0 if data.val_path or split.beside.files else data.val_fraction
        count = _shards_for(held, windows, data.context_length, share)
        why = f"the run reads {token_count(tokens)} tokens" + (f" and validates on the last {share:.0%}" if share else "")
        why += f", these hold {token_count(sum(held[:count]))}; data.hub_max_files sets the count"
        if _train_windows(held, data.context_length, share) < windows:
            why += "; too few for the run, which will repeat its data"
    size = byte_count(sum(s for _, s in found.files[:count]))
    log(f"{where}; using the first {count} of {len(found.files)} ({size}): {why}")
    return dataclasses.replace(config, data=dataclasses.replace(data, hub_max_files=count))


def _described(hub: HubPath, split: Layout) -> str:
    """What the path names, for the line that sizes the download."""
    if split.nanogpt:
        val = f" ({split.beside.files[0][0]} validates)" if split.beside.files else ""
        return f"nanoGPT's {split.train.files[0][0]}{val}"
    if is_directory(hub.pattern, SUFFIXES):
        return f"{len(split.train.files)} shard(s) in {hub.pattern.rstrip('/')}/"
    return f"{len(split.train.files)} shard(s) match {hub.pattern}"


def _tokens_held(hub: HubPath, found: HubFiles, log: Log) -> list[int]:
    """Tokens in each shard found. The first is fetched (the run reads it in any case) for its
    header, which says how wide the tokens are; the sizes listed then say what the others hold."""
    with sigterm_as_exit():  # as while preparing: a stop signal ends the download at once, cleanly
        first = token_file(fetch(hub.repo, found, found.files[:1], log) / found.files[0][0])
    width = (first.path.stat().st_size - first.offset) // first.tokens
    return [(size - first.offset) // width for _, size in found.files]


def _train_windows(held: list[int], context_length: int, share: float) -> int:
    """Train windows in shards holding held tokens: the validation tail taken off, and a
    window's worth lost at the end of each shard (no window crosses two)."""
    return int(sum(held) * (1 - share)) // (context_length + 1) - len(held)


def _shards_for(held: list[int], windows: int, context_length: int, share: float) -> int:
    """The fewest leading shards that hold windows train windows (all when even they do not)."""
    for count in range(1, len(held) + 1):
        if _train_windows(held[:count], context_length, share) >= windows:
            return count
    return len(held)


def pinned_paths(data: DataConfig, source_key: dict[str, Any]) -> DataConfig:
    """data with its hf:// paths at the commits prepared (recorded in the dataset's key), so the
    workers find these very shards in the cache, even if the branch moves during the run."""
    pins = {key: path for key, path in source_key.get("pinned", {}).items() if is_hub_path(getattr(data, key))}
    return dataclasses.replace(data, **pins) if pins else data


def follow_checkpoint_shards(data: DataConfig, saved: DataConfig) -> DataConfig:
    """data reading the same Hub shards as the checkpoint it resumes (saved: its config): the
    count and the commit, unless set here (see hub.follow_checkpoint)."""
    if not (is_hub_path(data.path) and is_hub_path(saved.path)) or data.source != saved.source:
        return data
    here, there = parse_hub_path(data.path, "data.path"), parse_hub_path(saved.path, "data.path")
    if (here.repo, here.pattern) != (there.repo, there.pattern):
        return data
    changes: dict[str, Any] = {}
    if data.hub_max_files is None and saved.hub_max_files is not None:
        changes["hub_max_files"] = saved.hub_max_files
    if here.revision == "main" and is_commit(there.revision):
        changes["path"] = saved.path
    return dataclasses.replace(data, **changes) if changes else data
