"""Checkpoints written while training goes on (training.async_checkpoint).

A save blocks the step only while the state is copied to host memory (staged: pinned on a GPU,
a plain copy on CPU, where training changes the same tensors in place); then a thread writes
the copy while the next steps run. Under FSDP (and HSDP) that is DCP's asynchronous save, its collectives
on a gloo group of their own (CheckpointWriter.group, made by every rank at build), so they never
interleave with training's; for the single-file format (one process, DDP) the writer of the directory (rank 0)
writes model.pt and optimizer.pt from its copy. What a resume needs besides the tensors
(state.json, config.json, each rank's random generators) is small: written at staging, so the
data, schedule and random positions are those of the staged step.

A checkpoint is complete, as a synchronous one, only once every rank's files are on disk: each
rank's thread fsyncs its files and then writes a marker (.written_rank<r>) into <name>.tmp/; the
directory's writer (rank 0, or each node's first rank for a per-node tier) waits, in its thread,
for the markers of the ranks whose files go there, removes them, renames <name>.tmp to <name>
and prunes the tier (pretrain/checkpoint/save_restore.py complete). No thread runs a collective
but DCP's on its own group. A kill in between leaves <name>.tmp, which nothing reads and the
next save removes.

At most one save is in flight: the next one, a stop signal and the end of the run first wait
for it (wait: each rank's own write, a barrier on the training thread, then the rename), and
that wait counts as stall, once: to the save that waited (a next save's record), else to the
save waited for. A write that failed is raised at the next poll() (each step's start, no
collective, no device sync) as a synchronous save raises it: CheckpointError, one line naming
the file (exit 2); a peer lost during DCP's background collectives, PeerFailed (one line).

The writing threads are daemon threads: a run that ends with a save in flight (an error, a
lost peer that never writes its marker) is never kept alive by them. close() (train() calls it
whatever the end of fit) drops a save not yet complete: nothing reports it, and its
<name>.tmp stays for the next save to remove.
"""

from __future__ import annotations

import shutil
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch.distributed as dist

from pretrain.checkpoint import save_restore
from pretrain.checkpoint.dcp_files import DIRECTORY, dcp_async_save, save_error
from pretrain.checkpoint.files import CheckpointError, first_line
from pretrain.checkpoint.model_state import sharded_content
from pretrain.checkpoint.staging import KeptBuffers
from pretrain.checkpoint.tiers import Tier, TierName
from pretrain.checkpoint.trainer_state import TrainerState
from pretrain.distributed.parallel import has_fsdp
from pretrain.distributed.peer_loss import PeerFailed, peer_gone


MARKER = ".written_rank{rank}"
"""The file a rank writes into <name>.tmp/ once its files there are on disk."""
MARKER_POLL_S = 0.02
"""How often the directory's writer looks for the other ranks' markers (in its own thread)."""

HookFn = Callable[[Path], None]
SmallFiles = Callable[[Path], None]
_test_hook: HookFn | None = None
"""Tests only: called in the writing thread with <name>.tmp once the small files are written
and before the tensors are (a handshake that holds the write), None otherwise."""


class _Dropped(Exception):
    """A save close() gave up before it was complete (never reported)."""


@dataclass
class _Save:
    steps_done: int
    tier: Tier
    final: Path
    tmp: Path
    asynchronous: bool
    started: float
    """perf_counter() when its staging (or its synchronous write) began."""
    stall: float = 0.0
    """Seconds the training thread was blocked for it."""
    finished: float | None = None
    """perf_counter() when it was complete (on this rank)."""
    note: str = ""
    written: Future[None] = field(default_factory=Future)
    """This rank's files are on disk and its marker written."""
    done: Future[None] | None = None
    """The whole job: on the directory's writer, the checkpoint renamed into place and pruned."""
    reported: bool = False
    quiet: bool = False
    """No line when complete (the caller says it), only the record."""


