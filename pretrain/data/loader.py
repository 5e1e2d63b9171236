"""Batches from a prepared dataset: memory-mapped, deterministic, sharded by rank.

A split is a list of segments (see windows.py), each cut into non-overlapping windows of
context_length + 1 tokens that never cross a segment. The windows of all segments are numbered
globally, segment after segment; window i's first T tokens are the input, its last T the target.

Training order is a pure function of (seed, epoch, rank, world_size, position): every epoch
permutes all windows with `np.random.default_rng([seed, epoch])`, rank r takes every
world_size-th window of that permutation, and consecutive batch_size slices of its share are its
micro-batches. So (epoch, batch_index) is all a checkpoint needs to resume with exactly the next
batch.

DataLoader worker processes ignore the signals meant for the whole job (JOB_SIGNALS): Slurm
sends SIGTERM to every process of a job, a terminal sends Ctrl-C and hang-ups to a whole process
group. The training process decides how to stop (pretrain/run/stopping.py) and needs its workers for
the step it finishes; a worker that died of the signal would fail that step instead. Workers
still end with the training process: it shuts them down (at the latest at exit, _shut_down_at_exit),
and they leave on their own when it dies (torch's worker watchdog).
"""

from __future__ import annotations

import atexit
import os
import signal
import weakref
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import torch
from numpy.lib.stride_tricks import sliding_window_view
from torch import Tensor
from torch.utils.data import DataLoader, Dataset

from pretrain.data import DataError
from pretrain.data.cache import read_meta
from pretrain.data.windows import DTYPES, check_segment_file, open_segment, segments, steps_per_epoch
from pretrain.run.parent_death import die_with_parent

Batch = tuple[Tensor, Tensor]


class TokenIdError(DataError):
    """A token id the model cannot embed: the prepared data is damaged (never a reason to go on
    without validation, as a too-small val split is)."""


CHECK_HINT = (
    "check it with `python3 prepare_dataset.py --verify` (with the run's --preset/--config/--set "
    "options) and rebuild it with `--force`"
)

JOB_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
"""What DataLoader worker processes ignore: a stop is the training process's decision."""


class TokenWindows(Dataset):
    """The windows of one split, read from read-only memory maps (never copied into RAM).

    The maps are opened lazily in each process, so DataLoader workers open their own instead of
    receiving a pickled copy of the data. `batch` (and `__getitems__`, which DataLoader calls for a
    whole batch at once) gathers a batch with one fancy index when it lies in one segment."""

    def __init__(self, dataset_dir: str | Path, split: str, context_length: int, meta: dict[str, Any] | None = None) -> None:
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
            self._views = [
                sliding_window_view(tokens.view(np.ndarray), T + 1)[::T][:count]
                if (count := segment.window_count(T))
                else np.empty((0, T + 1), tokens.dtype)
                for segment, tokens in zip(self.segments, self.maps, strict=True)
            ]
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
        for row, (k, j) in enumerate(zip(segment.tolist(), local.tolist(), strict=True)):
            windows[row] = views[k][j]
        return windows

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_maps": None, "_views": None}

    def id_error(self, window: int, column: int, vocab_size: int) -> TokenIdError:
        """The one-line error for an id beyond vocab_size at column of window (a global index):
        it names the file and the byte, so the damage can be found."""
        k = int(np.searchsorted(self.starts, window, side="right") - 1)
        segment = self.segments[k]
        position = (window - int(self.starts[k])) * self.context_length + column  # in the segment
        token = int(self.maps[k][position])
        offset = segment.offset + position * DTYPES[segment.dtype].itemsize
        return TokenIdError(
            f"{segment.path(self.dataset_dir)}: token id {token:,} at byte {offset:,} is beyond "
            f"the model's vocabulary of {vocab_size:,}: the prepared dataset {self.dataset_dir} is "
            f"damaged; {CHECK_HINT}"
        )


