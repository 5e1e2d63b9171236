"""The step line: what training logs every logging.log_interval steps (loss, learning rate,
gradient norm, ETA, tokens/s, MFU, peak memory), and the throughput window it measures
(pretrain/observe/metrics.py computes MFU and reads the memory peaks)."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from pretrain import config as cfg
from pretrain.observe.metrics import device_peak_flops, flops_per_token, mfu, peak_memory_gib, reset_peak_memory

if TYPE_CHECKING:
    from pretrain.build import Trainer


def format_eta(seconds: float) -> str:
    """5:30 under an hour, 2:05:30 above."""
    minutes, secs = divmod(int(max(0.0, seconds)), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes}:{secs:02d}"


@dataclass
class Throughput:
    """Tokens/s, MFU and peak memory over the steps since the last step line."""

    tokens_per_step: int
    world_size: int
    flops_per_token: float
    peak_flops: float | None
    """The device's bf16 peak (None: unknown device or CPU, so no MFU)."""
    device: torch.device
    window_start: float = field(default_factory=time.perf_counter)
    window_steps: int = 0

    def step_done(self) -> None:
        self.window_steps += 1

    @contextmanager
    def paused(self, clock: Callable[[], float] = time.perf_counter) -> Iterator[None]:
        """Leave the block's time out of the window: evaluation and checkpoint saves are not
        training, and would make tokens/s and MFU look worse than training runs."""
        began = clock()
        try:
            yield
        finally:
            self.window_start += clock() - began

    def measure(self, now: float) -> tuple[float, float | None, float | None]:
        """(tokens/s over all ranks, MFU, peak memory GiB) of the window; starts the next one."""
        tokens_per_s = self.tokens_per_step * self.window_steps / max(now - self.window_start, 1e-9)
        utilization = mfu(tokens_per_s / self.world_size, self.flops_per_token, self.peak_flops)
        memory_gib = peak_memory_gib(self.device)
        reset_peak_memory(self.device)
        self.window_start, self.window_steps = now, 0
        return tokens_per_s, utilization, memory_gib


def throughput(trainer: Trainer) -> Throughput:
    device = trainer.runtime.device
    peak = device_peak_flops(device)
    if not trainer.config.training.use_amp:
        peak = None  # the table holds bf16 peaks; an fp32 run measured against them would mislead
    reset_peak_memory(device)  # the first window's peak is training's, not the build's (init draws whole tensors)
    return Throughput(
        trainer.tokens_per_step,
        trainer.runtime.world_size,
        flops_per_token(trainer.config.model, trainer.config.data.context_length),
        peak,
        device,
    )


def step_line(
    trainer: Trainer,
    step: int,
    loss: float,
    lr: float,
    grad_norm: float,
    eta_s: float,
    tokens_per_s: float,
    utilization: float | None,
    memory_gib: float | None,
    aux_loss: float | None = None,
    epochs_done: float | None = None,
    dropped: int | None = None,
) -> str:
    """aux_loss: the weighted auxiliary losses (a mixture of experts' load balancing), shown next to
    the loss (the cross-entropy) they are added to in training; epochs_done: the epochs done after
    this step, for a run counted in epochs (training.by_epoch); dropped: the token-expert assignments
    a mixture of experts' capacity dropped in this step, over every layer, micro-batch and rank (0
    when dropless), shown after the auxiliary loss."""
    aux = f" | Aux Loss: {aux_loss:.4f}" if aux_loss is not None else ""
    if dropped is not None:
        aux += f" | Dropped: {dropped:,}"
    # A run counted in epochs (training.by_epoch) also says how far through them it is.
    epoch = ""
    if epochs_done is not None:
        t = trainer.config.training
        epochs = t.max_steps / max(1, trainer.loader.batches_per_epoch // cfg.grad_accum_nums(t))
        epoch = f" | Epoch: {epochs_done:.2f}/{epochs:g}"
    line = (
        f"Step [{step}/{trainer.config.training.max_steps}]{epoch} | Loss: {loss:.4f}{aux} | LR: {lr:.2e} | "
        f"Grad Norm: {grad_norm:.4f} | ETA: {format_eta(eta_s)} | Tokens/s: {tokens_per_s:,.0f}"
    )
    if utilization is not None:
        line += f" | MFU: {100 * utilization:.1f}%"
    if memory_gib is not None:
        line += f" | Mem: {memory_gib:.1f} GiB"
    return line
