"""A feed-forward block that is not the project's, which tests register (pretrain/registry.py) by
its path, support.feed_forwards:Linear2: tests/pretrain/test_registry.py trains with it, and
tests/pretrain/hf/test_hf_export.py exports it in the project's own format. A test module's path
would resolve only where that module's folder happened to be on sys.path."""

from __future__ import annotations

import torch

from pretrain import config as cfg


class Linear2(torch.nn.Module):
    """A feed-forward block of two plain projections (2 x dim x ffn_dim parameters)."""

    def __init__(self, model: cfg.ModelConfig) -> None:
        super().__init__()
        self.up = torch.nn.Linear(model.dim, model.ffn_dim, bias=False)
        self.down = torch.nn.Linear(model.ffn_dim, model.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(torch.relu(self.up(x)))

    def residual_outputs(self) -> list[torch.nn.Module]:
        return [self.down]