def out_of_vocabulary(batch: Batch, vocab_size: int) -> tuple[int, int] | None:
    """(row, column in its window of T + 1) of the first id >= vocab_size in batch, else None.

    Checked on the host before a batch goes to the device, where an embedding lookup would fail
    as an IndexError traceback (CPU) or a device-side assert (CUDA) naming neither the file nor
    the fix. The cache's own check (sizes, meta.json) cannot see bytes damaged in place; the ids
    are unsigned, so the max is all there is to check: one pass over the batch."""
    x, y = (tensor.numpy() for tensor in batch)  # numpy's max: several times faster than torch's on CPU
    if not x.size:
        return None
    # A window's ids are its inputs' first column and its targets.
    if max(int(x[:, 0].max()), int(y.max())) < vocab_size:
        return None
    rows, columns = np.nonzero(np.concatenate([x[:, :1], y], axis=1) >= vocab_size)
    return int(rows[0]), int(columns[0])


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

    def __init__(
        self,
        dataset_dir: str | Path,
        context_length: int,
        batch_size: int,
        rank: int,
        world_size: int,
        seed: int,
        num_workers: int,
        pin_memory: bool = False,
        grad_accum: int = 1,
        vocab_size: int | None = None,
    ) -> None:
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is not in 0..{world_size - 1}")
        meta = read_meta(dataset_dir)
        steps = steps_per_epoch(meta, context_length, batch_size, grad_accum, world_size)
        self.windows = TokenWindows(dataset_dir, "train", context_length, meta)
        self.batch_size, self.rank, self.world_size, self.seed = batch_size, rank, world_size, seed
        self.num_workers, self.pin_memory, self.grad_accum = num_workers, pin_memory, grad_accum
        self.batches_per_epoch = steps * grad_accum  # micro-batches, equal on every rank
        self.epoch, self.batch_index = 0, 0
        self.vocab_size = vocab_size
        """Every id handed out is checked to be below it (None: unchecked); see out_of_vocabulary."""

    def epoch_batches(self, epoch: int) -> np.ndarray:
        """This rank's window indices for epoch, shape (batches_per_epoch, batch_size)."""
        order = np.random.default_rng([self.seed, epoch]).permutation(len(self.windows))
        used = self.batches_per_epoch * self.batch_size
        return order[self.rank :: self.world_size][:used].reshape(self.batches_per_epoch, self.batch_size)

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "batch_index": self.batch_index}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Resume at state; takes effect at the next iter()."""
        epoch, batch_index = int(state["epoch"]), int(state["batch_index"])
        if epoch < 0 or not 0 <= batch_index < self.batches_per_epoch:
            raise DataError(
                f"cannot resume data at epoch {epoch}, batch {batch_index}: an epoch has "
                f"{self.batches_per_epoch} batches; did the dataset, batch size, gradient "
                "accumulation or world size change?"
            )
        self.epoch, self.batch_index = epoch, batch_index

    def __iter__(self) -> Iterator[Batch]:
        for batch in self._batches(_IndexStream(self, self.epoch, self.batch_index)):
            if self.vocab_size is not None and (bad := out_of_vocabulary(batch, self.vocab_size)) is not None:
                row, column = bad  # this batch's windows are the epoch's at the position not yet advanced
                window = int(self.epoch_batches(self.epoch)[self.batch_index][row])
                raise self.windows.id_error(window, column, self.vocab_size)
            # Advance before yielding: while the caller holds this batch, state_dict() names the next.
            self.batch_index += 1
            if self.batch_index == self.batches_per_epoch:
                self.epoch, self.batch_index = self.epoch + 1, 0
            yield batch

    def _batches(self, stream: _IndexStream) -> Iterator[Batch]:
        if self.num_workers == 0:
            # In process, without DataLoader: its per-batch machinery costs more than the gather.
            batches = map(self.windows.batch, stream)
            return ((x.pin_memory(), y.pin_memory()) for x, y in batches) if self.pin_memory else batches
        # With workers, batches are prefetched ahead of the caller. That is fine: the position
        # is counted in __iter__ as batches are handed out, not as workers produce them.
        # Not persistent_workers: the stream never ends, so one iterator (one set of workers)
        # serves every epoch, and each iter(self) starts a new one through start_workers.
        # torch's stubs want lists of indices and a collate over lists; the dataset's __getitems__
        # takes the index arrays as they are, and hands back the finished batch.
        loader = DataLoader(
            self.windows,
            batch_sampler=stream,  # type: ignore[arg-type]
            num_workers=self.num_workers,
            collate_fn=as_is,  # type: ignore[arg-type]
            pin_memory=self.pin_memory,
            # fork (Linux's default up to Python 3.13, named so it stays): the
            # workers inherit start_workers's signal mask, and the dataset without pickling.
            multiprocessing_context="fork",
            worker_init_fn=ignore_job_signals,
        )
        return start_workers(loader)


def start_workers(loader: DataLoader) -> Iterator[Batch]:
    """iter(loader), its worker processes deaf to JOB_SIGNALS (their worker_init_fn must be
    ignore_job_signals). The signals stay blocked while the workers are forked, and the workers
    inherit the mask, so none can reach a worker before it ignores them; one that reaches this
    process meanwhile is delivered to its handler when they are unblocked here."""
    global _trainer_pid
    _trainer_pid = os.getpid()
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, JOB_SIGNALS)
    try:
        batches = iter(loader)
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)
    _live_iterators.add(batches)
    return batches


def ignore_job_signals(worker_id: int) -> None:
    """worker_init_fn: ignore JOB_SIGNALS, then unblock them (start_workers blocked them), and
    die with the training process.

    Dying with it matters beyond tidiness: a forked worker holds copies of the training process's
    sockets, the collective's connections to its peers included. Were the training process
    killed (SIGKILL, the OOM killer), its peers would learn of it only once these copies close:
    when torch's watchdog notices, up to 5 s later, since SIGTERM no longer ends the workers."""
    for sig in JOB_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, JOB_SIGNALS)
    die_with_parent(_trainer_pid)


