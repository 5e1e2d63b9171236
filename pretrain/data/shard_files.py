"""Which files a shard source (llmc, nanogpt, megatron) reads for a split, and what they are.

data.path (data.val_path for validation) is a file, a directory, a glob, or for llmc and nanogpt
an hf:// path of a Hub dataset (hub_shards.py). A directory holding nanoGPT's `train.bin` gives
that file as the train split and `val.bin` beside it as validation (unless data.val_path is
set), as nanoGPT itself reads them; any other directory gives all its `.bin` files. An hf://
path naming a directory of the dataset means the same (hub_shards.layout).

llm.c shards and nanoGPT's header-less `.bin` files are told apart per file by their header
(shards.token_file): either source reads either kind, and says in one line (say_detected) when
what it found is not what its name says.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pretrain.data.hub_shards import NANOGPT_TRAIN, NANOGPT_VAL, hub_shards, is_hub_path
from pretrain.data.shards import Shard, megatron_shard, token_file
from pretrain.data.sources import resolve_files

if TYPE_CHECKING:
    from pretrain.config import DataConfig

FORMS = {"llmc": "llm.c shards, past their 1024-byte header", "nanogpt": "nanoGPT's header-less uint16 token ids"}

Log = Callable[[str], None]


@dataclass(frozen=True)
class ShardSet:
    shards: list[Shard]
    stamps: list[list[Any]]
    """Each file's identity for the cache key: [path, bytes, mtime_ns], or for a Hub file
    [hf://datasets/OWNER/NAME@COMMIT/FILE, bytes]."""
    pinned: str | None = None
    """An hf:// path at the commit read; None for local files."""


def shard_set(cfg: DataConfig, *, val: bool, log: Log | None = None) -> ShardSet:
    """The shards of the train split, or of validation (none when it is the train shards' tail)."""
    path, key = (cfg.val_path, "data.val_path") if val else (cfg.path, "data.path")
    if cfg.source == "megatron":
        return _local([megatron_shard(Path(path).expanduser().resolve())] if path else [])
    if val and not path and is_hub_path(cfg.path):  # val.bin beside nanoGPT's train.bin, if any
        found = hub_shards(cfg.path, None, "data.path", log, beside=True)
        return ShardSet(found.shards, found.stamps)
    if val and not path:
        beside = _nanogpt_val(cfg.path)
        if beside is None and (folder := _nanogpt_folder(cfg.path)) is not None and log is not None:
            log(
                f"dataset: no {NANOGPT_VAL} beside {folder / NANOGPT_TRAIN}: validation is its last {cfg.val_fraction * 100:g}% "
                f"(data.val_fraction), which training does not read; put {NANOGPT_VAL} there, or set data.val_path"
            )
        return _local([token_file(beside)] if beside else [])
    if is_hub_path(path):  # validation reads every file its path matches
        found = hub_shards(path, None if val else cfg.hub_max_files, key, log)
        return ShardSet(found.shards, found.stamps, found.pinned)
    return _local([token_file(file) for file in _local_files(path, key)])


def _local(shards: list[Shard]) -> ShardSet:
    stamps = []
    for shard in shards:
        stat = shard.path.stat()
        stamps.append([str(shard.path), stat.st_size, stat.st_mtime_ns])
    return ShardSet(shards, stamps)


def _local_files(path: str, key: str) -> list[Path]:
    """train.bin of a nanoGPT directory, else the files path names (sources.resolve_files)."""
    folder = Path(path).expanduser()
    if (folder / NANOGPT_TRAIN).is_file():
        return [(folder / NANOGPT_TRAIN).resolve()]
    return resolve_files(path, "llmc", key)


def _nanogpt_folder(path: str) -> Path | None:
    """The local directory data.path names, when it holds train.bin (nanoGPT's layout)."""
    folder = Path(path).expanduser()
    return folder if path and (folder / NANOGPT_TRAIN).is_file() else None


def _nanogpt_val(path: str) -> Path | None:
    """val.bin beside train.bin in a local directory given as data.path (nanoGPT's layout)."""
    if (folder := _nanogpt_folder(path)) is not None and (folder / NANOGPT_VAL).is_file():
        return (folder / NANOGPT_VAL).resolve()
    return None


def say_detected(source: str, shards: list[Shard], log: Log | None) -> None:
    """One line when files are not the kind the source names (nanoGPT files given as llmc, llm.c
    shards given as nanogpt): what was found, so that a wrong guess would show."""
    others = [shard for shard in shards if shard.form != source and shard.form in FORMS]
    if not others or log is None:
        return
    form = others[0].form
    names = ", ".join(shard.path.name for shard in others[:3]) + (f" and {len(others) - 3} more" if len(others) > 3 else "")
    found = "no llm.c header (magic number 20240520 or 20240801)" if form == "nanogpt" else "llm.c's header"
    log(f"dataset: {found} in {names}: read as {FORMS[form]}")
