"""The feed-forward blocks a layer can have (model.ffn; pretrain/registry.py names them).

A block is built from the ModelConfig and maps (B, T, dim) to (B, T, dim); one with a loss of its
own (a mixture of experts' load balancing) returns ((B, T, dim), {name: weighted loss}) instead,
and the model hands those losses to pretrain/model/loss.py. residual_outputs() names the projections
that write into the residual stream: the model initialises them scaled down with depth. A block
may say in which order its weights (or parts of them) are drawn at initialisation (init_draws:
pretrain/model/transformer.py's Transformer.init_weights); without it, in module order."""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor, nn

from pretrain.config import ModelConfig


class SwiGLU(nn.Module):
    """Llama's block: w2(silu(w1 x) * w3 x); w3 x is a learned gate on the activation.

    w1 and w3 read the same input, so they run as one matmul: w13, whose rows are w1's then w3's
    (pretrain/model/fused_layout.py maps it to Llama's separate names)."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.w13 = nn.Linear(cfg.dim, 2 * cfg.ffn_dim, bias=False)
        self.w2 = nn.Linear(cfg.ffn_dim, cfg.dim, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        gate, up = self.w13(x).chunk(2, dim=-1)  # views of one (B, T, 2 ffn_dim): w1 x and w3 x, (B, T, ffn_dim) each
        return self.w2(F.silu(gate) * up)  # (B, T, dim)

    def residual_outputs(self) -> list[nn.Linear]:
        return [self.w2]

    def init_draws(self) -> list[tuple[Tensor, slice]]:
        """The weights' parts in the order Transformer.init_weights draws them: w1, w2, w3, each
        whole, as before w1 and w3 were fused (so a seed gives the weights it always gave)."""
        f = self.w2.in_features
        return [(self.w13.weight, slice(0, f)), (self.w2.weight, slice(None)), (self.w13.weight, slice(f, 2 * f))]
