"""A mixture of experts feed-forward block (model.moe.num_experts > 0; the MegaBlocks knobs).

Token-choice top-k routing: a linear router scores every expert for every token, each token goes
to its top_k experts, and their outputs are summed weighted by the router's probabilities
renormalised over those k. In training each expert takes at most `capacity` tokens per batch
(capacity_factor x tokens x top_k / num_experts, rounded up); assignments past it are dropped
(the token's residual stream carries it through that layer). In eval mode nothing is dropped. The
experts are SwiGLU blocks whose weights are batched, (num_experts, ...) tensors: one batched matmul
runs every expert, with no Python loop over experts, and every expert's weights are one parameter,
so DDP and FSDP see each of them used on every step, even an expert that got no token.

Static shapes: every tensor's size follows from the batch's shape, never from where the router
sent its tokens, so torch.compile traces the block as one graph that routing never breaks or
recompiles, and a GPU never waits for the host to learn a size. Each expert has capacity + 1
rows: an assignment within capacity writes its token into its own row, one past it into the
expert's last (overflow) row, whose output is read back with weight 0. In eval mode the capacity
is the number of tokens, as an expert gets at most one assignment per token: nothing overflows,
so no token's output depends on the other tokens of its batch, padding included (this runs
num_experts / top_k times the experts' FLOPs of training's routing; evaluation is a small share).

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
    """The assignments each expert takes per batch in training: capacity_factor x its fair share, rounded up."""
    return max(1, math.ceil(capacity_factor * tokens * top_k / num_experts))


def one_hot(indices: Tensor, num_classes: int) -> Tensor:
    """indices (...) -> (..., num_classes) int64. F.one_hot checks the indices' range with .item()
    off CUDA, a host sync a dispatch-mode counter would see; a comparison needs none."""
    return (indices.unsqueeze(-1) == torch.arange(num_classes, device=indices.device)).long()


def load_balance_loss(probs: Tensor, experts: Tensor, num_experts: int) -> Tensor:
    """probs (N, E) router probabilities; experts (N, k) chosen experts -> the scalar loss (1 when uniform)."""
    share = one_hot(experts.reshape(-1), num_experts).float().mean(dim=0)  # (E,) sums to 1
    return num_experts * (share * probs.float().mean(dim=0)).sum()


class Route:
    """Where each of a batch's top_k x N token-expert assignments goes, with every token's first
    choice before any second choice (so capacity drops the least preferred assignments first).
    Each assignment has its token, its expert, its place in that expert's queue (slot), whether
    that place is within capacity (kept), its row in the experts' buffer of capacity + 1 rows
    each (the expert's overflow row, the last, when not kept), and its weight (0 when not kept).
    Every tensor has k x N entries, whatever the routing."""

    def __init__(self, probs: Tensor, top_k: int, capacity: int) -> None:
        n, num_experts = probs.shape
        weights, experts = probs.topk(top_k, dim=-1)  # (N, k)
        weights = weights / weights.sum(dim=-1, keepdim=True)
        self.experts_per_token = experts
        self.capacity = capacity
        self.expert = experts.T.reshape(-1)  # (k * N,): every first choice, then every second choice, ...
        self.token = torch.arange(n, device=probs.device).repeat(top_k)  # (k * N,)
        queued = one_hot(self.expert, num_experts)  # (k * N, E)
        self.slot = (queued.cumsum(dim=0) * queued).sum(dim=-1) - 1  # (k * N,) this assignment's place in its expert's queue
        self.kept = self.slot < capacity  # (k * N,) bool: a mask to multiply by, never to index with (that would sync)
        self.row = self.expert * (capacity + 1) + self.slot.clamp(max=capacity)  # (k * N,) in the (E * (capacity + 1)) rows
        self.weight = weights.T.reshape(-1) * self.kept  # (k * N,) fp32


def matmul_dtype(activations: Tensor, weight: Tensor) -> torch.dtype:
    """The dtype the experts' matmuls run in: autocast's when it is on, else the weights' (bf16 when
    FSDP gathers them so under the fp32 residual stream). The activations are cast to it, never
    the weights to the activations': an fp32 run (training.use_amp=false) casts nothing."""
    device = activations.device.type
    return torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else weight.dtype


class MixtureOfExperts(nn.Module):
    """The experts behind their router: (B, T, dim) -> (B, T, dim) and the weighted load-balancing loss."""

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
        n = tokens.size(0)
        probs = self.router(tokens).float().softmax(dim=-1)  # (N, E), fp32 for a stable softmax
        # Eval: room for every assignment (an expert gets at most one per token), so nothing is dropped.
        slots = capacity(n, self.num_experts, self.top_k, self.capacity_factor) if self.training else n
        route = Route(probs, self.top_k, slots)
        dtype = matmul_dtype(tokens, self.w1)
        rows = tokens.new_zeros(self.num_experts * (slots + 1), dim, dtype=dtype)  # (E * (C + 1), dim)
        rows = rows.index_put((route.row,), tokens.to(dtype)[route.token])  # overflow rows: some dropped token
        buffer = rows.view(self.num_experts, slots + 1, dim)  # (E, C + 1, dim)
        hidden = F.silu(torch.bmm(buffer, self.w1)) * torch.bmm(buffer, self.w3)  # (E, C + 1, ffn_dim)
        outputs = torch.bmm(hidden, self.w2).view(-1, dim)  # (E * (C + 1), dim)
        weighted = outputs[route.row] * route.weight.to(outputs.dtype).unsqueeze(-1)  # (k * N, dim); dropped: 0
        out = tokens.new_zeros(tokens.shape).index_add(0, route.token, weighted.to(tokens.dtype))
        aux = self.aux_loss_weight * load_balance_loss(probs, route.experts_per_token, self.num_experts)
        return out.view(batch, seq, dim), {AUX_LOSS: aux}

    def residual_outputs(self) -> list[nn.Linear]:
        return []  # w2 is drawn scaled through normal_init
