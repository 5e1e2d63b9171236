"""What the checkpoint tests share: a tiny debug trainer on the built-in corpus, and its fixtures."""

from __future__ import annotations

import json
import random
import shutil
import warnings
import zipfile
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter

from pretrain import config as cfg
from pretrain.build import Trainer, build
from pretrain.checkpoint import save_restore
from pretrain.checkpoint.dcp_files import dcp_load, read_dcp_metadata, tensor_entries
from pretrain.config import ModelConfig
from pretrain.data.fitting import fit_to_dataset
from pretrain.data.prepare import prepare
from pretrain.distributed.runtime import Runtime, setup_logging
from pretrain.model.fused_layout import part_names, row_splits, split_fused
from pretrain.train import train_step


TINY = [
    "training.batch_size=2",
    "data.context_length=32",
    "system.device=cpu",
    "logging.tensorboard=false",
    "debug.check_finite=false",
]


def resolved(cache: Path, *sets: str, world_size: int = 1) -> tuple[cfg.Config, Path]:
    """The debug preset on a tiny context, fitted to the built-in dataset prepared in cache."""
    config = cfg.resolve(preset="debug", sets=[f"data.cache_dir={cache}", *TINY, *sets])
    dataset = prepare(config.data, log=lambda _: None)
    config, _ = fit_to_dataset(config, dataset, world_size=world_size)
    return config, dataset


def make_trainer(cache: Path, run_dir: Path, *sets: str) -> Trainer:
    config, dataset = resolved(cache, *sets)
    runtime = Runtime(rank=0, world_size=1, device=torch.device("cpu"), label="CPU 0")
    return build(config, runtime, dataset, run_dir, setup_logging("CPU 0", "WARNING"))


def trained_trainer(cache: Path, tmp_path: Path) -> tuple[Trainer, Path]:
    """A trainer after two steps and the checkpoint it saved then."""
    trainer = make_trainer(cache, tmp_path / "run")
    for step in range(2):
        train_step(trainer, step)
    return trainer, save_restore.save(trainer, 2, trainer.run_dir)


def draws() -> tuple[torch.Tensor, float, np.ndarray]:
    return torch.rand(4), random.random(), np.random.rand(4)


def assert_same_tensors(first: dict, second: dict) -> None:
    assert first.keys() == second.keys()
    for key in first:
        a, b = first[key], second[key]
        if isinstance(a, dict):
            assert_same_tensors(a, b)
        else:
            assert torch.equal(torch.as_tensor(a), torch.as_tensor(b)), key


# --- checkpoints as other code wrote them ------------------------------------------------


def _dcp_save(content: dict[str, Any], directory: Path) -> None:
    with warnings.catch_warnings():  # it warns that it runs without a process group
        warnings.simplefilter("ignore")
        dcp.save(content, storage_writer=FileSystemWriter(directory), no_dist=True)


def as_sharded(path: Path) -> None:
    """Turn full checkpoint path into a DCP one holding the same tensors, as FSDP ranks write it."""
    model = save_restore.load_tensors(path, "model.pt")
    optimizer = save_restore.load_tensors(path, "optimizer.pt")
    _dcp_save({"model": model, "optimizer": {"state": optimizer["state"]}}, path / "dcp")
    (path / "model.pt").unlink()
    (path / "optimizer.pt").unlink()


def _split_optimizer_state(state: dict[str, Any], model: ModelConfig) -> dict[str, Any]:
    """Per-parameter optimizer state as the separate layout's optimizer held it: each part its
    own rows of every per-row tensor, and the step count each."""
    out: dict[str, Any] = {}
    for name, entries in state.items():
        parts, rows = part_names(name), row_splits(name, model)
        if parts is None or rows is None:
            out[name] = entries
            continue
        for i, part in enumerate(parts):
            out[part] = {
                key: value.split(rows)[i].clone() if isinstance(value, torch.Tensor) and value.dim() >= 1 else value
                for key, value in entries.items()
            }
    return out


def as_separate_layout(path: Path, model: ModelConfig) -> None:
    """Rewrite checkpoint path (either format) as the code before the fused projections wrote it:
    wqkv and w13 as Meta's separate wq/wk/wv and w1/w3, and their optimizer state split the same way."""
    if (path / "dcp").is_dir():
        entries = tensor_entries(read_dcp_metadata(path), "")
        saved = {key: torch.empty(item.size, dtype=item.properties.dtype) for key, item in entries.items()}
        dcp_load(saved, path, alone=True)
        weights = {key.removeprefix("model."): value for key, value in saved.items() if key.startswith("model.")}
        state: dict[str, dict[str, torch.Tensor]] = {}
        for key, value in saved.items():
            if key.startswith("optimizer.state."):
                name, _, entry = key.removeprefix("optimizer.state.").rpartition(".")
                state.setdefault(name, {})[entry] = value
        shutil.rmtree(path / "dcp")
        separate = {key: value.clone() for key, value in split_fused(weights, model).items()}
        _dcp_save({"model": separate, "optimizer": {"state": _split_optimizer_state(state, model)}}, path / "dcp")
        return
    weights = save_restore.load_tensors(path, "model.pt")
    torch.save({key: value.clone() for key, value in split_fused(weights, model).items()}, path / "model.pt")
    optimizer = save_restore.load_tensors(path, "optimizer.pt")
    groups = [
        {**group, "params": [p for name in group["params"] for p in part_names(name) or [name]]}
        for group in optimizer["param_groups"]
    ]
    torch.save({"state": _split_optimizer_state(optimizer["state"], model), "param_groups": groups}, path / "optimizer.pt")


def checkpoint(directory: Path, steps: int, world_size: int = 1, ranks: range | None = None) -> Path:
    """A complete step_<steps> checkpoint in directory, as far as choosing one goes (no torch):
    every file a resume reads, the random generators of ranks (default: every rank's)."""
    path = directory / f"step_{steps}"
    path.mkdir(parents=True)
    state = {
        "format_version": 2,
        "steps_done": steps,
        "world_size": world_size,
        "parallelism": "ddp" if world_size > 1 else "single",
        "loader": {"epoch": 0, "batch_index": steps},
    }
    (path / "state.json").write_text(json.dumps(state))
    (path / "config.json").write_text("{}")
    for name in ("model.pt", "optimizer.pt", *(f"rng_rank{rank}.pt" for rank in ranks or range(world_size))):
        with zipfile.ZipFile(path / name, "w") as archive:  # torch.save's format, as far as a look can tell
            archive.writestr("archive/data.pkl", b"")
    return path


def config(*sets: str) -> cfg.Config:
    return cfg.resolve(preset="debug", sets=list(sets))
