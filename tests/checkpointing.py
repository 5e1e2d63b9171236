"""What the checkpoint tests share: a tiny debug trainer on the built-in corpus, and its fixtures."""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import torch

from pretrain.checkpoint import save_restore
from pretrain import config as cfg
from pretrain.data.fitting import fit_to_dataset
from pretrain.data.prepare import prepare
from pretrain.distributed.runtime import Runtime, setup_logging
from pretrain.build import Trainer, build
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
