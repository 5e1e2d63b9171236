"""Batches from a prepared dataset: memory-mapped, deterministic, sharded by rank.

A split is a list of segments (see windows.py), each cut into non-overlapping windows of
context_length + 1 tokens that never cross a segment. The windows of all segments are numbered
globally, segment after segment; window i's first T tokens are the input, its last T the target.

Training order is a pure function of (seed, epoch, rank, world_size, position): every epoch
permutes all windows with `np.random.default_rng([seed, epoch])`, rank r takes every
world_size-th window of that permutation, and consecutive batch_size slices of its share are its
micro-batches. So (epoch, batch_index) is all a checkpoint needs to resume with exactly the next
batch.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from numpy.lib.stride_tricks import sliding_window_view
from torch import Tensor
from torch.utils.data import DataLoader, Dataset

from pretrain.data import DataError
from pretrain.data.cache import read_meta
from pretrain.data.windows import DTYPES, check_segment_file, open_segment, segments, steps_per_epoch

Batch = tuple[Tensor, Tensor]


class TokenWindows(Dataset):
    """The windows of one split, read from read-only memory maps (never copied into RAM).

    The maps are opened lazily in each process, so DataLoader workers open their own instead of
    receiving a pickled copy of the data. `batch` (and `__getitems__`, which DataLoader calls for a
    whole batch at once) gathers a batch with one fancy index when it lies in one segment."""

    def __init__(self, dataset_dir: str | Path, split: str, context_length: int,
                 meta: dict[str, Any] | None = None) -> None:
        self.dataset_dir = Path(dataset_dir)
        self.segments = segments(read_meta(dataset_dir) if meta is None else meta, split)
        for segment in self.segments:  # fail now, naming the file, not hours in at the first short read
            check_segment_file(self.dataset_dir, segment)
        self.context_length = context_length
        self.n_tokens = sum(segment.tokens for segment in self.segments)
        # starts[k] is the global index of segment k's first window; starts[-1] is the total.
        self.starts = np.cumsum([0, *(segment.window_count(context_length) for segment in self.segments)])
        self.dtype = np.result_type(*(DTYPES[segment.dtype] for segment in self.segments), np.uint16)
        self._maps: list[np.ndarray] | None = None
        self._views: list[np.ndarray] | None = None

    def __len__(self) -> int:
        return int(self.starts[-1])

    @property
    def maps(self) -> list[np.ndarray]:
        """Each segment's tokens, memory-mapped read-only on first use in this process."""
        if self._maps is None:
            self._maps = [open_segment(self.dataset_dir, segment) for segment in self.segments]
        return self._maps

    @property
    def views(self) -> list[np.ndarray]:
        """Each segment's windows as a (windows, T + 1) view of its map: rows overlap by one token,
        nothing is copied, and a batch is one fancy index of rows."""
        if self._views is None:
            T = self.context_length
            self._views = [sliding_window_view(tokens.view(np.ndarray), T + 1)[::T][:count]
                           if (count := segment.window_count(T)) else np.empty((0, T + 1), tokens.dtype)
                           for segment, tokens in zip(self.segments, self.maps)]
        return self._views

    def __getitem__(self, index: int) -> Batch:
        """Window index as (input, target), each of shape (T,)."""
        x, y = self.batch([index])
        return x[0], y[0]

    def batch(self, indices: Sequence[int] | np.ndarray) -> Batch:
        """The windows at global indices as contiguous int64 (inputs, targets) of shape (len, T)."""
        indices = np.asarray(indices, dtype=np.int64)
        if indices.size and not (0 <= indices.min() and indices.max() < len(self)):
            raise IndexError(f"window index out of range 0..{len(self) - 1}: {indices.tolist()}")
        windows = self._gather(indices)
        return torch.from_numpy(windows[:, :-1].astype(np.int64)), torch.from_numpy(windows[:, 1:].astype(np.int64))

    def __getitems__(self, indices: Sequence[int] | np.ndarray) -> Batch:
        """DataLoader's batched fetch: the whole batch at once; pair with collate_fn=as_is."""
        return self.batch(indices)

    def _gather(self, indices: np.ndarray) -> np.ndarray:
        """(len(indices), T + 1) token windows, in the order asked."""
        views = self.views
        if len(views) == 1:
            return views[0][indices]
        segment = np.searchsorted(self.starts, indices, side="right") - 1
        local = indices - self.starts[segment]
        first = segment[0] if segment.size else 0
        if (segment == first).all():
            return views[first][local]
        windows = np.empty((len(indices), self.context_length + 1), self.dtype)
        # Row by row: one memcpy each, measured twice as fast as grouping rows by segment with
        # masks (numpy's per-call overhead exceeds copying a window; 50 shards, batch 8 or 64).
        for row, (k, j) in enumerate(zip(segment.tolist(), local.tolist())):
            windows[row] = views[k][j]
        return windows

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_maps": None, "_views": None}


