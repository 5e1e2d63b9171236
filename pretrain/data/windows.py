"""Where a prepared dataset's tokens are, how many training windows they hold, how long a run is.

meta.json (format_version 2) lists each split as segments: a run of `tokens` little-endian ids of
`dtype` starting `offset` bytes into `file`. `file` is relative to the dataset directory or
absolute, so pre-tokenized shards (llm.c `.bin`, 1,024-byte header) are used in place, and train
and val may share one file at different offsets.

A segment of n tokens holds (n - 1) // T non-overlapping windows of T + 1 tokens (window i is
tokens[i*T : i*T + T + 1]: T inputs and T targets). Windows never cross segments: the end of one
shard and the start of the next are unrelated text.

Numpy only, never torch: the launcher imports this to check a run before it spawns anyone, and it
has to start fast. The batches themselves are in loader.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeGuard

import numpy as np

from pretrain.data import DataError

# Explicitly little-endian, the layout llm.c-style .bin files use, whatever machine reads it.
DTYPES: dict[str, np.dtype] = {"uint16": np.dtype("<u2"), "uint32": np.dtype("<u4")}
REBUILD_HINT = "rebuild it with `python3 prepare_dataset.py --force`"


@dataclass(frozen=True)
class Segment:
    """One run of a split's tokens in one file; see the module docstring."""

    file: str
    offset: int
    """Bytes before the first token: where the split starts, or a shard's header."""
    tokens: int
    dtype: str
    """A key of DTYPES."""

    def path(self, dataset_dir: str | Path) -> Path:
        """The file; an absolute `file` stays as it is."""
        return Path(dataset_dir) / self.file

    @property
    def nbytes(self) -> int:
        return self.tokens * DTYPES[self.dtype].itemsize

    def window_count(self, context_length: int) -> int:
        return window_count(self.tokens, context_length)


