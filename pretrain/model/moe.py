"""A mixture of experts feed-forward block (model.moe.num_experts > 0; the MegaBlocks knobs).

Token-choice top-k routing: a linear router scores every expert for every token, each token goes
to its top_k experts, and their outputs are summed weighted by the router's probabilities
renormalised over those k. The experts are SwiGLU blocks whose weights are batched, (num_experts,
...) tensors: every expert runs in one kernel per matmul, with no Python loop over experts, and
every expert's weights are one parameter, so DDP and FSDP see each of them used on every step,
even an expert that got no token.

Dropless (model.moe.capacity_factor null, the default; pretrain/model/moe_dropless.py): every
assignment reaches its expert. The assignments are sorted by expert and run as grouped matmuls
(bf16), or, where grouped_mm does not run (fp32, widths not multiples of 8), through a buffer with
a row for every token per expert. Which kernel a device has (ExpertsKernel) is decided once, when
the model's device is known (place_experts, called by pretrain/distributed/parallel.py before it
compiles): the compiled block reads a plain attribute and never asks CUDA for its capability.
Eval mode is always dropless, so no token's output depends on the other tokens of its batch,
padding included.

Capacity routing (a capacity_factor, as MegaBlocks' capacity-based MoE): in training each expert
takes at most `capacity` tokens per batch (capacity_factor x tokens x top_k / num_experts, rounded
up); assignments past it are dropped (the token's residual stream carries it through that layer).
Each expert has capacity + 1 rows: an assignment within capacity writes its token into its own
row, one past it into the expert's last (overflow) row, whose output is read back with weight 0.
The block also returns how many assignments it dropped (DROPPED, an int64 count: 0 when dropless),
which pretrain/model/loss.py keeps out of the loss and the step line reports.

Static shapes either way: every tensor's size follows from the batch's shape, never from where
the router sent its tokens, so torch.compile traces the block as one graph that routing never
breaks or recompiles, and a GPU never waits for the host to learn a size.

The load-balancing loss (Switch Transformer's): num_experts x sum over experts of (the share of
assignments it got) x (its mean router probability). It is 1 when routing is uniform, its
minimum, and grows as routing collapses onto few experts; weighted by aux_loss_weight, it joins
the training loss and the step line.
"""

from __future__ import annotations

import logging
import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from pretrain.config import ModelConfig
from pretrain.model.moe_dropless import ExpertsKernel, dropless_experts, experts_kernel, grouped_mm_runs

