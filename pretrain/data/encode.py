"""Encoding text into tokens.bin: documents read in batches while a thread tokenizes the previous
one, ids checked, counted and hashed as they are written, and the document ends kept that the
validation cut can still use. No torch here (the launcher prepares data).
"""

from __future__ import annotations

import bisect
import hashlib
import os
import sys
import time
from array import array
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, BinaryIO

import numpy as np

from pretrain.data import DataError
from pretrain.data.sources import Piece
from pretrain.data.tokenizer import Tokenizer

BATCH_CHARS = 4 << 20
"""Text handed to the tokenizer at once: large enough for its threads, small for memory."""

BOUNDARIES_KEPT = 1 << 16
"""Document ends held before the ones that can no longer matter are dropped (see TokenWriter)."""


def limited(pieces: Iterator[Piece], max_samples: int) -> Iterator[Piece]:
    """The pieces of the first max_samples documents (all when 0)."""
    documents = 0
    for piece in pieces:
        yield piece
        documents += piece.ends_document
        if max_samples and documents >= max_samples:
            return


class TokenWriter:
    """Appends token arrays to tokens.bin, counting, hashing and checking ids as it goes."""

    def __init__(self, file: BinaryIO, dtype: np.dtype, vocab_size: int, val_fraction: float) -> None:
        self.file, self.dtype, self.vocab_size, self.val_fraction = file, dtype, vocab_size, val_fraction
        self.sha256 = hashlib.sha256()
        self.tokens = self.documents = self.max_id = 0
        self.boundaries = array("q")
        """Token offsets where a document ends (after its end-of-text), the recent ones only:
        split_point never picks one before total * (1 - 2 * val_fraction), and the total only
        grows, so older ones are dropped (counted in `dropped`) and memory stays bounded."""
        self.dropped = 0

    def write(self, ids: list[np.ndarray], ends: list[bool], eot_id: int) -> None:
        eot = np.array([eot_id], dtype=np.uint32)  # unsigned: joining it keeps the ids' narrow type
        parts = []
        offset = self.tokens
        for piece_ids, ends_document in zip(ids, ends, strict=True):
            parts.append(piece_ids)
            offset += piece_ids.size
            if ends_document:
                parts.append(eot)
                offset += 1
                self.boundaries.append(offset)
                self.documents += 1
        tokens = np.concatenate(parts) if parts else np.empty(0, dtype=np.uint32)
        if tokens.size:
            largest = int(tokens.max())
            # A tokenizer bug would otherwise wrap around silently in the narrow storage type.
            if largest >= self.vocab_size or int(tokens.min()) < 0:
                raise DataError(f"the tokenizer produced id {largest}, beyond its vocabulary of {self.vocab_size}")
            self.max_id = max(self.max_id, largest)
        data = tokens.astype(self.dtype, copy=False).tobytes()
        self.file.write(data)
        self.sha256.update(data)
        self.tokens = offset
        if len(self.boundaries) > BOUNDARIES_KEPT:
            useless = bisect.bisect_left(self.boundaries, self.tokens * (1 - 2 * self.val_fraction) - 2)
            del self.boundaries[:useless]
            self.dropped += useless

    def finish(self) -> None:
        self.file.flush()
        os.fsync(self.file.fileno())


def _batches(pieces: Iterator[Piece]) -> Iterator[list[Piece]]:
    batch: list[Piece] = []
    size = 0
    for piece in pieces:
        batch.append(piece)
        size += len(piece.text)
        if size >= BATCH_CHARS or len(batch) >= 4096:
            yield batch
            batch, size = [], 0
    if batch:
        yield batch


def encode_into(writer: TokenWriter, pieces: Iterator[Piece], tokenizer: Tokenizer, label: str, total_bytes: int | None) -> None:
    """Tokenize pieces in batches and append them to writer, in order.

    The next batch is read and parsed here while a helper thread encodes the current one (the
    tokenizers release the GIL and use every core), so reading overlaps encoding; at most two
    batches are in memory."""
    progress = progress_bar(label, total_bytes, unit="B")
    started = time.monotonic()
    with ThreadPoolExecutor(max_workers=1) as pool:
        pending: tuple[Future[list[np.ndarray]], list[Piece]] | None = None
        for batch in _batches(pieces):
            future = pool.submit(tokenizer.encode_batch, [piece.text for piece in batch])
            if pending is not None:
                _write_encoded(writer, *pending, tokenizer, progress, started)
            pending = (future, batch)
        if pending is not None:
            _write_encoded(writer, *pending, tokenizer, progress, started)
    progress.close()


def _write_encoded(
    writer: TokenWriter, future: Future, batch: list[Piece], tokenizer: Tokenizer, progress: Any, started: float
) -> None:
    writer.write(future.result(), [piece.ends_document for piece in batch], tokenizer.eot_id)
    progress.update(sum(piece.size for piece in batch))
    rate = writer.tokens / max(time.monotonic() - started, 1e-9)
    progress.set_postfix_str(f"{writer.tokens:,} tokens, {rate:,.0f} tokens/s", refresh=False)


def progress_bar(label: str, total: int | None, unit: str) -> Any:
    from tqdm import tqdm  # imported here: only a build draws a progress bar

    # No monitor thread: the launcher prepares data and then forks its workers, and forking
    # while another thread runs can deadlock the child.
    tqdm.monitor_interval = 0
    # disable=None: silent when stderr is not a terminal (logs, pipes, tests).
    return tqdm(desc=label, total=total, unit=unit, unit_scale=True, file=sys.stderr, disable=None, leave=False, mininterval=0.5)
