"""Dropless experts (model.moe.capacity_factor null, the default; MegaBlocks' dropless MoE): every
token-expert assignment runs through its expert, with no capacity and no padding.

The k x N assignments are sorted by expert (a stable argsort, so each expert's rows keep their
tokens' order), each expert's count is summed on the device (a scatter-add, never bincount or
nonzero, which would make a GPU wait for the host to learn a size) and the cumulative counts, int32
on the device, are the offsets where each expert's rows end. The experts' SwiGLU then runs as three
grouped matmuls over the sorted rows (torch's F.grouped_mm: one kernel for every expert, each
reading its own rows), and the rows come back to their tokens with one index_add weighted by the
router's renormalised probabilities. Every tensor has k x N rows whatever the routing, so shapes
are static: torch.compile traces one graph that routing never breaks or recompiles.

The expert weights keep their (E, dim, ffn_dim) and (E, ffn_dim, dim) shapes, row-major: as
grouped_mm's right operand, (groups, K, N) with K's stride N, which CUDA's kernel takes (its
strides must be row- or column-major with the leading one a multiple of 16 bytes: ffn_dim and dim
multiples of 8 in bf16), so no weight is copied to another layout per step; the backward's
transposes are column-major views, which it takes too. A checkpoint of the capacity routing loads
unchanged.

Where the experts run as grouped matmuls (ExpertsKernel, decided once per device by
experts_kernel, outside any compiled code: place_experts in pretrain/model/moe.py at build):
bf16 only, both widths multiples of 8 (the 16-byte strides above; registry.grouped_widths_aligned),
on a torch with a CPU kernel and a GPU fallback for _grouped_mm, and on
- CUDA compute capability 9.x and 10.x (H100, H200, B200): CUTLASS's grouped GEMM, which reads the
  offsets on the device. On 10.x torch's kernel gives an expert that got no rows a non-zero weight
  gradient (pytorch/pytorch#172439, open, torch <= 2.13: non-zero on B200, zero on an H800), so
  there each expert weight passes through zero_empty_gradients, whose backward sets an empty
  expert's gradient to 0 (torch.where on the device's counts: no sync; one element-wise pass over
  the experts' weight gradients). The GPU acceptance's `moe` check compares the kernel with a
  per-expert loop, an empty expert included, on the GPU it is lent.
- CUDA compute capability 8.x and 11+ (A100, L4, L40S, RTX): torch's _grouped_mm_fallback, one
  matmul per expert after copying the offsets to the host: a host sync per grouped matmul (nine
  per block and step, three forward and six backward; torch's maintainers plan no sync-free
  Ampere kernel, pytorch/pytorch#186620), but 1x the experts' FLOPs and top_k rows a token, as
  the memory plan counts. The build logs one line saying so and naming model.moe.capacity_factor,
  whose capacity routing runs without a sync; a CUDA graph (training.compile_mode reduce-overhead,
  max-autotune) cannot record that sync.
- ROCm (torch.version.hip; any AMD GPU): torch's _grouped_mm there is the same loop fallback by
  default (aten GroupedBlas.cpp, torch 2.13: CK's grouped GEMM only in a build with it, on gfx90a,
  gfx942 and gfx950, with ROCM_ALLOW_GROUP_GEMM_CK=1; torch 2.9 took CK there by default). So ROCm
  counts as a host sync whichever runs, with the build's line, and zeroes empty experts' gradients
  (CK's behaviour for an empty group is unverified; the fallback's are zero already, so it costs
  one element-wise pass). The compute capability ROCm's torch reports (9.4 for gfx942) is not
  CUDA's scale and is not read. No AMD GPU has run this yet.
- the CPU (forward and backward, compiled too) and the meta device (which only counts).
Elsewhere (fp32, training.use_amp false; a width not a multiple of 8; an older torch) the fallback
runs every expert over a buffer with a row for every token (the capacity routing's buffer at
capacity N: an expert gets at most one assignment per token, so none is dropped), with static
shapes and no sync, at num_experts / top_k times the experts' FLOPs and memory, which the memory
plan counts (pretrain/plan/activations.py as_routed).

Torch versions (requirements: torch >= 2.9): torch._grouped_mm has had meta and autograd formulas
since 2.8, whose CUDA kernel ran on compute capability 9.0 only and had no CPU kernel; 2.9 added
the loop fallback for capability 8.0 and up and the CPU kernel (pytorch/pytorch#161407 and its
stack; huggingface/transformers#46743 checked the CPU kernel per version); 2.10 made it public as
F.grouped_mm (pytorch/pytorch#168298), a plain call of torch._grouped_mm. So grouped_mm is
F.grouped_mm where it exists, torch._grouped_mm on 2.9, and on anything older the buffer runs.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from pretrain import registry


def _grouped_mm_op() -> Callable[..., Tensor] | None:
    """F.grouped_mm (torch >= 2.10), else torch._grouped_mm on torch 2.9, else None (the module docstring)."""
    if hasattr(F, "grouped_mm"):
        return F.grouped_mm
    major, minor = (int(part) for part in torch.__version__.split(".")[:2])
    return torch._grouped_mm if (major, minor) >= (2, 9) and hasattr(torch, "_grouped_mm") else None


GROUPED_MM = _grouped_mm_op()
"""The grouped matmul this torch has with a CPU kernel and a GPU fallback, or None."""
SYNC_FREE_CUDA_MAJORS = registry.GROUPED_MM_SYNC_FREE_CUDA_MAJORS
"""Compute capabilities whose bf16 _grouped_mm is CUTLASS's kernel (torch's fast path: Hopper,
Blackwell); from 8.0 on the others torch loops over the groups with the offsets copied to the host."""
GROUPED_CUDA_MIN = (8, 0)
"""The lowest compute capability where torch's bf16 _grouped_mm runs at all (its loop fallback)."""
EMPTY_GRADIENT_CUDA_MAJORS = (10,)
"""Compute capabilities whose grouped matmul leaves an empty expert's weight gradient unwritten
(pytorch/pytorch#172439): zero_empty_gradients runs there."""


