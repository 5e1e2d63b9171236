"""Batches from a prepared dataset: memory-mapped, deterministic, sharded by rank.

A split's tokens are cut into non-overlapping windows of context_length + 1 tokens: window i is
tokens[i*T : i*T + T + 1]; its first T tokens are the input and its last T the target.

Training order is a pure function of (seed, epoch, rank, world_size, position): every epoch
permutes all windows with `np.random.default_rng([seed, epoch])`, rank r takes every
world_size-th window of that permutation, and consecutive batch_size slices of its share are its
batches. So (epoch, batch_index) is all a checkpoint needs to resume with exactly the next batch.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch
from torch import Tensor
from torch.utils.data import DataLoader, Dataset

from pretrain.data import DataError
from pretrain.data.prepare import DTYPES, REBUILD_HINT, check_batch_fits, read_meta, token_file, window_count

Batch = tuple[Tensor, Tensor]


class TokenWindows(Dataset):
    """The windows of one split, read from a read-only memory map (never copied into RAM).

    The map is opened lazily in each process, so DataLoader workers open their own instead of
    receiving a pickled copy of the whole array."""

    def __init__(self, dataset_dir: str | Path, split: str, context_length: int) -> None:
        meta = read_meta(dataset_dir)
        self.path = token_file(dataset_dir, split)
        self.dtype = DTYPES[meta["dtype"]]
        self.n_tokens: int = meta["tokens"][split]
        self.context_length = context_length
        self._tokens: np.memmap | None = None
        # The map would silently show a truncated file as a shorter dataset; refuse instead.
        size = self.path.stat().st_size if self.path.exists() else 0
        if size != self.n_tokens * self.dtype.itemsize:
            raise DataError(f"{self.path}: {size} bytes on disk, but meta.json promises {self.n_tokens} "
                            f"tokens of {meta['dtype']}; {REBUILD_HINT}")

    def __len__(self) -> int:
        return window_count(self.n_tokens, self.context_length)

    def __getitem__(self, index: int) -> Batch:
        if not 0 <= index < len(self):
            raise IndexError(f"window {index} out of range (0..{len(self) - 1})")
        start = index * self.context_length
        window = torch.from_numpy(self.tokens[start:start + self.context_length + 1].astype(np.int64))
        return window[:-1], window[1:]

    def batch(self, indices: list[int]) -> Batch:
        """The windows at indices, stacked into (len(indices), T) inputs and targets."""
        return stack_windows([self[i] for i in indices])

    @property
    def tokens(self) -> np.memmap:
        if self._tokens is None:
            self._tokens = np.memmap(self.path, dtype=self.dtype, mode="r")
        return self._tokens

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_tokens": None}


def stack_windows(windows: list[Batch]) -> Batch:
    """Collate (x, y) windows into a batch; a tuple, where DataLoader's default gives a list."""
    inputs, targets = zip(*windows)
    return torch.stack(inputs), torch.stack(targets)


class TrainBatches:
    """Endless training batches (x, y) of shape (batch_size, context_length) for one rank.

    Iterating starts at the position of state_dict() and continues across epochs forever.
    state_dict() always names the next batch the iteration will yield, so saving it with a
    checkpoint and calling load_state_dict() on a new TrainBatches resumes exactly there."""

    def __init__(self, dataset_dir: str | Path, context_length: int, batch_size: int, rank: int,
                 world_size: int, seed: int, num_workers: int, pin_memory: bool = False) -> None:
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is not in 0..{world_size - 1}")
        check_batch_fits(dataset_dir, context_length, batch_size, world_size)
        self.windows = TokenWindows(dataset_dir, "train", context_length)
        self.batch_size, self.rank, self.world_size, self.seed = batch_size, rank, world_size, seed
        self.num_workers, self.pin_memory = num_workers, pin_memory
        self.epoch, self.batch_index = 0, 0

    @property
    def batches_per_epoch(self) -> int:
        """Equal on every rank: each rank's share is cut to the smallest share, in whole batches."""
        return len(self.windows) // self.world_size // self.batch_size

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
                            f"{self.batches_per_epoch} batches; did the dataset, batch size or world size change?")
        self.epoch, self.batch_index = epoch, batch_index

    def __iter__(self) -> Iterator[Batch]:
        start = (self.epoch, self.batch_index)
        for batch in self._batches(_IndexStream(self, *start)):
            # Advance before yielding: while the caller holds this batch, state_dict() names the next.
            self.batch_index += 1
            if self.batch_index == self.batches_per_epoch:
                self.epoch, self.batch_index = self.epoch + 1, 0
            yield batch

    def _batches(self, stream: _IndexStream) -> Iterator[Batch]:
        # With workers, batches are prefetched ahead of the caller. That is fine: the position
        # is counted in __iter__ as batches are handed out, not as workers produce them.
        loader = DataLoader(self.windows, batch_sampler=stream, num_workers=self.num_workers,
                            collate_fn=stack_windows, pin_memory=self.pin_memory)
        return iter(loader)


class _IndexStream:
    """Batch sampler for DataLoader: the window index lists from (epoch, batch_index) on, forever."""

    def __init__(self, batches: TrainBatches, epoch: int, batch_index: int) -> None:
        self.batches, self.epoch, self.batch_index = batches, epoch, batch_index

    def __iter__(self) -> Iterator[list[int]]:
        epoch, first = self.epoch, self.batch_index
        while True:
            for indices in self.batches.epoch_batches(epoch)[first:]:
                yield indices.tolist()
            epoch, first = epoch + 1, 0


def validation_batches(dataset_dir: str | Path, context_length: int, batch_size: int, rank: int,
                       world_size: int, num_batches: int) -> list[Batch]:
    """A fixed set of validation batches for this rank, the same on every call.

    The first num_batches * batch_size * world_size windows of val.bin (fewer when val is
    smaller), every world_size-th one to this rank. Every rank gets the same number of batches,
    at least one; when val cannot fill one full batch per rank, that one batch is smaller."""
    windows = TokenWindows(dataset_dir, "val", context_length)
    per_rank = min(num_batches * batch_size, len(windows) // world_size)
    if per_rank == 0:
        raise DataError(
            f"the val split ({windows.n_tokens} tokens) has {len(windows)} windows of {context_length + 1} tokens, "
            f"fewer than one per rank ({world_size}); "
            "increase data.val_fraction, reduce data.context_length or use fewer ranks")
    size = min(batch_size, per_rank)
    mine = list(range(rank, per_rank * world_size, world_size))
    return [windows.batch(mine[i:i + size]) for i in range(0, per_rank // size * size, size)]
