"""The feed-forward blocks a layer can have (model.ffn; pretrain/registry.py names them).

A block is built from the ModelConfig and maps (B, T, dim) to (B, T, dim); one with a loss of its
own (a mixture of experts' load balancing) returns ((B, T, dim), {name: weighted loss}) instead,
and the model hands those losses to pretrain/model/loss.py. residual_outputs() names the projections
that write into the residual stream: the model initialises them scaled down with depth."""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor, nn

from pretrain.config import ModelConfig


class SwiGLU(nn.Module):
    """Llama's block: w2(silu(w1 x) * w3 x); w3 x is a learned gate on the activation."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.w1 = nn.Linear(cfg.dim, cfg.ffn_dim, bias=False)
        self.w2 = nn.Linear(cfg.ffn_dim, cfg.dim, bias=False)
        self.w3 = nn.Linear(cfg.dim, cfg.ffn_dim, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))  # (B, T, ffn_dim) inside, (B, T, dim) out

    def residual_outputs(self) -> list[nn.Linear]:
        return [self.w2]
