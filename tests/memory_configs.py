"""What the memory tests share (test_memory.py, test_memory_plan.py): an 80 GiB GPU, and configs
changed field by field."""

from __future__ import annotations

import dataclasses

from pretrain import config as cfg
from pretrain.memory import GIB

GPU_80 = 80 * GIB


def with_training(config: cfg.Config, **changes: object) -> cfg.Config:
    return dataclasses.replace(config, training=dataclasses.replace(config.training, **changes))


def with_model(config: cfg.Config, **changes: object) -> cfg.Config:
    return dataclasses.replace(config, model=dataclasses.replace(config.model, **changes))


def small() -> cfg.Config:
    return with_model(cfg.small(), vocab_size=32768)  # what the trained BPE tokenizer gives it
