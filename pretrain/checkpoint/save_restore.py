"""Checkpoints: everything a run needs to continue exactly, in <run dir>/checkpoints/<name>/.

    model.pt, optimizer.pt   single process or DDP: the full model state dict and the AdamW
                             state keyed by parameter name (rank 0 writes them)
    dcp/                     FSDP, HSDP: model and optimizer state as a sharded torch.distributed.checkpoint,
                             each rank writing its own shards (no rank ever holds the whole model;
                             under HSDP a shard that every node holds is written once)
    rng_rank<r>.pt           rank r's random generators: torch CPU (and CUDA), Python, NumPy
    state.json               steps done, world size, parallelism, the data loader's position,
                             the learning-rate schedule's position, the format version
    config.json              the resolved config

Both formats hold the same names (`layers.0.attention.wqkv.weight`, ...), so either restores into
either: a DDP checkpoint into an FSDP or HSDP run (every rank reads the full tensors and keeps its
shard) and an FSDP or HSDP checkpoint into any other mode (DCP reshards on load). The
world size may change between save and restore: the data position is converted (see
_loader_position), and ranks the saving run did not have seed their generators afresh. A
checkpoint written before the fused projections (Meta's separate wq/wk/wv and w1/w3) loads too,
converted, in either format, with a one-line note (pretrain/checkpoint/separate_layout.py).

Every rank writes its files into <name>.tmp/ and fsyncs them; rank 0 then renames the directory
into place, so a checkpoint directory is either complete or absent (pretrain/checkpoint/files.py).
fit() saves through trainer.checkpoints (pretrain/checkpoint/async_save.py), which writes the
same files, staged and in the background where training.async_checkpoint is on.
Every .pt file loads with torch.load(weights_only=True), and the DCP files are read without
unpickling anything but DCP's own metadata classes (pretrain/checkpoint/dcp_files.py).

This module orchestrates; the parts live in files (directories on disk), dcp_files
(the sharded format, read safely), model_state (state dicts by parameter name), rng and
compatibility (whether a checkpoint fits the run that resumes it).
"""

from __future__ import annotations

import json
import math
import os
import pickle
import shutil
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from pretrain import config as cfg
from pretrain.checkpoint.compatibility import (
    check_same_hub_files,
    check_same_model,
    check_same_optimizer,
    check_shapes,
    check_steps,
)
from pretrain.checkpoint.files import (
    FORMAT_VERSION,
    CheckpointError,
    clean_unfinished,
    first_line,
    fsync_dir,
    latest,
    prune,
    read_state,
    replace_dir,
    supersede_after,
)
from pretrain.config import Config
from pretrain.checkpoint.dcp_files import DIRECTORY, read_dcp_metadata
from pretrain.checkpoint.model_state import (
    full_states,
    load_full,
    load_sharded,
    plain_name,
    read_sharded_model,
    save_sharded,
    sharded_model_shapes,
)
from pretrain.distributed.parallel import has_fsdp
from pretrain.distributed.peer_loss import PeerFailed
from pretrain.checkpoint.rng import rng_states, seed_from, set_rng_states
from pretrain.checkpoint.separate_layout import note
from pretrain.checkpoint.trainer_state import TrainerState
from pretrain.model.fused_layout import fuse_separate
from pretrain.run.files import atomic_write_text
from pretrain.distributed.runtime import Runtime
from pretrain.optim.schedule import lr_at


__all__ = [
    "FORMAT_VERSION",
    "CheckpointError",
    "latest",
    "load_config",
    "load_model_state",
    "load_tensors",
    "read_dcp_metadata",
    "read_state",
    "restore",
    "rng_states",
    "save",
    "set_rng_states",
]

NEARLY_FULL = 64 << 20
"""Free bytes below which a failed write names the free space: more than one write's worth."""

# --- save -----------------------------------------------------------------------------