def window_count(n_tokens: int, context_length: int) -> int:
    """Non-overlapping windows of context_length + 1 tokens in n_tokens consecutive tokens."""
    return max(0, (n_tokens - 1) // context_length)


def segments(meta: dict[str, Any], split: str) -> list[Segment]:
    """The segments of split in meta.json, validated: DataError, one line, when malformed."""
    splits = meta.get("splits")
    entries = splits.get(split) if isinstance(splits, dict) else None
    if not isinstance(entries, list):
        raise DataError(f"meta.json lists no {split!r} split as a list of segments; {REBUILD_HINT}")
    return [_segment(entry, split, i) for i, entry in enumerate(entries)]


def _segment(entry: Any, split: str, i: int) -> Segment:
    def bad(why: str) -> DataError:
        return DataError(f"meta.json: {split} segment {i} {why}; {REBUILD_HINT}")

    if not isinstance(entry, dict):
        raise bad("is not an object")
    file, offset, tokens, dtype = (entry.get(key) for key in ("file", "offset", "tokens", "dtype"))
    if not isinstance(file, str) or not file:
        raise bad("has no file")
    if not _is_count(offset):
        raise bad(f"has offset {offset!r}, not a count >= 0")
    if not _is_count(tokens):
        raise bad(f"has tokens {tokens!r}, not a count >= 0")
    if dtype not in DTYPES:
        raise bad(f"has dtype {dtype!r}, not one of {', '.join(DTYPES)}")
    return Segment(file, offset, tokens, dtype)


def _is_count(value: Any) -> TypeGuard[int]:
    """An int >= 0; bool is an int to Python, but true is no byte count."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def split_tokens(meta: dict[str, Any], split: str) -> int:
    return sum(segment.tokens for segment in segments(meta, split))


def split_window_count(meta: dict[str, Any], split: str, context_length: int) -> int:
    """Windows in split: the sum over its segments, since no window crosses two."""
    return sum(segment.window_count(context_length) for segment in segments(meta, split))


def check_segment_file(dataset_dir: str | Path, segment: Segment) -> Path:
    """The segment's file, after making sure it holds every token meta.json promises.

    A memory map of a short file would fail only when a batch reaches the missing part, possibly
    hours into a run; a longer file is fine (a shared file, or a shard with a trailer)."""
    path = segment.path(dataset_dir)
    size = path.stat().st_size if path.is_file() else None
    needed = segment.offset + segment.nbytes
    if size is None or size < needed:
        found = "missing" if size is None else f"{size:,} bytes on disk"
        raise DataError(
            f"{path}: {found}, but meta.json promises {segment.tokens:,} tokens of {segment.dtype} "
            f"from byte {segment.offset:,} ({needed:,} bytes); {REBUILD_HINT}"
        )
    return path


def open_segment(dataset_dir: str | Path, segment: Segment) -> np.ndarray:
    """The segment's tokens as a read-only memory map: pages come from the page cache on demand,
    shared by every process that maps the file, never copied into each one's RAM."""
    path = check_segment_file(dataset_dir, segment)
    if segment.tokens == 0:  # nothing to map, and mmap refuses a length of 0
        return np.empty(0, DTYPES[segment.dtype])
    return np.memmap(path, dtype=DTYPES[segment.dtype], mode="r", offset=segment.offset, shape=(segment.tokens,))


def steps_per_epoch(meta: dict[str, Any], context_length: int, batch_size: int, grad_accum: int, world_size: int) -> int:
    """Optimizer steps in one pass over the train windows, equal on every rank; DataError, with
    the numbers and the fix, when the train split cannot fill even one."""
    n_windows = split_window_count(meta, "train", context_length)
    per_step = batch_size * grad_accum
    steps = n_windows // world_size // per_step
    if steps == 0:
        raise DataError(
            f"the train split ({split_tokens(meta, 'train'):,} tokens) has {n_windows:,} windows of "
            f"{context_length + 1} tokens, fewer than one optimizer step needs: batch_size {batch_size} x "
            f"grad_accum_nums {grad_accum} x {world_size} rank(s) = {per_step * world_size:,}; "
            "reduce training.batch_size, training.grad_accum_nums or data.context_length, or add data"
        )
    return steps


@dataclass(frozen=True)
class RunLength:
    """How long a run is, in windows, steps, epochs and tokens: computed once, logged once."""

    windows: int
    """Train windows in the dataset (all ranks together)."""
    steps_per_epoch: int
    total_steps: int
    tokens_per_step: int
    epochs: float
    """total_steps / steps_per_epoch: whole when the run is set in epochs."""
    batch_size: int
    context_length: int
    grad_accum: int
    world_size: int
    train_tokens: int
    """Tokens in the prepared train split."""

    @property
    def tokens(self) -> int:
        """Tokens the run reads."""
        return self.total_steps * self.tokens_per_step

    def describe(self) -> str:
        """One line for the log."""
        if self.total_steps % self.steps_per_epoch == 0:
            n = self.total_steps // self.steps_per_epoch
            length = f"{n:,} epoch{'s' * (n != 1)} = {self.total_steps:,} steps"
        else:
            length = f"{self.total_steps:,} steps = {self.epochs:.2f} epochs"
        return (
            f"{self.steps_per_epoch:,} optimizer steps per epoch of {self.windows:,} windows; {length}; "
            f"{self.tokens_per_step:,} tokens per step (batch {self.batch_size} x context "
            f"{self.context_length} x accum {self.grad_accum} x {self.world_size} "
            f"rank{'s' * (self.world_size != 1)}); reads {token_count(self.tokens)} tokens of "
            f"{token_count(self.train_tokens)} prepared{self._repeats()}"
        )

    def _repeats(self) -> str:
        """Said when the run sees its data more than once: with a max_steps run, a hint that the
        data is too small for it."""
        if self.total_steps <= self.steps_per_epoch:
            return ""
        return f": repeats the data ~{self.epochs:.1f} times"


def token_count(n: int) -> str:
    """A token count for people: 454,415, 61.2M, 5.24B."""
    if n >= 10**9:
        return f"{n / 1e9:.2f}B"
    if n >= 10**7:
        return f"{n / 1e6:.1f}M"
    return f"{n:,}"


def plan_run(
    meta: dict[str, Any], context_length: int, batch_size: int, grad_accum: int, world_size: int, epochs: int, max_steps: int
) -> RunLength:
    """The run's length: `epochs` whole epochs when epochs > 0, else max_steps steps.

    An epoch is a whole number of optimizer steps, the same on every rank (see TrainBatches);
    the windows that cannot fill one more step on every rank wait for the next epoch's order."""
    per_epoch = steps_per_epoch(meta, context_length, batch_size, grad_accum, world_size)
    total = epochs * per_epoch if epochs > 0 else max_steps
    return RunLength(
        windows=split_window_count(meta, "train", context_length),
        steps_per_epoch=per_epoch,
        total_steps=total,
        tokens_per_step=batch_size * context_length * grad_accum * world_size,
        epochs=total / per_epoch,
        batch_size=batch_size,
        context_length=context_length,
        grad_accum=grad_accum,
        world_size=world_size,
        train_tokens=split_tokens(meta, "train"),
    )
