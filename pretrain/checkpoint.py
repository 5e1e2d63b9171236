"""Checkpoints: what a run needs to continue, in <run dir>/checkpoints/<name>/.

    model.pt          the model's state dict (without the DDP wrapper)
    optimizer.pt      the optimizer's state dict
    rng_rank<r>.pt    each rank's torch RNG states (CPU, and CUDA on a GPU)
    state.json        steps done, the data loader's position, the format version
    config.json       the resolved config

Every rank writes into <name>.tmp/ and rank 0 renames it into place, so a checkpoint
directory is either complete or absent. Everything loads with torch.load(weights_only=True).
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from pretrain import config as cfg
from pretrain.runfiles import atomic_write_text
from pretrain.runtime import Runtime

if TYPE_CHECKING:
    from pretrain.train import Trainer

FORMAT_VERSION = 1


def _barrier(runtime: Runtime) -> None:
    if runtime.distributed:
        dist.barrier()


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    return model.module if isinstance(model, torch.nn.parallel.DistributedDataParallel) else model


def rng_states(device: torch.device) -> dict[str, torch.Tensor]:
    states = {"cpu": torch.get_rng_state()}
    if device.type == "cuda":
        states["cuda"] = torch.cuda.get_rng_state(device)
    return states


def save(trainer: Trainer, steps_done: int, run_dir: Path, name: str | None = None) -> Path:
    """Write a checkpoint after steps_done optimizer steps; every rank calls this."""
    runtime = trainer.runtime
    final = run_dir / "checkpoints" / (name or f"step_{steps_done}")
    tmp = final.with_name(final.name + ".tmp")
    if runtime.is_main:
        shutil.rmtree(tmp, ignore_errors=True)  # left by a save that was killed
        tmp.mkdir(parents=True)
    _barrier(runtime)
    torch.save(rng_states(runtime.device), tmp / f"rng_rank{runtime.rank}.pt")
    if runtime.is_main:
        torch.save(unwrap(trainer.model).state_dict(), tmp / "model.pt")
        torch.save(trainer.optimizer.state_dict(), tmp / "optimizer.pt")
        cfg.save(trainer.config, tmp / "config.json")
        state = {"format_version": FORMAT_VERSION, "steps_done": steps_done,
                 "world_size": runtime.world_size, "loader": trainer.loader.state_dict()}
        atomic_write_text(tmp / "state.json", json.dumps(state, indent=2) + "\n")
    _barrier(runtime)  # every rank's files are in tmp
    if runtime.is_main:
        _fsync_files(tmp)  # on disk before the rename makes them count
        _replace_dir(tmp, final)
    _barrier(runtime)  # no rank returns before the checkpoint exists
    return final


def _fsync_files(directory: Path) -> None:
    for path in directory.iterdir():
        with open(path, "rb") as handle:
            os.fsync(handle.fileno())


def _replace_dir(new: Path, final: Path) -> None:
    """Rename new to final; an existing final is moved aside first and removed last, so a
    complete checkpoint exists at every moment."""
    old = final.with_name(final.name + ".old")
    if final.exists():
        shutil.rmtree(old, ignore_errors=True)
        os.rename(final, old)
    os.rename(new, final)
    directory = os.open(final.parent, os.O_RDONLY)
    try:
        os.fsync(directory)  # the rename itself survives a power loss
    finally:
        os.close(directory)
    shutil.rmtree(old, ignore_errors=True)


def read_state(path: Path) -> dict:
    return json.loads((path / "state.json").read_text())


def load_tensors(path: Path, name: str) -> dict:
    """One of the checkpoint's tensor files, without unpickling arbitrary objects."""
    return torch.load(path / name, map_location="cpu", weights_only=True)
