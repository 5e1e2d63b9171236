"""A mixture of experts feed-forward block (model.moe.num_experts > 0; the MegaBlocks knobs).

Token-choice top-k routing: a linear router scores every expert for every token, each token goes
to its top_k experts, and their outputs are summed weighted by the router's probabilities
renormalised over those k. In training each expert takes at most `capacity` tokens per batch
(capacity_factor x tokens x top_k / num_experts, rounded up); assignments past it are dropped
(the token's residual stream carries it through that layer). In eval mode nothing is dropped. The experts are SwiGLU blocks whose
weights are batched, (num_experts, ...) tensors: one batched matmul runs every expert, with no
Python loop over experts, and every expert's weights are one parameter, so DDP and FSDP see each
of them used on every step, even an expert that got no token.

The load-balancing loss (Switch Transformer's): num_experts x sum over experts of (the share of
assignments it got) x (its mean router probability). It is 1 when routing is uniform, its
minimum, and grows as routing collapses onto few experts; weighted by aux_loss_weight, it joins
the training loss and the step line.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from pretrain.config import ModelConfig

AUX_LOSS = "moe_load_balance"


def capacity(tokens: int, num_experts: int, top_k: int, capacity_factor: float) -> int:
    return max(1, math.ceil(capacity_factor * tokens * top_k / num_experts))


def load_balance_loss(probs: Tensor, experts: Tensor, num_experts: int) -> Tensor:
    """probs (N, E) router probabilities; experts (N, k) chosen experts -> the scalar loss (1 when uniform)."""
    share = F.one_hot(experts.reshape(-1), num_experts).float().mean(dim=0)  # (E,) sums to 1
    return num_experts * (share * probs.float().mean(dim=0)).sum()


class Route:
    """Where each of a batch's token-expert assignments goes: its token, expert, weight and slot
    in that expert's buffer, for the assignments within capacity. slots is each expert's capacity;
    None keeps every assignment, and self.slots is then what the busiest expert got (in eval mode,
    so that no token's output depends on the other tokens of its batch, padding included: one host
    sync per layer)."""

    def __init__(self, probs: Tensor, top_k: int, slots: int | None) -> None:
        n, num_experts = probs.shape
        weights, experts = probs.topk(top_k, dim=-1)  # (N, k)
        weights = weights / weights.sum(dim=-1, keepdim=True)
        self.experts_per_token = experts
        # Slot order: every token's first choice before any second choice, so capacity drops the
        # least preferred assignments first.
        expert = experts.T.reshape(-1)  # (k * N,)
        token = torch.arange(n, device=probs.device).repeat(top_k)
        weight = weights.T.reshape(-1)
        onehot = F.one_hot(expert, num_experts)
        slot = (onehot.cumsum(dim=0) * onehot).sum(dim=-1) - 1  # this assignment's place in its expert's queue
        if slots is None:
            slots = int(slot.max()) + 1
        self.slots = slots
        keep = slot < slots
        self.token, self.expert, self.weight, self.slot = token[keep], expert[keep], weight[keep], slot[keep]


class MixtureOfExperts(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        moe = cfg.moe
        self.num_experts, self.top_k, self.capacity_factor = moe.num_experts, moe.top_k, moe.capacity_factor
        self.aux_loss_weight = moe.aux_loss_weight
        self.router = nn.Linear(cfg.dim, moe.num_experts, bias=False)
        self.w1 = nn.Parameter(torch.empty(moe.num_experts, cfg.dim, cfg.ffn_dim))
        self.w3 = nn.Parameter(torch.empty(moe.num_experts, cfg.dim, cfg.ffn_dim))
        self.w2 = nn.Parameter(torch.empty(moe.num_experts, cfg.ffn_dim, cfg.dim))

    normal_init = {"w1": "std", "w3": "std", "w2": "residual"}
    """How Transformer.init_weights draws the batched expert weights (w2 writes into the residual stream)."""

    def forward(self, x: Tensor) -> tuple[Tensor, dict[str, Tensor]]:
        batch, seq, dim = x.shape
        tokens = x.reshape(-1, dim)  # (N, dim)
        probs = self.router(tokens).float().softmax(dim=-1)  # (N, E), fp32 for a stable softmax
        slots = capacity(tokens.size(0), self.num_experts, self.top_k, self.capacity_factor) if self.training else None
        route = Route(probs, self.top_k, slots)
        buffer = tokens.new_zeros(self.num_experts, route.slots, dim)  # (E, C, dim)
        buffer[route.expert, route.slot] = tokens[route.token]
        hidden = F.silu(torch.bmm(buffer, self.w1.to(buffer.dtype))) * torch.bmm(buffer, self.w3.to(buffer.dtype))
        outputs = torch.bmm(hidden, self.w2.to(buffer.dtype))  # (E, C, dim)
        weighted = outputs[route.expert, route.slot] * route.weight.to(outputs.dtype).unsqueeze(-1)
        out = tokens.new_zeros(tokens.shape).index_add(0, route.token, weighted.to(tokens.dtype))
        aux = self.aux_loss_weight * load_balance_loss(probs, route.experts_per_token, self.num_experts)
        return out.view(batch, seq, dim), {AUX_LOSS: aux}

    def residual_outputs(self) -> list[nn.Linear]:
        return []  # w2 is drawn scaled through normal_init