def save(trainer: TrainerState, steps_done: int, run_dir: Path, name: str | None = None) -> Path:
    """Write a checkpoint after steps_done optimizer steps to <run_dir>/checkpoints/step_<steps_done>
    (or name) and return its path, synchronously (a save in flight finishes first); every rank
    calls this. Rank 0 then deletes the oldest step_<N> checkpoints beyond
    training.keep_checkpoints. CheckpointError (one line, naming the file) when a file cannot
    be written. fit() saves through trainer.checkpoints (pretrain/checkpoint/async_save.py)."""
    if (writer := getattr(trainer, "checkpoints", None)) is not None:
        writer.wait()  # this save cleans up unfinished ones: the one in flight must be complete
    keep = trainer.config.training.keep_checkpoints
    return save_to(trainer, steps_done, run_dir / "checkpoints", keep, name=name)


def save_to(
    trainer: TrainerState, steps_done: int, directory: Path, keep: int, per_node: bool = False, name: str | None = None
) -> Path:
    """save() into the checkpoints directory directory, keeping keep step_<N> checkpoints;
    per_node: each node's first rank writes the directory (a node-local tier), else rank 0."""
    runtime = trainer.runtime
    final, tmp, writer = begin(trainer, steps_done, directory, per_node, name)
    try:
        small_files(trainer, steps_done, writer)(tmp)
        if has_fsdp(trainer.model):
            save_sharded(trainer.model, trainer.optimizer, tmp / DIRECTORY)
        elif writer:
            write_full(full_content(trainer), tmp)
    except CheckpointError:
        abandon(runtime, tmp, writer, per_node)
        raise
    _barrier(runtime)  # every rank's files are in tmp, on disk
    if writer:
        complete(tmp, final, keep)
    _barrier(runtime)  # no rank returns before the checkpoint exists
    return final


def begin(
    trainer: TrainerState, steps_done: int, directory: Path, per_node: bool, name: str | None = None
) -> tuple[Path, Path, bool]:
    """The start of a save every rank makes: (the final path, <name>.tmp every rank writes into,
    whether this rank writes the directory: creates it, and renames and prunes when complete).
    The writer removes what killed saves left first; a barrier, so no rank writes before it."""
    runtime = trainer.runtime
    final = directory / f"step_{steps_done}" if name is None else directory / name
    tmp = final.with_name(final.name + ".tmp")
    writer = writes_directory(runtime, per_node)
    if writer:
        clean_unfinished(final.parent)  # a save that was killed left these
        tmp.mkdir(parents=True)
    _barrier(runtime)
    return final, tmp, writer


def writes_directory(runtime: Runtime, per_node: bool) -> bool:
    """Whether this rank creates, completes and prunes a checkpoint directory: rank 0, or for a
    per-node directory each node's first rank (LOCAL_RANK 0)."""
    if not per_node:
        return runtime.is_main
    return int(os.environ.get("LOCAL_RANK", runtime.rank)) == 0


def ranks_of(runtime: Runtime, per_node: bool) -> range:
    """The ranks whose files go into the directory this rank writes: all, or its node's (ranks
    are numbered node by node)."""
    if not per_node:
        return range(runtime.world_size)
    local_rank = int(os.environ.get("LOCAL_RANK", runtime.rank))
    first = runtime.rank - local_rank
    return range(first, first + int(os.environ.get("LOCAL_WORLD_SIZE", runtime.world_size)))


def abandon(runtime: Runtime, tmp: Path, writer: bool, per_node: bool = False) -> None:
    """After this rank's write failed: its writer removes the unfinished checkpoint (a full disk
    gets its space back at once); another rank whose tmp is gone says that the writer's failure
    (rank 0's, or its node's first rank's for a per_node tier) is the cause (PeerFailed), else
    the caller re-raises its own error."""
    if writer:
        shutil.rmtree(tmp, ignore_errors=True)
    elif not tmp.is_dir():  # the writer did that: its failure is the cause, this one's a consequence
        raise PeerFailed(
            f"cannot write this rank's part of checkpoint {tmp}: rank {ranks_of(runtime, per_node)[0]} removed the "
            "unfinished checkpoint, its own part having failed (a consequence of that rank's failure, which its own "
            "lines name)"
        ) from None


