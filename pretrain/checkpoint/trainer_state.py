"""What the checkpoint code reads of a trainer, as a Protocol that pretrain/build.py's Trainer
meets: build.py imports the checkpoint writer to give each Trainer one, so the checkpoint modules
name the trainer's parts here instead of importing build.py back."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Protocol

import torch

from pretrain.config import Config
from pretrain.data.loader import TrainBatches
from pretrain.distributed.runtime import Runtime
from pretrain.observe.metrics import MetricsLog


class TrainerState(Protocol):
    """A trainer as a checkpoint saves and restores it (pretrain/build.py Trainer)."""

    batches: Iterator[tuple[torch.Tensor, torch.Tensor]]
    """Iterates loader from its position; a restore makes it afresh."""

    @property
    def config(self) -> Config: ...

    @property
    def runtime(self) -> Runtime: ...

    @property
    def model(self) -> torch.nn.Module: ...

    @property
    def mode(self) -> str: ...

    @property
    def optimizer(self) -> torch.optim.Optimizer: ...

    @property
    def loader(self) -> TrainBatches: ...

    @property
    def log(self) -> logging.Logger: ...

    @property
    def run_dir(self) -> Path: ...

    @property
    def metrics(self) -> MetricsLog: ...

    @property
    def checkpoints(self) -> Any:
        """The trainer's writer (pretrain/checkpoint/async_save.py CheckpointWriter)."""
        ...
