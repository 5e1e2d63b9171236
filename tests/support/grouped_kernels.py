"""A grouped matmul that misbehaves as a GPU's might, for the tests of the dropless experts and
of the acceptance row that checks the kernel a GPU runs."""

from __future__ import annotations

import pytest
import torch
from torch import Tensor

from pretrain.model import moe_dropless


def nan_for_empty_groups(monkeypatch: pytest.MonkeyPatch) -> None:
    """grouped_mm as pytorch/pytorch#172439 reports it on B200: right outputs, but NaN in the
    weight gradient of every group that got no rows."""
    real = moe_dropless.GROUPED_MM

    def grouped(a: Tensor, b: Tensor, offs: Tensor) -> Tensor:
        if b.requires_grad:
            b = b.view_as(b)
            empty = torch.diff(offs, prepend=offs.new_zeros(1)) == 0
            b.register_hook(lambda g: torch.where(empty.view(-1, 1, 1), torch.full_like(g, float("nan")), g))
        return real(a, b, offs=offs)

    monkeypatch.setattr(moe_dropless, "GROUPED_MM", grouped)
