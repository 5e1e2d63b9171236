"""Prepare a dataset once: tokenize its source into a cache directory that workers memory-map.

One prepared dataset is `<data.cache_dir>/<source>-<tokenizer>-<hash12>/`:

    tokens.bin       the token ids of every document, each followed by end-of-text, back to back;
                     little-endian uint16 when the vocabulary fits, else uint32 (llm.c's layout)
    tokenizer.json   the trained or given tokenizer, when there is one (to decode later)
    meta.json        the key, the tokenizer, the splits (as segments: file, byte offset, token
                     count, dtype), counts, the largest id, and the sha256 and size of each file

Pre-tokenized shards (llm.c, Megatron) are not copied: their directory holds only meta.json,
whose segments point at the shards where they are.

Validation is data.val_path when given, else the tail of the token stream: the last
val_fraction of the tokens, moved to a document boundary when one is near (see split_point; a
Megatron index records its documents' ends, an llm.c shard does not: cut at the exact share).

`hash12` hashes the key: every input that changes the bytes (format version, the source's
identity: its files' paths, sizes and modification times, or content hash, or Hub commit; the
tokenizer's identity; max_samples; the split). Context length is not one: windows are cut at load
time, so one preparation serves every context length. A cache hit reads meta.json and stats the
files, nothing more (under 0.3 s whatever the size); `verify` re-hashes on request.

A build writes into a temporary directory beside the final one and renames it into place, so the
final name only ever holds a complete dataset. A lock file `<final>.lock` (present only while a
build runs) makes concurrent preparers build once: the others wait, then reuse. The mechanics of
that are in cache.py. A cache hit writes nothing, so a read-only cache that holds the dataset
serves; one that does not, or another user's private one, is refused in one line with the fix,
and in a cache several users share what a build creates follows the cache's mode (shared_cache.py).

This module must not import torch: the launcher imports it and has to start fast.
"""

from __future__ import annotations

import bisect
import hashlib
import json
import os
import secrets
import shutil
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any


from pretrain import registry
from pretrain.run import shared_cache
from pretrain.config.schema import SHARD_SOURCES
from pretrain.data import DataError
from pretrain.data.cache import (
    FORMAT_VERSION,
    META_FILE,
    build_lock,
    inspect_dataset,
    read_meta,
    remove_leftovers,
    replace_dir,
    sigterm_as_exit,
    verify,
    write_synced,
)
from pretrain.run.exit_codes import stop_signal
from pretrain.data.encode import TokenWriter, encode_into, limited
from pretrain.data.shard_index import index_shards
from pretrain.data.shard_files import say_detected, shard_set
from pretrain.data.sources import TextSource, documents_source, text_source
from pretrain.data.tokenizer import (
    BPE_EOT,
    TOKENIZER_FILE,
    HuggingFaceTokenizer,
    file_sha256,
    load_tokenizer,
    tokenizer_label,
    tokenizer_spec,
    train_bpe,
)
from pretrain.data.splits import split_point, splits_meta
from pretrain.data.windows import DTYPES, Segment
from pretrain.run.files import cache_path, naming
from pretrain.run.shared_cache import make_dirs

if TYPE_CHECKING:
    from pretrain.config import DataConfig

__all__ = [
    "prepare",
    "read_meta",
    "verify",
    "sigterm_as_exit",
    "stop_signal",
    "model_vocab_size",
    "split_point",
    "storage_dtype",
    "recipe_for",
    "FORMAT_VERSION",
    "TOKENS_FILE",
]
"""read_meta, verify and sigterm_as_exit live in cache.py; they are here too, as the API of preparing."""

TOKENS_FILE = "tokens.bin"
MAX_FOLLOWED_VOCAB = 1 << 22
"""model.vocab_size null follows the data up to this (4M ids; the largest real tokenizers hold 256K)."""

BOUNDARIES_KEPT = 1 << 16
"""Document ends held before the ones that can no longer matter are dropped (see TokenWriter)."""

Log = Callable[[str], None]


# --- public API -------------------------------------------------------------------------------


