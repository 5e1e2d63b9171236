"""Hugging Face Hub datasets: which of a dataset's files a run uses.

A Hub dataset is often far larger than a run reads (FineWeb-Edu's sample/10BT: 14 Parquet files,
28.5 GB, ~10B GPT-2 tokens). data.hub_max_files takes the first N files matching data.hub_files
in name order. When it is null, choose_hub_files estimates N from the run's length and the files'
sizes (token_budget.py); the launcher calls it once, before any worker starts, and writes the
number (and later the commit, see fitting.py) into the config the workers get, so every rank
prepares exactly the same files. For pre-tokenized shards on the Hub (an hf:// data.path) it
hands over to hub_shards.py, as follow_checkpoint does.

The files are listed by the Hub (names and sizes) when it can be reached, else read from the Hub
cache (hub_files.py, which fetches them too): offline, a run can use only what is cached, and a
dataset that is not cached at all stops the run with one line saying how to fetch it.

The top of the Hub modules: the launcher, prepare_dataset.py and train() call it; nothing below
imports it back. No torch here; huggingface_hub is imported only when a Hub source is used.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any

from pretrain.config import Config, ConfigError, DataConfig, load
from pretrain.config.schema import SHARD_SOURCES
from pretrain.data import DataError
from pretrain.data.hub_client import LOCAL_FILES_INSTEAD, download_command, is_commit, offline_error
from pretrain.data.hub_files import HubFiles, Unreachable, byte_count, include_pattern, matching_files
from pretrain.data.hub_shards import choose_hub_shards, follow_checkpoint_shards, is_hub_path
from pretrain.data.token_budget import MARGIN, estimated_tokens, files_for_tokens, run_tokens
from pretrain.data.windows import token_count

Log = Callable[[str], None]


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


def choose_hub_files(config: Config, world_size: int, log: Log) -> Config:
    """config with data.hub_max_files made concrete for a Hub source: the number of files this run
    uses, every rank alike. Lists the files (Hub, else cache) but downloads nothing."""
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