@dataclass(frozen=True)
class ExpertsKernel:
    """How a device runs dropless experts' grouped matmuls: decided once, outside compiled code."""

    grouped: bool
    """Whether bf16 grouped matmuls run there at all (else the every-token buffer)."""
    host_sync: bool = False
    """Whether torch's kernel there reads the offsets on the host (its loop fallback)."""
    zero_empty_gradients: bool = False
    """Whether an empty expert's weight gradient must be zeroed after it (pytorch/pytorch#172439)."""


def experts_kernel(device: torch.device, capability: tuple[int, int] | None = None) -> ExpertsKernel:
    """The kernel dropless experts use on device (the module docstring). A CUDA device's compute
    capability is asked for here unless given: call it before compiling, never inside a trace."""
    if GROUPED_MM is None:
        return ExpertsKernel(grouped=False)
    if device.type != "cuda":
        return ExpertsKernel(grouped=device.type in ("cpu", "meta"))
    if torch.version.hip:  # ROCm: the loop fallback, or CK's kernel where enabled (the module docstring)
        return ExpertsKernel(grouped=True, host_sync=True, zero_empty_gradients=True)
    if capability is None:
        capability = torch.cuda.get_device_capability(device)
    if capability < GROUPED_CUDA_MIN:
        return ExpertsKernel(grouped=False)
    return ExpertsKernel(
        grouped=True,
        host_sync=capability[0] not in SYNC_FREE_CUDA_MAJORS,
        zero_empty_gradients=capability[0] in EMPTY_GRADIENT_CUDA_MAJORS,
    )


def grouped_mm_runs(dtype: torch.dtype, kernel: ExpertsKernel, dim: int, ffn_dim: int) -> bool:
    """Whether the experts run as grouped matmuls: bf16, on a kernel that has them, with both
    widths giving the 16-byte strides the kernel needs (else torch raises on the first call)."""
    return dtype == torch.bfloat16 and kernel.grouped and registry.grouped_widths_aligned(dim, ffn_dim, dtype.itemsize)


