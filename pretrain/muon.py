"""Muon (training.optimizer=muon): momentum, then an orthogonalized update, for the hidden matrices;
AdamW for the rest (embeddings, norms, the output layer), in one torch.optim.Optimizer so that
checkpoints, clipping and the schedule treat it as any other.

A hidden matrix's update is its Nesterov momentum with its singular values pushed towards 1
(U S V^T -> U V^T), by default with a few Newton-Schulz iterations in bfloat16 (Keller Jordan's
quintic). The orthogonalization is chosen by name (training.muon_orthogonalize, registry
ORTHOGONALIZERS), so alternatives can be studied without touching the optimizer. The training
loop sets every group's "lr" from the schedule; a Muon group scales it by its "lr_scale"
(muon_learning_rate / learning_rate), so both follow one schedule.

Under DDP the gradients are already averaged: every rank computes the same update. Under FSDP2
a parameter is a DTensor sharded by rows: its momentum stays sharded, the update is
orthogonalized on the whole matrix (gathered) and each rank keeps its own rows of it.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch.distributed.tensor import DTensor, distribute_tensor

from pretrain import registry
from pretrain.config import TrainingConfig

Orthogonalize = Callable[[torch.Tensor, int], torch.Tensor]
NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)  # a quintic that maximises the slope at 0


class MuonError(ValueError):
    """A parameter group Muon cannot update: one line naming it."""


def newton_schulz(grad: torch.Tensor, steps: int) -> torch.Tensor:
    """grad (..., m, n) -> approximately U V^T of its SVD, in bfloat16: singular values land
    in about [0.7, 1.2], which trains as well as exactly 1 and costs a few matmuls."""
    a, b, c = NS_COEFFICIENTS
    x = grad.bfloat16()
    tall = x.size(-2) > x.size(-1)
    if tall:  # iterate on the smaller Gram matrix
        x = x.mT
    x = x / (x.norm(dim=(-2, -1), keepdim=True) + 1e-7)  # spectral norm <= Frobenius norm <= 1
    for _ in range(steps):
        gram = x @ x.mT
        x = a * x + (b * gram + c * gram @ gram) @ x
    return x.mT if tall else x


def svd_orthogonalize(grad: torch.Tensor, steps: int) -> torch.Tensor:
    """grad -> exactly U V^T (in fp32; steps is unused): the reference Newton-Schulz approximates."""
    u, _, vh = torch.linalg.svd(grad.float(), full_matrices=False)
    return u @ vh


def orthogonalizer(name: str) -> Orthogonalize:
    return registry.load(registry.ORTHOGONALIZERS[name])


class Muon(torch.optim.Optimizer):
    """Groups with use_muon=True get Muon (lr * lr_scale, momentum, weight_decay, ns_steps);
    the others AdamW (lr, betas, eps, weight_decay). Hidden matrices only in Muon groups:
    MuonError otherwise."""

    def __init__(self, groups: list[dict], orthogonalize: Orthogonalize, names: dict[int, str] | None = None) -> None:
        defaults: dict[str, Any] = {"lr": 0.0, "lr_scale": 1.0, "weight_decay": 0.0, "momentum": 0.95, "ns_steps": 5}
        defaults |= {"betas": (0.9, 0.95), "eps": 1e-8, "use_muon": False}
        super().__init__(groups, defaults)
        self.orthogonalize = orthogonalize
        for group in self.param_groups:
            for p in group["params"] if group["use_muon"] else ():
                if p.ndim < 2:
                    name = (names or {}).get(id(p), "a parameter")
                    raise MuonError(
                        f"Muon updates matrices only, but {name} has shape {tuple(p.shape)}; leave it to the AdamW groups"
                    )

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        loss = closure() if closure is not None else None
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if group["use_muon"]:
                self._muon(group, params)
            else:
                self._adamw(group, params)
        return loss

    def _muon(self, group: dict, params: Iterable[torch.Tensor]) -> None:
        lr, beta = group["lr"] * group["lr_scale"], group["momentum"]
        for p in params:
            grad, state = p.grad, self.state[p]
            assert grad is not None  # step() passes only parameters with gradients
            if "momentum_buffer" not in state:
                state["momentum_buffer"] = torch.zeros_like(grad)
            buf = state["momentum_buffer"]
            buf.lerp_(grad, 1 - beta)
            nesterov = grad.lerp(buf, beta)
            update = self._orthogonal(nesterov, group["ns_steps"])
            rows, cols = p.shape[-2], p.shape[-1]
            p.mul_(1 - lr * group["weight_decay"])
            p.add_(update.to(p.dtype), alpha=-lr * math.sqrt(max(1.0, rows / cols)))

    def _orthogonal(self, grad: torch.Tensor, steps: int) -> torch.Tensor:
        """The orthogonalized update, in grad's layout (a DTensor's own rows under FSDP2)."""
        if isinstance(grad, DTensor):
            whole = self.orthogonalize(grad.full_tensor(), steps)
            return distribute_tensor(whole.to(grad.dtype), grad.device_mesh, grad.placements, src_data_rank=None)
        return self.orthogonalize(grad, steps)

    def _adamw(self, group: dict, params: Iterable[torch.Tensor]) -> None:
        lr, (beta1, beta2), eps = group["lr"], group["betas"], group["eps"]
        for p in params:
            state = self.state[p]
            if not state:
                state["step"] = torch.zeros((), dtype=torch.float32)
                state["exp_avg"] = torch.zeros_like(p)
                state["exp_avg_sq"] = torch.zeros_like(p)
            state["step"] += 1
            step = float(state["step"])
            state["exp_avg"].lerp_(p.grad, 1 - beta1)
            state["exp_avg_sq"].mul_(beta2).addcmul_(p.grad, p.grad, value=1 - beta2)
            denom = (state["exp_avg_sq"] / (1 - beta2**step)).sqrt_().add_(eps)
            p.mul_(1 - lr * group["weight_decay"])
            p.addcdiv_(state["exp_avg"], denom, value=-lr / (1 - beta1**step))


def is_hidden_matrix(name: str, param: torch.Tensor) -> bool:
    """A matrix inside a transformer block (attention, feed-forward, experts); the embedding and
    the output layer are matrices too, but they map tokens, not hidden states: AdamW's."""
    return param.ndim >= 2 and ".layers." in f".{name}"


def build_muon(model: torch.nn.Module, training: TrainingConfig, device: torch.device) -> torch.optim.Optimizer:
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    hidden = [p for n, p in named if is_hidden_matrix(n, p)]
    rest = [p for n, p in named if not is_hidden_matrix(n, p)]
    common: dict[str, Any] = {"lr": training.learning_rate, "weight_decay": training.weight_decay}
    groups: list[dict[str, Any]] = [
        common
        | {"params": hidden, "use_muon": True, "momentum": training.muon_momentum, "ns_steps": training.muon_ns_steps}
        | {"lr_scale": training.muon_learning_rate / training.learning_rate},
        common | {"params": [p for p in rest if p.ndim >= 2], "betas": (training.beta1, training.beta2)},
        common | {"params": [p for p in rest if p.ndim < 2], "betas": (training.beta1, training.beta2), "weight_decay": 0.0},
    ]
    names = {id(p): n for n, p in named}
    return Muon(groups, orthogonalizer(training.muon_orthogonalize), names)