class CheckpointWriter:
    """What saves a Trainer's checkpoints (trainer.checkpoints): synchronously, or staged and
    written in the background (asynchronous). Every rank holds one and calls save, wait and
    poll alike; tiers maps a tier's name to where it saves ("durable" always; "local" when the
    local tier is on: pretrain/checkpoint/tiers.py)."""

    def __init__(self, trainer: TrainerState, asynchronous: bool, group: Any = None, tiers: dict[TierName, Tier] | None = None):
        self.trainer = trainer
        self.asynchronous = asynchronous
        self.group = group
        """The gloo group DCP's background collectives run on (FSDP, asynchronous); None otherwise."""
        self.tiers: dict[TierName, Tier] = dict(tiers or {})
        self.stall_seconds = 0.0
        """Seconds the training thread was blocked by checkpointing, in all: the saves' stalls
        (staging, waiting for a save in flight, synchronous saves) and unrecorded_seconds."""
        self.unrecorded_seconds = 0.0
        """The part of stall_seconds no save's record holds: listing the staging buffer to make,
        a wait (its barrier) for a save poll had reported already."""
        self.completed: list[tuple[int, str]] = []
        """(steps_done, tier name) of every save completed (on this rank), in order."""
        self._pending: _Save | None = None
        self._stager: KeptBuffers | None = None
        self._closing = threading.Event()
        self._warming: Future[None] | None = None

    # --- the training thread's calls ---------------------------------------------------

    def save(self, steps_done: int, tier: Tier, *, wait: bool = False, note: str = "", quiet: bool = False) -> Path:
        """Save the state after steps_done steps to tier (as step_<steps_done>) and return its
        final path, which exists once the save is complete: at once when synchronous or wait,
        else after the background write (poll and wait complete it). Every rank calls this.
        note: what the completion line says first ("Epoch 1 of 2 done"); quiet: no completion
        line (the caller's own says it: a stop's), only the metrics record."""
        entered = time.perf_counter()
        if (previous := self._complete_pending()) is not None:  # the one in flight first (at most one)
            self._report(previous)  # its record without this wait: the wait is this save's stall
        started = time.perf_counter()
        if not self.asynchronous:
            final = save_restore.save_to(self.trainer, steps_done, tier.directory, tier.keep, tier.per_node)
            job = _Save(steps_done, tier, final, final, False, started, note=note, quiet=quiet)
            job.finished = time.perf_counter()
            job.stall = job.finished - entered
            self.stall_seconds += job.stall
            self._report(job)
            return final
        job = self._stage(steps_done, tier, started, note)
        job.quiet = quiet
        job.stall = time.perf_counter() - entered
        self.stall_seconds += job.stall
        self._pending = job
        if wait:
            self.wait()
        return job.final

    def poll(self) -> None:
        """At each step's start (no collective, no device sync): raise the error of a background
        write that failed, as a synchronous save would have; report a save that completed."""
        if self._warming is None and self.asynchronous and self.trainer.optimizer.state:
            self._warm_up()  # once, after the first step (or a resume): the optimizer's state exists
        job = self._pending
        if job is None or job.reported or job.done is None or not job.done.done():
            return
        if (error := job.done.exception()) is not None:
            self._pending = None
            raise error
        self._report(job)

    def wait(self) -> None:
        """Block until the save in flight is complete on every rank (its error raised, as poll
        raises it), the time blocked charged to it. Every rank calls this at the same point: it
        ends with a barrier."""
        waited = time.perf_counter()
        had = self._pending is not None
        job = self._complete_pending()
        blocked = time.perf_counter() - waited
        self.stall_seconds += blocked if had else 0.0
        if job is None:  # reported already (poll): the barrier's wait is in no record
            self.unrecorded_seconds += blocked if had else 0.0
            return
        job.stall += blocked
        self._report(job)

    def close(self) -> None:
        """Release the staging memory (after the last wait, or whatever ended the run): a save
        still in flight is dropped (never reported; its thread gives up waiting for markers). A
        later save starts afresh."""
        self._closing.set()
        self._closing = threading.Event()
        self._pending = None
        if self._stager is not None:
            self._stager.close()
            self._stager = None
        self._warming = None

    def _complete_pending(self) -> _Save | None:
        """Wait for the save in flight, if any (its error raised), charging nothing: the caller
        charges the time to the save it belongs to. The save, unless reported already (by poll:
        a rank's own view, so every rank still takes the barrier)."""
        job, self._pending = self._pending, None
        if job is None:
            return None
        job.written.result()  # this rank's part, or its error
        if self.trainer.runtime.distributed:
            dist.barrier()  # every rank's marker is there: the writer's thread renames at once
        assert job.done is not None
        job.done.result()
        if self.trainer.runtime.distributed:
            dist.barrier()  # no rank goes on before the checkpoint is renamed into place
        if job.finished is None:
            job.finished = time.perf_counter()
        return None if job.reported else job

    # --- staging --------------------------------------------------------------------------

    def _warm_up(self) -> None:
        """Have a thread allocate the staging buffer while training goes on (its page faults
        would otherwise fall on the first save: 2.7 s for 0.9 GB on this machine)."""
        started = time.perf_counter()
        trainer = self.trainer
        if has_fsdp(trainer.model):
            content = sharded_content(trainer.model, trainer.optimizer)
        elif save_restore.writes_directory(trainer.runtime, per_node=any(t.per_node for t in self.tiers.values())):
            content = save_restore.full_content(trainer)
        else:  # this rank stages nothing
            self._warming = Future()
            self._warming.set_result(None)
            return
        specs = self._staging().reserve(content)
        self._warming = _in_thread(self._staging().allocate, specs)
        spent = time.perf_counter() - started
        self.unrecorded_seconds += spent
        self.stall_seconds += spent

    def _stage(self, steps_done: int, tier: Tier, started: float, note: str) -> _Save:
        trainer, runtime = self.trainer, self.trainer.runtime
        if self._warming is not None:
            self._warming.result()  # the buffer being made (a save soon after the first step waits for it)
        final, tmp, writer = save_restore.begin(trainer, steps_done, tier.directory, tier.per_node)
        job = _Save(steps_done, tier, final, tmp, True, started, note=note)
        small = save_restore.small_files(trainer, steps_done, writer)  # written in the background too
        try:
            if has_fsdp(trainer.model):
                upload = dcp_async_save(
                    sharded_content(trainer.model, trainer.optimizer), tmp / DIRECTORY, self.group, self._staging()
                )
                write = _dcp_write(small, upload, tmp)
            elif writer:
                write = _full_write(small, self._staging().stage(save_restore.full_content(trainer)), tmp)
            else:
                write = _small_write(small, tmp)
        except CheckpointError:
            save_restore.abandon(runtime, tmp, writer, tier.per_node)
            raise
        covers = save_restore.ranks_of(runtime, tier.per_node) if writer else None
        job.done = _in_thread(self._write, job, write, covers, self._closing)
        return job

    def _staging(self) -> KeptBuffers:
        """One stager for the run: it keeps its host copy between saves (pinned on CUDA, where it
        copies without blocking and synchronizes before it returns)."""
        if self._stager is None:
            self._stager = KeptBuffers(pinned=self.trainer.runtime.device.type == "cuda")
        return self._stager

    # --- the writing thread ------------------------------------------------------------

    def _write(self, job: _Save, write: Callable[[], None], covers: range | None, closing: threading.Event) -> None:
        """This rank's part of job, then its marker; on the directory's writer (covers: the
        ranks whose files go there) the other markers, the rename and the pruning."""
        rank = self.trainer.runtime.rank
        try:
            if closing.is_set():
                raise _Dropped(f"checkpoint {job.final} dropped: the writer closed before it was written")
            write()
            _mark(job.tmp, rank)
        except BaseException as error:
            failure = error
            if covers is not None:  # the space of the unfinished save back at once, as a synchronous save's
                shutil.rmtree(job.tmp, ignore_errors=True)
            elif isinstance(error, CheckpointError):
                try:
                    save_restore.abandon(self.trainer.runtime, job.tmp, False, job.tier.per_node)
                except PeerFailed as consequence:  # the writer removed tmp, its own write having failed
                    failure = consequence
            job.written.set_exception(failure)
            raise failure from None
        job.written.set_result(None)
        if covers is None:
            job.finished = time.perf_counter()
            return
        markers = [job.tmp / MARKER.format(rank=r) for r in covers]
        while not all(marker.exists() for marker in markers):
            if closing.wait(MARKER_POLL_S):
                break
        if closing.is_set():  # never renamed: nothing reports it, the next save removes its tmp
            raise _Dropped(f"checkpoint {job.final} dropped: the writer closed before it was complete")
        try:
            for marker in markers:
                marker.unlink()
            save_restore.complete(job.tmp, job.final, job.tier.keep)
        except OSError as error:
            raise CheckpointError(
                f"cannot complete checkpoint {job.final} ({first_line(error)}); make its directory writable "
                "and resume from the latest checkpoint"
            ) from None
        job.finished = time.perf_counter()

    # --- reporting ------------------------------------------------------------------------

    def _report(self, job: _Save) -> None:
        """A completed save: in completed, and on rank 0 a line and a metrics.jsonl record."""
        job.reported = True
        self.completed.append((job.steps_done, job.tier.name))
        trainer = self.trainer
        if not trainer.runtime.is_main:
            return
        write_s = (job.finished if job.finished is not None else time.perf_counter()) - job.started
        how = (
            f"staged in {_seconds(job.stall)}, written in {_seconds(write_s)} in the background"
            if job.asynchronous
            else f"written in {_seconds(write_s)}"
        )
        what = "Checkpoint" if job.tier.name == "durable" else "Local checkpoint"
        text = f"{what} saved to {job.final} ({how})"
        if not job.quiet:
            trainer.log.info(f"{job.note}; {text[0].lower()}{text[1:]}" if job.note else text)
        trainer.metrics.log_checkpoint(job.steps_done, job.tier.name, job.asynchronous, job.stall, write_s, str(job.final))