def complete(tmp: Path, final: Path, keep: int) -> None:
    """Every rank's files are in tmp, fsynced: make the directory entries durable, rename tmp to
    final (a complete checkpoint at every moment: replace_dir) and prune the directory to keep."""
    for directory in (tmp / DIRECTORY, tmp):
        if directory.is_dir():
            fsync_dir(directory)
    replace_dir(tmp, final)
    prune(final.parent, keep, final)


def small_files(trainer: TrainerState, steps_done: int, writer: bool) -> Callable[[Path], None]:
    """What a checkpoint holds besides the model and the optimizer, taken now (this rank's random
    generators; on the directory's writer the config and state.json's data and schedule
    positions), and the function that writes it into a checkpoint's tmp directory, later or at
    once. Each rank fsyncs what it writes (DCP fsyncs its shards), so the writer only has the
    directory entries left to make durable."""
    rank, rng, config = trainer.runtime.rank, rng_states(trainer.runtime.device), trainer.config
    state = json.dumps(_state(trainer, steps_done), indent=2) + "\n" if writer else None

    def write(tmp: Path) -> None:
        write_tensors(rng, tmp / f"rng_rank{rank}.pt")
        if state is not None:
            with _writing(tmp / "config.json"):
                cfg.save(config, tmp / "config.json")
            with _writing(tmp / "state.json"):
                atomic_write_text(tmp / "state.json", state)

    return write


def _state(trainer: TrainerState, steps_done: int) -> dict[str, Any]:
    return {
        "format_version": FORMAT_VERSION,
        "steps_done": steps_done,
        "world_size": trainer.runtime.world_size,
        "parallelism": trainer.mode,
        "loader": trainer.loader.state_dict(),
        # The schedule is a pure function of the step; the rate is for people, and for
        # noticing on resume that the schedule changed.
        "lr_schedule": {"steps_done": steps_done, "lr": lr_at(steps_done, trainer.config.training)},
    }


def full_content(trainer: TrainerState) -> dict[str, Any]:
    """The single-file format's tensors: {"model": the full model state, "optimizer": the optimizer's}."""
    model_state, optimizer_state = full_states(trainer.model, trainer.optimizer)
    return {"model": model_state, "optimizer": optimizer_state}


def write_full(content: dict[str, Any], tmp: Path) -> None:
    """full_content (or a staged copy of it) into tmp: model.pt and optimizer.pt, fsynced."""
    write_tensors(content["model"], tmp / "model.pt")
    write_tensors(content["optimizer"], tmp / "optimizer.pt")


def write_tensors(value: Any, file: Path) -> None:
    """torch.save to file, fsynced before it returns."""
    with _writing(file), open(file, "wb") as handle:
        torch.save(value, handle)
        handle.flush()
        os.fsync(handle.fileno())


@contextmanager
def _writing(file: Path) -> Iterator[None]:
    """A failed write as one line naming the file: a full disk makes torch.save raise
    RuntimeError and every other write OSError."""
    try:
        yield
    except (OSError, RuntimeError) as error:
        raise CheckpointError(
            f"cannot write checkpoint file {file} ({first_line(error)}{_space_left(file)}); make "
            "room on its disk (or make it writable) and resume from the latest checkpoint"
        ) from None


def _space_left(file: Path) -> str:
    """'; 12 KiB free on its disk' when the disk is (nearly) full: torch.save's error on a full
    disk says only `unexpected pos 860672 vs 860560`, which does not tell the cause."""
    try:
        free = shutil.disk_usage(file.parent).free
    except OSError:
        return ""
    return f"; {free // 1024} KiB free on its disk" if free < NEARLY_FULL else ""


def _barrier(runtime: Runtime) -> None:
    if runtime.distributed:
        dist.barrier()


# --- reading --------------------------------------------------------------------------


def load_config(path: Path) -> Config:
    """The resolved config the checkpoint was written with."""
    if not (path / "config.json").is_file():
        raise CheckpointError(f"checkpoint {path} is incomplete: it has no config.json; use another checkpoint of the run")
    try:
        return cfg.load(path / "config.json")
    except cfg.ConfigError as error:
        raise CheckpointError(f"checkpoint {path}: {error}") from None