def prepare(cfg: DataConfig, log: Log = print, *, documents: Sequence[str] | None = None, force: bool = False) -> Path:
    """Return the directory of the prepared dataset for cfg, building it first if needed.

    documents replaces cfg.source with these texts (source name "custom"; used by tests).
    force rebuilds even when a valid cache exists."""
    started = time.monotonic()
    recipe = recipe_for(cfg, documents, force=force, log=log)
    final = recipe.path
    # Fast path without the lock: the final name only ever appears complete (by rename), so a
    # valid one can be used as is. This also keeps a read-only shared cache usable.
    meta, problem = inspect_dataset(final, recipe.key)
    if meta is not None and not force:
        return _reuse(final, meta, log, started)
    try:
        make_dirs(final.parent)
        with build_lock(final, log):
            meta, problem = inspect_dataset(final, recipe.key)  # another preparer may have built it meanwhile
            if meta is not None and not force:
                return _reuse(final, meta, log, started)
            remove_leftovers(final)
            if final.exists():
                log(f"dataset: rebuilding {final} ({'forced' if meta is not None else f'damaged: {problem}'})")
            _build(final, recipe, log)
    except OSError as error:
        # A read-only cache, or another user's: said in one line with the fix, not as a bare errno.
        if not shared_cache.concerns(error, final.parent):
            raise
        doing = f"preparing the dataset ({'forced' if force else problem})"
        raise DataError(shared_cache.refusal(error, doing)) from None
    return final


def model_vocab_size(configured: int | None, meta: dict[str, Any]) -> int:
    """The model's vocabulary for a dataset: the configured size, or the tokenizer's when None.
    DataError when the dataset holds ids the configured size cannot embed."""
    needed = meta["vocab_size"]
    if configured is None:
        if needed > MAX_FOLLOWED_VOCAB:  # a damaged shard (a negative int32 read as uint32) looks like this
            raise DataError(
                f"the dataset's largest token id is {needed - 1:,}, too large to size the model by; "
                "check the shards, or set model.vocab_size explicitly if it is right"
            )
        return needed
    if configured < needed:
        raise DataError(
            f"the dataset's token ids go up to {needed - 1}, beyond model.vocab_size {configured}; "
            f"set model.vocab_size to at least {needed}, or to null to follow the tokenizer"
        )
    return configured


def storage_dtype(vocab_size: int) -> str:
    """Name of the narrowest unsigned type that holds every id of the vocabulary."""
    return "uint16" if vocab_size <= 2**16 else "uint32"


# --- the recipe: key, place and builder (cheap; no token is read) ----------------------------


@dataclass(frozen=True)
class Recipe:
    key: dict[str, Any]
    path: Path
    build: Callable[[Path, Log], dict[str, Any]]
    """Writes the dataset's files into a directory; returns the rest of meta.json."""


def recipe_for(cfg: DataConfig, documents: Sequence[str] | None = None, force: bool = False, log: Log | None = None) -> Recipe:
    """What preparing cfg means: the cache key, the directory and how to build it (force: a
    trained BPE tokenizer is trained again too). log tells of a Hub dataset's download."""
    cfg.check_complete()
    if documents is None and cfg.source in SHARD_SOURCES:
        return _shard_recipe(cfg, log)
    train = documents_source(list(documents)) if documents is not None else text_source(cfg, log=log)
    val = text_source(cfg, val=True, log=log) if cfg.val_path and documents is None else None
    if val is not None:
        _check_disjoint(train.identity.get("files", []), val.identity.get("files", []))
    key = {
        "format_version": FORMAT_VERSION,
        "source": train.identity,
        "val_source": val.identity if val else None,
        "val_fraction": None if val else cfg.val_fraction,
        "max_samples": cfg.max_samples,
        "tokenizer": tokenizer_spec(cfg, train.identity),
    }
    path = _dataset_path(cfg.cache_dir, f"{train.name}-{tokenizer_label(cfg)}", key)
    return Recipe(key, path, lambda directory, log: _tokenize(directory, cfg, train, val, log, force))


def _check_disjoint(train_files: list[list[Any]], val_files: list[list[Any]]) -> None:
    """Validation on files that are also trained on measures nothing: refuse (a directory given
    as data.path easily includes the validation files)."""
    both = sorted({f[0] for f in train_files} & {f[0] for f in val_files})
    if both:
        more = f" and {len(both) - 1} more" if len(both) > 1 else ""
        raise DataError(
            f"{both[0]}{more} is in both data.path and data.val_path; narrow data.path so validation files are not trained on"
        )


def _dataset_path(cache_dir: str, label: str, key: dict[str, Any]) -> Path:
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode("utf-8")).hexdigest()
    return cache_path(cache_dir) / f"{label}-{digest[:12]}"