AUX_LOSS = "moe_load_balance"
DROPPED = "moe_dropped"
"""The block's count of token-expert assignments its capacity dropped (an int64 tensor: a count,
not a loss; pretrain/model/loss.py adds only floating-point entries to the loss)."""


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

    kernel: ExpertsKernel | None = None
    """How its device runs dropless experts (place_experts); None until placed: then decided per
    call from the tokens' device, which is right eagerly but asks CUDA inside a compiled trace."""

    normal_init = {"w1": "std", "w3": "std", "w2": "residual"}
    """How Transformer.init_weights draws the batched expert weights (w2 writes into the residual stream)."""

    def forward(self, x: Tensor) -> tuple[Tensor, dict[str, Tensor]]:
        batch, seq, dim = x.shape
        tokens = x.reshape(-1, dim)  # (N, dim)
        n = tokens.size(0)
        probs = self.router(tokens).float().softmax(dim=-1)  # (N, E), fp32 for a stable softmax
        dtype = matmul_dtype(tokens, self.w1)
        kernel = self.kernel or experts_kernel(tokens.device)
        if self.training and self.capacity_factor is not None:
            slots = capacity(n, self.num_experts, self.top_k, self.capacity_factor)
            out, route = self.buffered(tokens, probs, slots, dtype)
            experts, dropped = route.experts_per_token, (~route.kept).sum()
        elif grouped_mm_runs(dtype, kernel, dim, self.w1.size(-1)):
            weights, experts = probs.topk(self.top_k, dim=-1)  # (N, k)
            weights = weights / weights.sum(dim=-1, keepdim=True)
            out = dropless_experts(
                tokens, experts, weights, self.w1, self.w3, self.w2, dtype, zero_empty=kernel.zero_empty_gradients
            )
            dropped = torch.zeros((), dtype=torch.int64, device=tokens.device)
        else:
            # Room for every assignment (an expert gets at most one per token), so nothing is dropped.
            out, route = self.buffered(tokens, probs, n, dtype)
            experts, dropped = route.experts_per_token, torch.zeros((), dtype=torch.int64, device=tokens.device)
        aux = self.aux_loss_weight * load_balance_loss(probs, experts, self.num_experts)
        return out.view(batch, seq, dim), {AUX_LOSS: aux, DROPPED: dropped}

    def buffered(self, tokens: Tensor, probs: Tensor, slots: int, dtype: torch.dtype) -> tuple[Tensor, Route]:
        """The experts over a buffer of slots + 1 rows each (Route): the capacity routing, and at
        slots = N the dropless fallback (num_experts / top_k times the experts' FLOPs)."""
        route = Route(probs, self.top_k, slots)
        rows = tokens.new_zeros(self.num_experts * (slots + 1), tokens.size(1), dtype=dtype)  # (E * (C + 1), dim)
        rows = rows.index_put((route.row,), tokens.to(dtype)[route.token])  # overflow rows: some dropped token
        buffer = rows.view(self.num_experts, slots + 1, tokens.size(1))  # (E, C + 1, dim)
        hidden = F.silu(torch.bmm(buffer, self.w1)) * torch.bmm(buffer, self.w3)  # (E, C + 1, ffn_dim)
        outputs = torch.bmm(hidden, self.w2).view(-1, tokens.size(1))  # (E * (C + 1), dim)
        weighted = outputs[route.row] * route.weight.to(outputs.dtype).unsqueeze(-1)  # (k * N, dim); dropped: 0
        return tokens.new_zeros(tokens.shape).index_add(0, route.token, weighted.to(tokens.dtype)), route

    def residual_outputs(self) -> list[nn.Linear]:
        return []  # w2 is drawn scaled through normal_init


SYNC_WARNING = (
    "model.moe: dropless experts run torch's grouped matmul, which on this GPU ({gpu}) reads the "
    "expert offsets on the host: a host sync per grouped matmul, nine per "
    "layer and step; set model.moe.capacity_factor (e.g. 1.25) for capacity routing, which runs without one"
)


def gpu_description(device: torch.device, capability: tuple[int, int] | None) -> str:
    """How the sync warning names the GPU: its compute capability, or on ROCm its architecture
    (whose reported capability is not CUDA's scale)."""
    if torch.version.hip:
        return f"ROCm {torch.cuda.get_device_properties(device).gcnArchName.split(':')[0]}"
    return "compute capability {}.{}".format(*(capability or (0, 0)))


def place_experts(model: nn.Module, device: torch.device) -> ExpertsKernel | None:
    """Decide once how model's mixtures of experts run on device, the device their forward runs on
    (before torch.compile, which would otherwise trace the capability query): every
    MixtureOfExperts gets the kernel, and a dropless model on a GPU whose grouped matmul syncs with
    the host logs one warning line. Returns the kernel, None for a model without experts."""
    blocks = [module for module in model.modules() if isinstance(module, MixtureOfExperts)]
    if not blocks:
        return None
    capability = torch.cuda.get_device_capability(device) if device.type == "cuda" else None
    kernel = experts_kernel(device, capability)
    for block in blocks:
        block.kernel = kernel
    if kernel.grouped and kernel.host_sync and any(block.capacity_factor is None for block in blocks):
        logging.getLogger("pretrain").warning(SYNC_WARNING.format(gpu=gpu_description(device, capability)))
    return kernel