_trainer_pid = os.getpid()
"""The process that forks the DataLoader workers (set again in start_workers, before the fork)."""


_live_iterators: weakref.WeakSet[Iterator[Batch]] = weakref.WeakSet()


@atexit.register  # after torch's own atexit hooks are registered, so it runs before them
def _shut_down_at_exit() -> None:
    """Shut down the workers of iterators still referenced at exit (a traceback or a cycle
    keeps them). torch leaves those to multiprocessing's exit handler, which SIGTERMs its daemonic
    children and waits for them: for workers that ignore SIGTERM, forever. One that does not
    leave within torch's own wait is killed."""
    for batches in list(_live_iterators):
        try:
            batches._shutdown_workers()  # type: ignore[attr-defined]  # what torch runs when one is deleted
        finally:
            for worker in batches._workers:  # type: ignore[attr-defined]
                if worker.is_alive():
                    worker.kill()
                    worker.join()


class _IndexStream:
    """Batch sampler for DataLoader: the window index arrays from (epoch, batch_index) on, forever."""

    def __init__(self, batches: TrainBatches, epoch: int, batch_index: int) -> None:
        self.batches, self.epoch, self.batch_index = batches, epoch, batch_index

    def __iter__(self) -> Iterator[np.ndarray]:
        epoch, first = self.epoch, self.batch_index
        while True:
            yield from self.batches.epoch_batches(epoch)[first:]
            epoch, first = epoch + 1, 0


class ValBatch(NamedTuple):
    """A validation batch and the windows it adds to the mean: its rows, or 0 for a stand-in."""

    inputs: Tensor
    targets: Tensor
    windows: int


def validation_split(windows: int, batch_size: int, rank: int, world_size: int) -> list[np.ndarray]:
    """This rank's batches of window indices out of the first `windows` windows of val: every
    world_size-th one from rank on, batch_size at a time (the last may be smaller).

    Every rank gets as many batches as the rank with the most windows, because every rank must run
    as many forward passes (FSDP all-gathers the weights in each): where windows do not divide
    evenly over the ranks, a rank whose share runs out sooner gets empty batches to fill up with."""
    count = -(-windows // world_size)  # rank 0's share, the largest
    mine = np.arange(rank, windows, world_size)
    return [mine[i : i + batch_size] for i in range(0, count, batch_size)]


def validation_batches(
    dataset_dir: str | Path,
    context_length: int,
    batch_size: int,
    rank: int,
    world_size: int,
    num_batches: int,
    vocab_size: int | None = None,
    grad_accum: int = 1,
) -> list[ValBatch]:
    """A fixed set of validation batches for this rank, the same on every call.

    Validation covers the same windows whatever the number of ranks: the first num_batches global
    batches of val (num_batches * batch_size * grad_accum * world_size windows, all of val when it
    is smaller), shared out by validation_split. Each batch counts its windows towards the mean;
    a stand-in batch (the first windows of val, to keep the ranks' forward passes matched) counts
    none. Ids are checked against vocab_size when given (see out_of_vocabulary)."""
    windows = TokenWindows(dataset_dir, "val", context_length)
    if len(windows) == 0:
        raise DataError(
            f"the val split ({windows.n_tokens:,} tokens) has no window of {context_length + 1} tokens; "
            "increase data.val_fraction or reduce data.context_length"
        )
    total = min(num_batches * batch_size * grad_accum * world_size, len(windows))
    stand_in = np.arange(min(batch_size, total))
    batches = []
    for indices in validation_split(total, batch_size, rank, world_size):
        x, y = windows.batch(indices if indices.size else stand_in)
        if indices.size and vocab_size is not None and (bad := out_of_vocabulary((x, y), vocab_size)) is not None:
            raise windows.id_error(int(indices[bad[0]]), bad[1], vocab_size)
        batches.append(ValBatch(x, y, int(indices.size)))
    return batches