class _ZeroEmptyGradients(torch.autograd.Function):
    """The weight as it is; its gradient with every empty expert's slice set to 0."""

    @staticmethod
    def forward(ctx, weight: Tensor, nonempty: Tensor) -> Tensor:
        ctx.save_for_backward(nonempty)
        return weight.view_as(weight)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None]:
        (nonempty,) = ctx.saved_tensors
        # where, not a multiply: an unwritten gradient may hold NaN, and 0 x NaN is NaN
        return torch.where(nonempty.view(-1, 1, 1), grad, torch.zeros((), dtype=grad.dtype, device=grad.device)), None


def zero_empty_gradients(weight: Tensor, counts: Tensor) -> Tensor:
    """weight (E, ...) unchanged; in the backward, the gradient of each expert with counts 0 is 0."""
    return _ZeroEmptyGradients.apply(weight, counts > 0)


class Sorted:
    """The k x N assignments sorted by expert: each sorted row's token and weight, and where each
    expert's rows end (int32, cumulative: grouped_mm's offsets). No host sync: the counts are summed
    with a scatter-add and stay on the device."""

    def __init__(self, experts: Tensor, weights: Tensor, num_experts: int) -> None:
        top_k = experts.size(1)
        flat = experts.reshape(-1)  # (N * k,) token-major: token t's choices at t * k ... t * k + k - 1
        self.order = flat.argsort(stable=True)  # (N * k,) expert-major, tokens in order within an expert
        self.token = self.order // top_k  # (N * k,) the token of each sorted row
        self.weight = weights.reshape(-1)[self.order]  # (N * k,) fp32, renormalised over the token's k
        counts = torch.zeros(num_experts, dtype=torch.int64, device=experts.device)
        self.counts = counts.scatter_add(0, flat, torch.ones_like(flat))  # (E,) rows per expert
        self.offsets = self.counts.cumsum(0).to(torch.int32)  # (E,) where each expert's rows end


def grouped_swiglu(rows: Tensor, w1: Tensor, w3: Tensor, w2: Tensor, offsets: Tensor) -> Tensor:
    """rows (M, dim) sorted by expert, every operand already in the matmul dtype (bf16) -> each row
    through its own expert's SwiGLU, (M, dim)."""
    assert GROUPED_MM is not None, "grouped_swiglu runs where grouped_mm_runs says so"
    hidden = F.silu(GROUPED_MM(rows, w1, offs=offsets)) * GROUPED_MM(rows, w3, offs=offsets)  # (M, ffn_dim)
    return GROUPED_MM(hidden, w2, offs=offsets)  # (M, dim)


def dropless_experts(
    tokens: Tensor,
    experts: Tensor,
    weights: Tensor,
    w1: Tensor,
    w3: Tensor,
    w2: Tensor,
    dtype: torch.dtype,
    zero_empty: bool = False,
) -> Tensor:
    """tokens (N, dim); experts, weights (N, k): each token's chosen experts and their renormalised
    probabilities -> (N, dim), the weighted sum of every chosen expert's output, in tokens' dtype.
    Both matmul operands are cast to dtype (bf16; a no-op for weights FSDP gathered in it);
    zero_empty (ExpertsKernel.zero_empty_gradients) zeroes the gradients of experts given no row."""
    route = Sorted(experts, weights, w1.size(0))
    rows = tokens.to(dtype).index_select(0, route.token)  # (k * N, dim)
    w1, w3, w2 = (w.to(dtype) for w in (w1, w3, w2))
    if zero_empty:
        w1, w3, w2 = (zero_empty_gradients(w, route.counts) for w in (w1, w3, w2))
    outputs = grouped_swiglu(rows, w1, w3, w2, route.offsets)
    weighted = outputs * route.weight.to(outputs.dtype).unsqueeze(-1)
    return tokens.new_zeros(tokens.shape).index_add(0, route.token, weighted.to(tokens.dtype))
