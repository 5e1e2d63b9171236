"""The optimizers (training.optimizer; pretrain/registry.py names them, with their state size).

A builder takes the model as trained (wrapped by DDP, or sharded by FSDP2: it must build after
sharding, so that the optimizer holds the shards), the training config and the device, and returns
a torch.optim.Optimizer. The training loop sets every param group's "lr" before each step."""

from __future__ import annotations

import torch
from torch.utils._foreach_utils import _get_fused_kernels_supported_devices

from pretrain import registry
from pretrain.config import TrainingConfig


def build_optimizer(model: torch.nn.Module, training: TrainingConfig, device: torch.device) -> torch.optim.Optimizer:
    """The optimizer training.optimizer names."""
    return registry.load(registry.OPTIMIZERS[training.optimizer].build)(model, training, device)


def decay_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    """Two param groups: the matrices, decayed, and the rest (norm weights), not decayed."""
    params = [p for p in model.parameters() if p.requires_grad]
    return [
        {"params": [p for p in params if p.ndim >= 2], "weight_decay": weight_decay},
        {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0},
    ]


def build_adamw(model: torch.nn.Module, training: TrainingConfig, device: torch.device) -> torch.optim.Optimizer:
    """AdamW with weight decay on matrices only, with torch's fused kernel wherever the
    parameters are: on the GPU, and in host memory (CPU runs, and CPU offload, where each step
    updates the offloaded shards on the host); foreach kernels on a device without one."""
    fused = all(fusable(p) for p in model.parameters())
    return torch.optim.AdamW(
        decay_groups(model, training.weight_decay),
        lr=training.learning_rate,
        betas=(training.beta1, training.beta2),
        fused=fused,
        foreach=None if fused else True,
    )


def fusable(p: torch.Tensor) -> bool:
    """Whether torch's fused AdamW kernel takes p: floating point, on a device it has a kernel for
    (CUDA and CPU among them)."""
    return p.is_floating_point() and p.device.type in _get_fused_kernels_supported_devices()