def _in_thread(function: Callable[..., None], *args: Any) -> Future[None]:
    """function(*args) in a daemon thread of its own (never holding the interpreter's exit); its
    result or error in the future returned."""
    future: Future[None] = Future()

    def run() -> None:
        try:
            function(*args)
        except BaseException as error:
            future.set_exception(error)
        else:
            future.set_result(None)

    threading.Thread(target=run, name="checkpoint-writer", daemon=True).start()
    return future


def _seconds(seconds: float) -> str:
    return f"{seconds:.2f} s" if seconds < 10 else f"{seconds:.1f} s"


def _mark(tmp: Path, rank: int) -> None:
    try:
        (tmp / MARKER.format(rank=rank)).touch()
    except OSError as error:
        raise CheckpointError(
            f"cannot write checkpoint file {tmp / MARKER.format(rank=rank)} ({first_line(error)}); make room on its "
            "disk (or make it writable) and resume from the latest checkpoint"
        ) from None


def _held(tmp: Path) -> None:
    if _test_hook is not None:
        _test_hook(tmp)


def _dcp_write(small: SmallFiles, upload: Future, tmp: Path) -> Callable[[], None]:
    def write() -> None:
        small(tmp)
        _held(tmp)
        try:
            upload.result()
        except BaseException as error:
            if (gone := _peer_gone(error)) is not None:
                raise PeerFailed(
                    f"lost the connection to another rank while writing checkpoint {tmp} in the background: {gone}. "
                    "A consequence of that rank's failure, which its own lines name"
                ) from None
            raise save_error(error, tmp / DIRECTORY) from None

    return write


def _peer_gone(error: BaseException) -> str | None:
    """peer_gone of error or of any rank's failure DCP gathered into it (CheckpointException)."""
    causes = [cause for cause, _trace in getattr(error, "failures", {}).values()]
    return next((words for link in (error, *causes) if (words := peer_gone(link)) is not None), None)


def _full_write(small: SmallFiles, staged: dict[str, Any], tmp: Path) -> Callable[[], None]:
    def write() -> None:
        small(tmp)
        _held(tmp)
        save_restore.write_full(staged, tmp)

    return write


def _small_write(small: SmallFiles, tmp: Path) -> Callable[[], None]:
    def write() -> None:
        small(tmp)
        _held(tmp)

    return write