def _reuse(dataset_dir: Path, meta: dict[str, Any], log: Log, started: float) -> Path:
    tokens = meta["tokens"]
    log(
        f"dataset: reusing {dataset_dir} ({tokens['train']:,} train tokens, {tokens['val']:,} val tokens; "
        f"checked in {(time.monotonic() - started) * 1000:.0f} ms)"
    )
    return dataset_dir


# --- building ---------------------------------------------------------------------------------


def _build(final: Path, recipe: Recipe, log: Log) -> None:
    started = time.monotonic()
    # mkdir (not mkdtemp) so the directory gets the umask's permissions: others on a shared
    # machine must be able to read the cache (and in a cache several users share, its mode: share_entry).
    tmp = final.parent / f".{final.name}.tmp-{os.getpid()}-{secrets.token_hex(4)}"
    tmp.mkdir()
    try:
        details = recipe.build(tmp, log)
        seconds = time.monotonic() - started
        meta = {
            "format_version": FORMAT_VERSION,
            "key": recipe.key,
            **details,
            "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "build_seconds": round(seconds, 3),
        }
        write_synced(tmp / META_FILE, (json.dumps(meta, indent=2) + "\n").encode("utf-8"))
        shared_cache.share_entry(tmp)
        replace_dir(tmp, final)
    except BaseException as error:
        shutil.rmtree(tmp, ignore_errors=True)
        if (signum := stop_signal(error)) is not None:
            log(
                f"dataset: preparation interrupted by {signum.name}; "
                "nothing half-written is kept (its temporary files are removed)"
            )
        raise
    tokens = meta["tokens"]
    total = tokens["train"] + tokens["val"]
    documents = meta.get("documents", {}).get("total")  # llm.c shards do not record documents: None
    log(
        f"dataset: prepared {final} ({tokens['train']:,} train tokens, {tokens['val']:,} val tokens"
        + (f", {documents:,} documents" if documents is not None else "")
        + f") in {seconds:.1f}s "
        f"({total / max(seconds, 1e-9):,.0f} tokens/s)"
    )


def _tokenize(
    directory: Path, cfg: DataConfig, train: TextSource, val: TextSource | None, log: Log, force: bool
) -> dict[str, Any]:
    """Build a dataset from text: tokens.bin, tokenizer.json when there is one; meta details."""
    bpe_file = _trained_bpe(cfg, train, log, force) if cfg.tokenizer == "bpe" else None
    tokenizer = load_tokenizer(cfg, bpe_file)
    dtype = storage_dtype(tokenizer.vocab_size)
    # naming: a write that fails (a full disk) raises an OSError that names no file.
    with naming(directory / TOKENS_FILE), open(directory / TOKENS_FILE, "wb") as file:
        # With val_path the split is where validation starts: no boundary is needed at all.
        writer = TokenWriter(file, DTYPES[dtype], tokenizer.vocab_size, 0.0 if val else cfg.val_fraction)
        pieces = limited(train.pieces(), cfg.max_samples)
        # With max_samples the share of the source that will be read is unknown: no ETA then.
        encode_into(writer, pieces, tokenizer, "dataset: tokenizing", None if cfg.max_samples else train.total_bytes)
        train_tokens, train_documents = writer.tokens, writer.documents
        if val is not None:
            encode_into(writer, val.pieces(), tokenizer, "dataset: tokenizing validation", val.total_bytes)
        writer.finish()
    if writer.documents == 0:
        raise DataError(f"the source ({train.name}) has no documents; check data.path, data.hub_files or the files")
    if val is not None:
        if train_tokens in (0, writer.tokens):
            which = "data.path" if train_tokens == 0 else "data.val_path"
            raise DataError(f"{which} has no documents; it must hold at least one")
        split = train_tokens
    else:
        split = split_point(writer.tokens, writer.boundaries, cfg.val_fraction)
        train_documents = writer.dropped + bisect.bisect_right(writer.boundaries, split)
    files = {TOKENS_FILE: {"bytes": writer.tokens * DTYPES[dtype].itemsize, "sha256": writer.sha256.hexdigest()}}
    tokenizer_meta: dict[str, Any] = {
        "kind": cfg.tokenizer,
        "name": tokenizer.name,
        "vocab_size": tokenizer.vocab_size,
        "eot_id": tokenizer.eot_id,
    }
    if registry.TOKENIZERS[cfg.tokenizer].file:
        with naming(directory / TOKENIZER_FILE):
            shutil.copyfile(bpe_file or tokenizer.path, directory / TOKENIZER_FILE)  # type: ignore[attr-defined]
        files[TOKENIZER_FILE] = {
            "bytes": (directory / TOKENIZER_FILE).stat().st_size,
            "sha256": file_sha256(directory / TOKENIZER_FILE),
        }
        tokenizer_meta["file"] = TOKENIZER_FILE
    train_segment = Segment(TOKENS_FILE, 0, split, dtype)
    return {
        "tokenizer": tokenizer_meta,
        "vocab_size": tokenizer.vocab_size,
        "eot_id": tokenizer.eot_id,
        "dtype": dtype,
        "max_token_id": writer.max_id,
        "splits": splits_meta([train_segment], [Segment(TOKENS_FILE, train_segment.nbytes, writer.tokens - split, dtype)]),
        "tokens": {"train": split, "val": writer.tokens - split},
        "documents": {"total": writer.documents, "train": train_documents, "val": writer.documents - train_documents},
        "files": files,
    }