def as_is(batch: Batch) -> Batch:
    """DataLoader collate_fn for a batch __getitems__ already built (module level: picklable)."""
    return batch


class TrainBatches:
    """Endless training micro-batches (x, y) of shape (batch_size, context_length) for one rank.

    An epoch is steps_per_epoch * grad_accum micro-batches on every rank, so an optimizer step
    never straddles two epochs. Iterating starts at the position of state_dict() and continues
    across epochs forever. state_dict() always names the next batch the iteration will yield, so
    saving it with a checkpoint and calling load_state_dict() on a new TrainBatches resumes
    exactly there."""

    def __init__(self, dataset_dir: str | Path, context_length: int, batch_size: int, rank: int,
                 world_size: int, seed: int, num_workers: int, pin_memory: bool = False,
                 grad_accum: int = 1) -> None:
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is not in 0..{world_size - 1}")
        meta = read_meta(dataset_dir)
        steps = steps_per_epoch(meta, context_length, batch_size, grad_accum, world_size)
        self.windows = TokenWindows(dataset_dir, "train", context_length, meta)
        self.batch_size, self.rank, self.world_size, self.seed = batch_size, rank, world_size, seed
        self.num_workers, self.pin_memory, self.grad_accum = num_workers, pin_memory, grad_accum
        self.batches_per_epoch = steps * grad_accum  # micro-batches, equal on every rank
        self.epoch, self.batch_index = 0, 0

    def epoch_batches(self, epoch: int) -> np.ndarray:
        """This rank's window indices for epoch, shape (batches_per_epoch, batch_size)."""
        order = np.random.default_rng([self.seed, epoch]).permutation(len(self.windows))
        used = self.batches_per_epoch * self.batch_size
        return order[self.rank::self.world_size][:used].reshape(self.batches_per_epoch, self.batch_size)

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "batch_index": self.batch_index}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Resume at state; takes effect at the next iter()."""
        epoch, batch_index = int(state["epoch"]), int(state["batch_index"])
        if epoch < 0 or not 0 <= batch_index < self.batches_per_epoch:
            raise DataError(f"cannot resume data at epoch {epoch}, batch {batch_index}: an epoch has "
                            f"{self.batches_per_epoch} batches; did the dataset, batch size, gradient "
                            "accumulation or world size change?")
        self.epoch, self.batch_index = epoch, batch_index

    def __iter__(self) -> Iterator[Batch]:
        for batch in self._batches(_IndexStream(self, self.epoch, self.batch_index)):
            # Advance before yielding: while the caller holds this batch, state_dict() names the next.
            self.batch_index += 1
            if self.batch_index == self.batches_per_epoch:
                self.epoch, self.batch_index = self.epoch + 1, 0
            yield batch

    def _batches(self, stream: _IndexStream) -> Iterator[Batch]:
        if self.num_workers == 0:
            # In process, without DataLoader: its per-batch machinery costs more than the gather.
            batches = map(self.windows.batch, stream)
            return (tuple(t.pin_memory() for t in batch) for batch in batches) if self.pin_memory else batches
        # With workers, batches are prefetched ahead of the caller. That is fine: the position
        # is counted in __iter__ as batches are handed out, not as workers produce them.
        loader = DataLoader(self.windows, batch_sampler=stream, num_workers=self.num_workers,
                            collate_fn=as_is, pin_memory=self.pin_memory)
        return iter(loader)


class _IndexStream:
    """Batch sampler for DataLoader: the window index arrays from (epoch, batch_index) on, forever."""

    def __init__(self, batches: TrainBatches, epoch: int, batch_index: int) -> None:
        self.batches, self.epoch, self.batch_index = batches, epoch, batch_index

    def __iter__(self) -> Iterator[np.ndarray]:
        epoch, first = self.epoch, self.batch_index
        while True:
            yield from self.batches.epoch_batches(epoch)[first:]
            epoch, first = epoch + 1, 0


def validation_batches(dataset_dir: str | Path, context_length: int, batch_size: int, rank: int,
                       world_size: int, num_batches: int) -> list[Batch]:
    """A fixed set of validation batches for this rank, the same on every call.

    The first num_batches * batch_size * world_size windows of val (fewer when val is smaller),
    every world_size-th one to this rank. Every rank gets the same number of batches, at least
    one; when val cannot fill one full batch per rank, that one batch is smaller."""
    windows = TokenWindows(dataset_dir, "val", context_length)
    per_rank = min(num_batches * batch_size, len(windows) // world_size)
    if per_rank == 0:
        raise DataError(
            f"the val split ({windows.n_tokens:,} tokens) has {len(windows):,} windows of {context_length + 1} "
            f"tokens, fewer than one per rank ({world_size}); "
            "increase data.val_fraction, reduce data.context_length or use fewer ranks")
    size = min(batch_size, per_rank)
    mine = np.arange(rank, per_rank * world_size, world_size)
    return [windows.batch(mine[i:i + size]) for i in range(0, per_rank // size * size, size)]
