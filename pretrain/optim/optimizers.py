"""The optimizers (training.optimizer; pretrain/registry.py names them, with their state size).

A builder takes the model as trained (wrapped by DDP, or sharded by FSDP2: it must build after
sharding, so that the optimizer holds the shards), the training config and the device, and returns
a torch.optim.Optimizer. The training loop sets every param group's "lr" before each step.

A step whose loss or gradient norm is not finite must change nothing (pretrain/numerics/debug.py).
Where the optimizer can be told so on the device (takes_found_inf: torch's fused AdamW, and Muon
whose AdamW groups are fused), the loop issues the step masked by a device tensor (step_unless)
before the host learns whether it was finite; otherwise it reads first and steps only then."""

from __future__ import annotations

from typing import Any

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


def takes_found_inf(optimizer: torch.optim.Optimizer, device: torch.device) -> bool:
    """Whether optimizer.step() can be told by a tensor on device to change nothing (step_unless):
    torch's fused AdamW, or an optimizer that says so (Muon: takes_found_inf), with every parameter
    on the device's kind. Not foreach AdamW (it has no such input), nor parameters in host memory
    under CPU offload (the flag would have to be copied to the host: a synchronization anyway)."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    if any(p.device.type != device.type for p in params):
        return False
    if type(optimizer) is torch.optim.AdamW:
        return all(group["fused"] for group in optimizer.param_groups)
    return bool(getattr(optimizer, "takes_found_inf", False))


def step_unless(optimizer: torch.optim.Optimizer, found_inf: torch.Tensor) -> None:
    """optimizer.step(), which changes no weight, moment or step count where found_inf (a 0-d
    float32 tensor on the parameters' device) is 1.0: told as torch's GradScaler tells it
    (optimizer.found_inf, and grad_scale None: the gradients are not scaled). For an optimizer
    takes_found_inf accepts. A first step creates the state it lacked (zero moments, step 0) even
    when skipped: forget_state_since removes it."""
    masked: Any = optimizer
    masked.grad_scale, masked.found_inf = None, found_inf
    try:
        optimizer.step()
    finally:
        del masked.grad_scale, masked.found_inf


def forget_state_since(optimizer: torch.optim.Optimizer, count: int) -> None:
    """Remove the optimizer state of the parameters that had none before (count: len(optimizer.state)
    then), so that a skipped first step leaves the state as it was, and a checkpoint of it as before."""
    for param in list(optimizer.state)[count:]:
        del optimizer.state[param]