def _trained_bpe(cfg: DataConfig, source: TextSource, log: Log, force: bool) -> Path:
    """The BPE tokenizer trained on source, from its own cache (trained once, under a lock;
    again when forced or when the cached file does not load)."""
    spec = tokenizer_spec(cfg, source.identity)
    final = _dataset_path(str(cache_path(cfg.cache_dir) / "tokenizers"), f"bpe{cfg.bpe_vocab_size}", spec)
    file = final / TOKENIZER_FILE
    make_dirs(final.parent)
    with build_lock(final, log):
        problem = "forced" if force else _tokenizer_problem(file)
        if problem is None:
            return file
        if file.exists():
            log(f"dataset: training the BPE tokenizer again ({problem}): {file}")
        else:  # said before it starts: it can take long, and a stop signal ends it at once
            log(f"dataset: training a {cfg.bpe_vocab_size}-token BPE tokenizer on {source.name}")
        remove_leftovers(final)
        started = time.monotonic()
        tmp = final.parent / f".{final.name}.tmp-{os.getpid()}-{secrets.token_hex(4)}"
        tmp.mkdir()
        try:
            texts = (piece.text for piece in limited(source.pieces(), cfg.max_samples))
            train_bpe(texts, cfg.bpe_vocab_size, tmp / TOKENIZER_FILE)
            shared_cache.share_entry(tmp)
            replace_dir(tmp, final)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        log(
            f"dataset: trained a {cfg.bpe_vocab_size}-token BPE tokenizer on {source.name} "
            f"in {time.monotonic() - started:.1f}s: {file}"
        )
    return file


def _tokenizer_problem(file: Path) -> str | None:
    """None when file is a trained tokenizer that loads; else why not."""
    if not file.is_file():
        return "not trained"
    try:
        HuggingFaceTokenizer(file, BPE_EOT, "bpe")
    except DataError as error:
        return f"damaged: {error}"
    return None


# --- pre-tokenized shards ---------------------------------------------------------------------


def _shard_recipe(cfg: DataConfig, log: Log | None) -> Recipe:
    train = shard_set(cfg, val=False, log=log)
    val = shard_set(cfg, val=True, log=log)
    say_detected(cfg.source, train.shards + val.shards, log)
    _check_disjoint(train.stamps, val.stamps)
    stamps = train.stamps + val.stamps
    if cfg.source == "megatron":  # the index holds the document boundaries: it is an input too
        indexes = [s.path.with_suffix(".idx") for s in train.shards + val.shards]
        stamps += [[str(f), f.stat().st_size, f.stat().st_mtime_ns] for f in indexes]
    source: dict[str, Any] = {"source": cfg.source, "files": stamps, "val_files": len(val.shards)}
    pinned = {key: found.pinned for key, found in (("path", train), ("val_path", val)) if found.pinned}
    if pinned:  # the commits read, for the workers' config (hub_shards.pinned_paths)
        source["pinned"] = pinned
    key = {
        "format_version": FORMAT_VERSION,
        "source": source,
        "val_fraction": None if val.shards else cfg.val_fraction,
    }
    if cfg.source == "megatron" and not val.shards:
        # Datasets prepared before the cut moved to a document end were cut at the exact share:
        # a key of their own, so they are not reused as if they were these.
        key["val_cut"] = "document end"
    path = _dataset_path(cfg.cache_dir, cfg.source, key)
    return Recipe(key, path, lambda directory, log: index_shards(train.shards, val.shards, cfg.val_fraction, log))
