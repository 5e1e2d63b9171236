"""The learning-rate schedule: linear warmup, then cosine decay to a floor."""

from __future__ import annotations

import dataclasses

import pytest

from pretrain import config as cfg
from pretrain.optim.schedule import lr_at


def training(**changes) -> cfg.TrainingConfig:
    return dataclasses.replace(cfg.debug().training, **changes)


def test_learning_rate_warms_up_linearly_then_decays_by_cosine_to_the_floor():
    t = training(learning_rate=1.0, warmup_steps=4, max_steps=14, min_lr_ratio=0.1)
    assert [lr_at(s, t) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]
    assert lr_at(4, t) == 1.0
    assert lr_at(13, t) == pytest.approx(0.1)
    assert lr_at(4 + 9 / 2, t) == pytest.approx(0.55)  # halfway: the mean of peak and floor
    decay = [lr_at(s, t) for s in range(4, 14)]
    assert decay == sorted(decay, reverse=True)


def test_learning_rate_without_warmup_starts_at_the_peak():
    assert lr_at(0, training(learning_rate=2e-3, warmup_steps=0)) == 2e-3
