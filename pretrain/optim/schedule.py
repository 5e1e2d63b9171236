"""The learning-rate schedules (training.lr_schedule; pretrain/registry.py names them): the rate
at each optimizer step. The training loop sets it every step; a checkpoint records it, and a
resume checks it (pretrain/checkpoint/save_restore.py)."""

from __future__ import annotations

import math
from collections.abc import Callable

from pretrain import registry
from pretrain.config import TrainingConfig


def lr_at(step: int, training: TrainingConfig) -> float:
    """The rate at step under training.lr_schedule."""
    schedule: Callable[[int, TrainingConfig], float] = registry.load(registry.LR_SCHEDULES[training.lr_schedule])
    return schedule(step, training)


def warmup_cosine(step: int, training: TrainingConfig) -> float:
    """Linear warmup to the peak, then cosine decay to min_lr_ratio * peak at the last step."""
    peak = training.learning_rate
    if step < training.warmup_steps:
        return peak * (step + 1) / training.warmup_steps
    decay_steps = max(1, training.max_steps - 1 - training.warmup_steps)
    progress = min(1.0, (step - training.warmup_steps) / decay_steps)
    cosine = 0.5 * (1.0 + math.cos(math.pi * progress))
    return peak * (training.min_lr_ratio + (1.0 - training.min_lr_ratio) * cosine)
