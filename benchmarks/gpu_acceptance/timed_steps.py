"""Steps of one training process timed on the GPU, for the acceptance checks that compare two runs
of one model (checks_moe: dropless vs capacity; checks_float8: float8 vs bf16). Imports torch and
the trainer inside the functions: the check modules that import this one run torch-free too."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass
class Timed:
    losses: list[float]
    """Every step's loss, read after the last step (no read inside the timed steps)."""
    step_s: float
    """Mean seconds per step from timed_from on."""
    warmup_peaks: tuple[int, int]
    """torch.cuda's peak allocated and reserved bytes when the timing began (the first steps')."""
    tokens_per_s: float
    mfu: float | None
    """Against the GPU's dense bf16 peak; None for a GPU the MFU table does not know."""


def timed_steps(trainer: Any, steps: int, timed_from: int, after_step: Callable[[Any], None] | None = None) -> Timed:
    """Run trainer's first steps (pretrain.train.train_step), timing those from timed_from on;
    after_step(trainer) after each, to read what a step left on the trainer (device tensors)."""
    import torch

    from pretrain.observe.metrics import flops_per_token, peak_bf16_flops
    from pretrain.train import train_step

    losses, started, warmup_peaks = [], 0.0, (0, 0)
    for step in range(steps):
        if step == timed_from:
            torch.cuda.synchronize()
            warmup_peaks = torch.cuda.max_memory_allocated(), torch.cuda.max_memory_reserved()
            started = time.perf_counter()
        loss, _, _ = train_step(trainer, step)
        losses.append(loss.detach())
        if after_step is not None:
            after_step(trainer)
    torch.cuda.synchronize()
    step_s = (time.perf_counter() - started) / (steps - timed_from)
    tokens_per_s = trainer.tokens_per_step / step_s
    config = trainer.config
    peak = peak_bf16_flops(torch.cuda.get_device_name(trainer.runtime.device))
    per_token = flops_per_token(config.model, config.data.context_length)
    mfu = tokens_per_s * per_token / peak if peak else None
    return Timed([float(loss) for loss in losses], step_s, warmup_peaks, tokens_per_s, mfu)
