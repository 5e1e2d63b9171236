"""Prepare a dataset once: tokenize its source into a cache directory that workers memory-map.

One prepared dataset is `<data.cache_dir>/<source>-<tokenizer>-<hash12>/`:

    train.bin, val.bin   raw little-endian token ids, uint16 when the vocabulary fits, else uint32;
                         every document is followed by the end-of-text id
    meta.json            what was built from what, the counts and the sha256 of each file

`hash12` hashes every input that changes the bytes (see `cache_key`), so a different input gets a
different directory and an existing directory never needs comparing against its inputs.

A build writes into a temporary directory beside the final one and renames it into place, so the
final name only ever holds a complete dataset. A lock file `<final>.lock` makes concurrent
preparers build once: the others wait, then reuse. A cache hit reads meta.json and compares file
sizes, nothing more; `verify` re-hashes the files on request.

This module must not import torch: the launcher imports it and has to start fast.
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets
import shutil
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO

import numpy as np

from pretrain.data import DataError
from pretrain.data.builtin import builtin_documents, builtin_identity, content_digest
from pretrain.data.tokenizer import Tokenizer, get_tokenizer
from pretrain.runfiles import project_path

if TYPE_CHECKING:
    from pretrain.config import DataConfig

FORMAT_VERSION = 1
SPLITS = ("train", "val")
META_FILE = "meta.json"
# Explicitly little-endian, the layout llm.c-style .bin files use, whatever machine reads it.
DTYPES = {"uint16": np.dtype("<u2"), "uint32": np.dtype("<u4")}
REBUILD_HINT = "rebuild it with `python3 prepare_dataset.py --force`"


@dataclass(frozen=True)
class Source:
    name: str
    identity: str
    """Changes whenever the documents do; part of the cache key."""
    documents: Sequence[str]


# --- public API -------------------------------------------------------------------------------

def prepare(cfg: DataConfig, log: Callable[[str], None] = print, *,
            documents: Sequence[str] | None = None, force: bool = False) -> Path:
    """Return the directory of the prepared dataset for cfg, building it first if needed.

    documents replaces cfg.source with these texts (source name "custom"; used by tests).
    force rebuilds even when a valid cache exists."""
    source = load_source(cfg.source, documents)
    tokenizer = get_tokenizer(cfg.tokenizer)
    key = cache_key(source, tokenizer, cfg.val_fraction)
    final = dataset_path(cfg.cache_dir, source, tokenizer, key)

    # Fast path without the lock: the final name only ever appears complete (by rename), so a
    # valid one can be used as is. This also keeps a read-only shared cache usable.
    if not force and _problem(final, key) is None:
        return _reuse(final, log)

    final.parent.mkdir(parents=True, exist_ok=True)
    with _build_lock(final, log):
        problem = _problem(final, key)  # another preparer may have built it while we waited
        if problem is None and not force:
            return _reuse(final, log)
        _remove_leftovers(final)
        if final.exists():
            reason = "forced" if problem is None else f"damaged: {problem}"
            log(f"dataset: rebuilding {final} ({reason})")
        _build(final, source, tokenizer, cfg.val_fraction, key, log)
    return final


def verify(dataset_dir: str | Path) -> None:
    """Check a prepared dataset completely, sha256 of every token file included.

    Raises DataError naming the first problem found."""
    dataset_dir = Path(dataset_dir)
    try:
        meta = _load_meta(dataset_dir)
        _check_sizes(dataset_dir, meta)
        for split in SPLITS:
            expected = meta["sha256"][f"{split}.bin"]
            actual = _file_sha256(token_file(dataset_dir, split))
            if actual != expected:
                raise _Damage(f"{split}.bin does not match its sha256 in meta.json "
                              f"(expected {expected[:12]}..., got {actual[:12]}...)")
    except _Damage as damage:
        raise DataError(f"{dataset_dir}: {damage}; {REBUILD_HINT}") from None


def read_meta(dataset_dir: str | Path) -> dict[str, Any]:
    """The parsed meta.json of a prepared dataset; DataError when it is missing or unreadable."""
    dataset_dir = Path(dataset_dir)
    try:
        return _load_meta(dataset_dir)
    except _Damage as damage:
        raise DataError(f"{dataset_dir}: not a usable prepared dataset ({damage}); {REBUILD_HINT}") from None


def window_count(n_tokens: int, context_length: int) -> int:
    """Non-overlapping windows of context_length + 1 tokens in a split (see loader.py)."""
    return max(0, (n_tokens - 1) // context_length)


def check_batch_fits(dataset_dir: str | Path, context_length: int, batch_size: int, world_size: int) -> None:
    """Raise DataError, with the numbers and the fix, when the train split cannot fill one
    batch on every rank. Torch-free, so the launcher checks before spawning anyone."""
    n_tokens = read_meta(dataset_dir)["tokens"]["train"]
    n_windows, needed = window_count(n_tokens, context_length), batch_size * world_size
    if n_windows < needed:
        raise DataError(
            f"the train split ({n_tokens} tokens) has {n_windows} windows of {context_length + 1} tokens, "
            f"fewer than batch_size {batch_size} x {world_size} rank(s) = {needed}; "
            "reduce training.batch_size or data.context_length, or add data")


def token_file(dataset_dir: str | Path, split: str) -> Path:
    return Path(dataset_dir) / f"{split}.bin"


def storage_dtype(vocab_size: int) -> str:
    """Name of the narrowest unsigned type that holds every id of the vocabulary."""
    return "uint16" if vocab_size <= 2**16 else "uint32"


def load_source(name: str, documents: Sequence[str] | None = None) -> Source:
    """The documents of data.source, or the given documents as source "custom"."""
    if documents is not None:
        documents = list(documents)
        return Source("custom", content_digest(documents), documents)
    if name == "builtin":
        documents = builtin_documents()
        return Source("builtin", builtin_identity(documents), documents)
    raise DataError(f"data.source: unknown source {name!r}")


def cache_key(source: Source, tokenizer: Tokenizer, val_fraction: float) -> dict[str, Any]:
    """Every input that changes the bytes of a prepared dataset. Context length is not one:
    the loader cuts windows at run time."""
    return {
        "format_version": FORMAT_VERSION,
        "source": source.name,
        "source_identity": source.identity,
        "tokenizer": tokenizer.name,
        "vocab_size": tokenizer.vocab_size,
        "eot_id": tokenizer.eot_id,
        "val_fraction": val_fraction,
    }


def dataset_path(cache_dir: str, source: Source, tokenizer: Tokenizer, key: dict[str, Any]) -> Path:
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode("utf-8")).hexdigest()
    return project_path(cache_dir) / f"{source.name}-{tokenizer.name}-{digest[:12]}"


def validation_documents(n_documents: int, val_fraction: float) -> set[int]:
    """Indices of the documents held out for validation: about val_fraction of them, spread
    evenly over the corpus, at least one, and never all (train keeps at least one)."""
    if n_documents < 2:
        raise DataError(f"cannot split {n_documents} document(s) into train and validation; "
                        "the source needs at least 2 documents")
    n_val = min(max(1, round(n_documents * val_fraction)), n_documents - 1)
    # The middle of each of n_val equal strides; strides are wider than 1, so no index repeats.
    return {int((k + 0.5) * n_documents / n_val) for k in range(n_val)}


@contextmanager
def _build_lock(final: Path, log: Callable[[str], None]) -> Iterator[None]:
    """Hold `<final>.lock`; say so when waiting, or a waiting rank looks hung."""
    from filelock import FileLock, Timeout  # imported here: a cache hit does not need it

    lock = FileLock(f"{final}.lock")
    try:
        lock.acquire(timeout=0)
    except Timeout:
        log(f"dataset: waiting for another process to finish preparing {final}")
        lock.acquire()
    try:
        yield
    finally:
        lock.release()


# --- checking a cache -------------------------------------------------------------------------

class _Damage(Exception):
    """What is wrong with a cache directory, as a short phrase."""


def _problem(dataset_dir: Path, key: dict[str, Any]) -> str | None:
    """None when dataset_dir holds a complete dataset for key; else what is wrong. O(1)."""
    if not dataset_dir.is_dir():
        return "not built"
    try:
        meta = _load_meta(dataset_dir)
        for field, expected in key.items():
            if meta.get(field) != expected:
                raise _Damage(f"meta.json has {field}={meta.get(field)!r}, expected {expected!r}")
        _check_sizes(dataset_dir, meta)
    except _Damage as damage:
        return str(damage)
    return None


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
    if meta.get("dtype") not in DTYPES:
        raise _Damage(f"meta.json has dtype {meta.get('dtype')!r}, expected one of {', '.join(DTYPES)}")
    for split in SPLITS:
        count = meta.get("tokens", {}).get(split) if isinstance(meta.get("tokens"), dict) else None
        if not isinstance(count, int) or isinstance(count, bool) or count < 1:
            raise _Damage(f"meta.json has no valid token count for {split}")
        sha = meta.get("sha256", {}).get(f"{split}.bin") if isinstance(meta.get("sha256"), dict) else None
        if not isinstance(sha, str):
            raise _Damage(f"meta.json has no sha256 for {split}.bin")
    return meta


def _check_sizes(dataset_dir: Path, meta: dict[str, Any]) -> None:
    itemsize = DTYPES[meta["dtype"]].itemsize
    for split in SPLITS:
        path = token_file(dataset_dir, split)
        expected = meta["tokens"][split] * itemsize
        try:
            size = path.stat().st_size
        except FileNotFoundError:
            raise _Damage(f"{path.name} is missing") from None
        if size != expected:
            raise _Damage(f"{path.name} has {size} bytes, expected {expected} "
                          f"({meta['tokens'][split]} tokens of {meta['dtype']})")


def _file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as file:
        while chunk := file.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def _reuse(dataset_dir: Path, log: Callable[[str], None]) -> Path:
    tokens = _load_meta(dataset_dir)["tokens"]
    log(f"dataset: reusing {dataset_dir} ({tokens['train']} train tokens, {tokens['val']} val tokens)")
    return dataset_dir


# --- building ---------------------------------------------------------------------------------

class _SplitWriter:
    """Appends token arrays to one split's file, counting and hashing as it goes."""

    def __init__(self, file: BinaryIO) -> None:
        self.file = file
        self.sha256 = hashlib.sha256()
        self.documents = 0
        self.tokens = 0

    def write(self, tokens: np.ndarray) -> None:
        data = tokens.tobytes()
        self.file.write(data)
        self.sha256.update(data)
        self.documents += 1
        self.tokens += tokens.size