def load_tensors(path: Path, name: str, mmap: bool = False) -> Any:
    """One of the checkpoint's .pt files on CPU, without unpickling arbitrary objects. With
    mmap the tensors are views of the file: ranks reading the same file share its pages."""
    file = path / name
    if not file.is_file():
        raise CheckpointError(f"checkpoint {path} is incomplete: {name} is missing; use another checkpoint of the run")
    try:
        return torch.load(file, map_location="cpu", weights_only=True, mmap=mmap)
    except (OSError, RuntimeError, EOFError, pickle.UnpicklingError) as error:
        raise CheckpointError(
            f"checkpoint {path}: cannot read {name} ({first_line(error)}); use another checkpoint of the run"
        ) from None


def load_model_state(path: Path, as_saved: bool = False) -> dict[str, torch.Tensor]:
    """The whole model's state dict on CPU with plain parameter names, in one process without a
    process group, whichever format the checkpoint has (for generation and export). A checkpoint
    of the separate layout (before the fused projections) gives the fused weights, unless
    as_saved (then its own names, and the full format's tensors still memory-mapped)."""
    read_state(path)
    if _is_sharded(path):
        state = read_sharded_model(path, read_dcp_metadata(path))
    else:
        state = {plain_name(key): value for key, value in load_tensors(path, "model.pt", mmap=True).items()}
    return state if as_saved else fuse_separate(state, load_config(path).model)


def _is_sharded(path: Path) -> bool:
    return (path / DIRECTORY).is_dir()


# --- restore --------------------------------------------------------------------------


def restore(trainer: TrainerState, path: Path) -> int:
    """Load model, optimizer, data position and this rank's random generators from the
    checkpoint at path into trainer; return the steps it had done. Every rank calls this.
    The optimizer's hyperparameters stay those of trainer's config. Resuming an earlier
    checkpoint of the run directory trainer writes to sets its later ones aside."""
    # Everything that can refuse the checkpoint runs before anything is loaded into trainer.
    state = read_state(path)
    check_steps(path, state["steps_done"], trainer.config.training.max_steps)
    saved_config = load_config(path)
    check_same_model(path, saved_config.model, trainer.config.model)
    if (before := saved_config.model.moe.capacity_factor) != (now := trainer.config.model.moe.capacity_factor):
        if trainer.runtime.is_main and trainer.config.model.moe.num_experts:
            trainer.log.info(
                f"model.moe.capacity_factor is {before} in checkpoint {path}, {now} in this run: "
                f"the experts' weights resume, routed {'dropless' if now is None else f'with capacity factor {now}'}"
            )
    check_same_optimizer(path, saved_config.training, trainer.config.training)
    check_same_hub_files(path, saved_config.data, trainer.config.data)
    metadata = read_dcp_metadata(path) if _is_sharded(path) else None  # refuses pickled values, unread
    rng = _read_rng(path, state, trainer.runtime.rank)
    position = _loader_position(path, state, saved_config, trainer)
    if metadata is not None:
        check_shapes(path, sharded_model_shapes(metadata), trainer.model)
        reset = load_sharded(trainer.model, trainer.optimizer, path, metadata)
    else:
        model_state = load_tensors(path, "model.pt", mmap=True)
        check_shapes(path, {plain_name(k): tuple(v.shape) for k, v in model_state.items()}, trainer.model)
        reset = load_full(trainer.model, trainer.optimizer, model_state, load_tensors(path, "optimizer.pt", mmap=True))
    if reset is not None and trainer.runtime.is_main:  # the separate layout's checkpoint, converted (alike on every rank)
        trainer.log.info(note(path, reset))
    trainer.loader.load_state_dict(position)
    trainer.batches = iter(trainer.loader)  # from the restored position
    if rng is None:
        _seed_new_rank(trainer, path, state)
    else:
        set_rng_states(rng, trainer.runtime.device)
    _warn_if_schedule_changed(trainer, path, state)
    _supersede_later(trainer, path, state["steps_done"])
    return state["steps_done"]