def _build(final: Path, source: Source, tokenizer: Tokenizer, val_fraction: float,
           key: dict[str, Any], log: Callable[[str], None]) -> None:
    started = time.monotonic()
    held_out = validation_documents(len(source.documents), val_fraction)
    dtype = storage_dtype(tokenizer.vocab_size)
    # mkdir (not mkdtemp) so the directory gets the umask's permissions: others on a shared
    # machine must be able to read the cache.
    tmp = final.parent / f".{final.name}.tmp-{os.getpid()}-{secrets.token_hex(4)}"
    tmp.mkdir()
    try:
        writers = _write_token_files(tmp, source.documents, held_out, tokenizer, DTYPES[dtype])
        meta = {
            **key,
            "dtype": dtype,
            "documents": {split: writers[split].documents for split in SPLITS},
            "tokens": {split: writers[split].tokens for split in SPLITS},
            "sha256": {f"{split}.bin": writers[split].sha256.hexdigest() for split in SPLITS},
            "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "build_seconds": round(time.monotonic() - started, 3),
        }
        _write_synced(tmp / META_FILE, (json.dumps(meta, indent=2) + "\n").encode("utf-8"))
        _replace_dir(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    tokens = meta["tokens"]
    log(f"dataset: prepared {final} ({tokens['train']} train tokens, {tokens['val']} val tokens, "
        f"{len(source.documents)} documents) in {time.monotonic() - started:.1f}s")


def _write_token_files(directory: Path, documents: Sequence[str], held_out: set[int],
                       tokenizer: Tokenizer, dtype: np.dtype) -> dict[str, _SplitWriter]:
    from tqdm import tqdm  # imported here: only a build draws a progress bar

    # No monitor thread: the launcher prepares data and then forks its workers, and forking
    # while another thread runs can deadlock the child.
    tqdm.monitor_interval = 0

    with open(token_file(directory, "train"), "wb") as train, open(token_file(directory, "val"), "wb") as val:
        writers = {"train": _SplitWriter(train), "val": _SplitWriter(val)}
        # disable=None: silent when stderr is not a terminal (logs, pipes, tests).
        progress = tqdm(documents, desc="dataset: tokenizing", unit="doc", file=sys.stderr,
                        disable=None, leave=False)
        for index, document in enumerate(progress):
            split = "val" if index in held_out else "train"
            writers[split].write(_document_tokens(tokenizer, document, dtype))
        for file in (train, val):
            file.flush()
            os.fsync(file.fileno())
    return writers


def _document_tokens(tokenizer: Tokenizer, text: str, dtype: np.dtype) -> np.ndarray:
    """The ids of one document followed by end-of-text, in the storage dtype."""
    ids = np.asarray(tokenizer.encode(text))
    # A tokenizer bug would otherwise wrap around silently in the narrow storage type.
    if ids.size and (int(ids.min()) < 0 or int(ids.max()) >= tokenizer.vocab_size):
        raise DataError(f"tokenizer {tokenizer.name!r} produced an id outside 0..{tokenizer.vocab_size - 1}")
    tokens = np.empty(ids.size + 1, dtype=dtype)
    tokens[:-1] = ids
    tokens[-1] = tokenizer.eot_id
    return tokens


def _write_synced(path: Path, data: bytes) -> None:
    with open(path, "wb") as file:
        file.write(data)
        file.flush()
        os.fsync(file.fileno())


def _replace_dir(new: Path, final: Path) -> None:
    """Move new to final; an existing final is moved aside first and deleted afterwards, so
    the final name never holds a partly deleted or partly written dataset."""
    old = final.parent / f".{final.name}.old-{os.getpid()}-{secrets.token_hex(4)}"
    if final.exists():
        os.rename(final, old)
    os.rename(new, final)
    _fsync_dir(final.parent)
    shutil.rmtree(old, ignore_errors=True)


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _remove_leftovers(final: Path) -> None:
    """Delete temporary directories of preparers that died mid-build. Call with the lock held:
    then no live preparer is using any of them."""
    for pattern in (f".{final.name}.tmp-*", f".{final.name}.old-*"):
        for leftover in final.parent.glob(pattern):
            shutil.rmtree(leftover, ignore_errors=True)