def _loader_position(path: Path, state: dict[str, Any], saved_config: Config, trainer: TrainerState) -> dict[str, int]:
    """The data position for this run. With another world size or batch size it is converted:
    in an epoch, ranks read a permutation of the windows round-robin, so the windows consumed
    are a prefix of it (batch_index x batch_size x world_size windows), and the new run starts
    after the same prefix when that is a whole number of its own batches."""
    position = {"epoch": int(state["loader"]["epoch"]), "batch_index": int(state["loader"]["batch_index"])}
    saved_ranks, saved_batch = int(state["world_size"]), saved_config.training.batch_size
    ranks, batch = trainer.runtime.world_size, trainer.config.training.batch_size
    if (saved_ranks, saved_batch) == (ranks, batch):
        return position
    consumed = position["batch_index"] * saved_batch * saved_ranks
    if consumed % (batch * ranks):
        raise CheckpointError(
            f"checkpoint {path} stopped {consumed} windows into epoch {position['epoch']} "
            f"({saved_ranks} rank(s) x batch {saved_batch}), not a whole number of batches of {ranks} rank(s) x "
            f"batch {batch}; resume with {saved_ranks} rank(s) and training.batch_size {saved_batch}"
        )
    batch_index = consumed // (batch * ranks)
    if batch_index >= trainer.loader.batches_per_epoch:  # the rest is the tail this run drops
        return {"epoch": position["epoch"] + 1, "batch_index": 0}
    trainer.log.info(
        f"Checkpoint written by {saved_ranks} rank(s) with batch {saved_batch}; continuing on "
        f"{ranks} with batch {batch} at batch {batch_index} of epoch {position['epoch']}"
    )
    return {"epoch": position["epoch"], "batch_index": batch_index}


def _read_rng(path: Path, state: dict[str, Any], rank: int) -> dict[str, Any] | None:
    """This rank's saved generators; None for a rank the saving run did not have."""
    if rank >= int(state["world_size"]):
        return None
    return load_tensors(path, f"rng_rank{rank}.pt")


def _seed_new_rank(trainer: TrainerState, path: Path, state: dict[str, Any]) -> None:
    rank, steps_done = trainer.runtime.rank, state["steps_done"]
    seed_from(trainer.config.training.seed, steps_done, rank)
    trainer.log.warning(
        f"Checkpoint {path} was written by {state['world_size']} rank(s) and has no random "
        f"state for rank {rank}; its generators are seeded from (training.seed, step "
        f"{steps_done}, rank {rank}) instead"
    )


def _warn_if_schedule_changed(trainer: TrainerState, path: Path, state: dict[str, Any]) -> None:
    saved = state.get("lr_schedule", {}).get("lr")
    here = lr_at(state["steps_done"], trainer.config.training)
    if saved is not None and not math.isclose(saved, here, rel_tol=1e-9, abs_tol=1e-15):
        trainer.log.warning(
            f"The learning-rate schedule changed: step {state['steps_done']} runs at {here:.3e} now, "
            f"{saved:.3e} in the run that saved {path} (training.lr_schedule, learning_rate, warmup_steps, "
            "max_steps or min_lr_ratio differ)"
        )


def _supersede_later(trainer: TrainerState, path: Path, steps_done: int) -> None:
    """Resuming an earlier checkpoint into its own run directory abandons the run's later
    step_<N>: rank 0 renames them to step_<N>.superseded before any new save (which would
    otherwise prune the new checkpoints in their favour, and --resume auto continue them),
    and no rank goes on before it has."""
    checkpoints_dir = trainer.run_dir / "checkpoints"
    if trainer.runtime.is_main and checkpoints_dir.is_dir() and os.path.samefile(checkpoints_dir, path.parent):
        renamed = supersede_after(checkpoints_dir, steps_done)
        if renamed:
            trainer.log.warning(
                f"Resuming {path.name} abandons the run's later checkpoints; renamed "
                f"{', '.join(p.name for p in renamed)} in {checkpoints_dir} (kept, but never "
                "resumed or pruned automatically)"
            )
    _barrier(trainer.runtime)
