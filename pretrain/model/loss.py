"""The training loss: next-token cross-entropy, plus whatever auxiliary losses the model's
blocks returned (already weighted by their own config).

The model returns logits, or what an output head made of its last block's output: the head
here (ChunkedCrossEntropy) runs inside the model's forward, where DDP and FSDP2 expect every
parameter to be used, and applies the final norm, the output projection and the cross-entropy.
It computes the loss in one piece when the memory plan says the logits fit
(training.loss_chunk_tokens 0, pretrain/plan/parallelism.py), or a chunk of tokens at a time, each
recomputed in the backward pass, so the logits of a whole batch never exist together.

The cross-entropy (cross_entropy_sum) keeps for the backward pass the logits in their own dtype
(bf16 under autocast) and each row's float32 log-sum-exp, not float32 log-probabilities: 2 bytes a
logit, not 4, and the gradient (softmax - one-hot) is computed in float32 a slab of rows at a time.

When pretrain/distributed/parallel.py compiles the blocks it compiles this head too (the model's
compile_loss_head, with its compile_mode): the final norm, the output projection (bf16 under
autocast) and the cross-entropy run in one compiled function, so the forward runs nothing
uncompiled but the embedding lookup, and the fp32 upcast, log-softmax and the gather of the
targets' terms fuse into one kernel instead of materialising fp32 logits in global memory."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import NamedTuple, cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from pretrain.model.transformer import RMSNorm, rms_norm

BACKWARD_SLAB_ELEMENTS = 2**24
"""The eager cross-entropy's backward computes softmax - one-hot in float32 this many logits at a
time (64 MiB), so a large vocabulary's float32 gradient never exists for a whole batch. Compiled,
the whole is one fused kernel that stores only the result."""


class Loss(NamedTuple):
    total: Tensor
    """What the backward pass starts from: cross_entropy plus every auxiliary loss."""
    cross_entropy: Tensor
    """The mean next-token cross-entropy: the loss the step line and the metrics report."""
    aux_losses: dict[str, Tensor]
    """Each block's auxiliary loss by name (empty for the dense model)."""
    counts: dict[str, Tensor] = {}  # noqa: RUF012 (never mutated: each Loss gets its own dict)
    """What blocks count rather than lose, by name: the integer entries of their outputs (a
    mixture of experts' dropped assignments); never added to the loss."""


def next_token_loss(model: nn.Module, tokens: Tensor, targets: Tensor, chunk_tokens: int = 0) -> Loss:
    """The loss of model on tokens (B, T) against targets (B, T), chunk_tokens positions of the
    output projection at a time (0: all at once). model may be wrapped by DDP or sharded by FSDP;
    its head is compiled when the model's blocks are (compile_loss_head), in its compile_mode."""
    inner = getattr(model, "module", model)
    compiled = bool(getattr(inner, "compile_loss_head", False))
    head = ChunkedCrossEntropy(targets, chunk_tokens, compiled, getattr(inner, "compile_mode", None))
    cross_entropy, outputs = model(tokens, head=head)
    aux_losses = {name: value for name, value in outputs.items() if value.is_floating_point()}
    counts = {name: value for name, value in outputs.items() if not value.is_floating_point()}
    # One stack and one sum for every layer's auxiliary loss, not an add per layer: these run
    # outside the compiled blocks (the gradient each loss gets is 1 either way).
    total = cross_entropy + torch.stack(list(aux_losses.values())).sum() if aux_losses else cross_entropy
    return Loss(total, cross_entropy, aux_losses, counts)


class ChunkedCrossEntropy:
    """An output head: the mean cross-entropy of output(norm(hidden)) against targets,
    chunk_tokens rows at a time.

    At Llama-3's vocabulary of 128256, the fp32 logits of 8192 tokens take 4 GiB, and autograd
    would keep them (or bf16 ones, half that) until the backward pass. Each chunk is checkpointed
    instead: only its input is kept, and its norm and logits are recomputed in the backward pass,
    one chunk at a time. The price is one more output-projection matmul per step.
    """

    def __init__(self, targets: Tensor, chunk_tokens: int, compiled: bool = False, compile_mode: str | None = None) -> None:
        self.targets, self.chunk_tokens, self.compiled, self.compile_mode = targets, chunk_tokens, compiled, compile_mode

    def __call__(self, hidden: Tensor, norm: RMSNorm, output: nn.Linear) -> Tensor:
        return chunked_cross_entropy(
            hidden.flatten(0, 1),
            output,
            self.targets.flatten(0, 1),
            self.chunk_tokens,
            self.compiled,
            norm=norm,
            compile_mode=self.compile_mode,
        )


ChunkLoss = Callable[[Tensor, Tensor, int], Tensor]
"""(hidden (N, dim), targets (N,), divisor) -> the summed cross-entropy of that chunk / divisor."""


def chunked_cross_entropy(
    hidden: Tensor,
    output: nn.Linear,
    targets: Tensor,
    chunk_tokens: int,
    compiled: bool = False,
    norm: RMSNorm | None = None,
    compile_mode: str | None = None,
) -> Tensor:
    """Mean cross-entropy of output(norm(hidden)) (N, vocab) against targets (N,) (norm None:
    hidden is normalised already), chunk_tokens rows at a time (0, or at least N: in one piece,
    nothing recomputed), with torch.compile in compile_mode when compiled."""
    chunk_loss = _compiled_chunk_loss(norm, output, compile_mode) if compiled else _eager_chunk_loss(norm, output)
    n = hidden.shape[0]
    if chunk_tokens <= 0 or n <= chunk_tokens:
        return chunk_loss(hidden, targets, n)  # the mean inside: nothing of the forward runs outside it
    total = hidden.new_zeros((), dtype=torch.float32)
    for start in range(0, n, chunk_tokens):
        h, t = hidden[start : start + chunk_tokens], targets[start : start + chunk_tokens]
        if torch.is_grad_enabled():
            total = total + checkpoint(chunk_loss, h, t, 1, use_reentrant=False)
        else:
            total = total + chunk_loss(h, t, 1)
    return total / n


def _eager_chunk_loss(norm: RMSNorm | None, output: nn.Linear) -> ChunkLoss:
    """Through the modules' calls, so hooks on them fire (debug.trace_nonfinite names `norm` and `output`)."""

    def chunk_loss(hidden: Tensor, targets: Tensor, divisor: int) -> Tensor:
        return cross_entropy_sum(output(hidden if norm is None else norm(hidden)), targets) / divisor

    return chunk_loss


def _compiled_chunk_loss(norm: RMSNorm | None, output: nn.Linear, compile_mode: str | None) -> ChunkLoss:
    """Through the weights, not the modules: under FSDP2 a module's parameter is swapped between
    its shard and the gathered tensor, and a compiled function guards on tensors' shapes, not on
    their identities. (Compile is never on with the debug hooks.)"""
    weight, function = output.weight, compiled_loss_sum(compile_mode)
    norm_weight, eps = (None, 0.0) if norm is None else (norm.weight, norm.eps)
    return lambda hidden, targets, divisor: function(hidden, norm_weight, eps, weight, targets, divisor)


def _projected_loss_sum(
    hidden: Tensor, norm_weight: Tensor | None, eps: float, weight: Tensor, targets: Tensor, divisor: int
) -> Tensor:
    """Summed cross-entropy of rms_norm(hidden (N, dim)) @ weight.T against targets (N,), / divisor
    (norm_weight None: no norm)."""
    if norm_weight is not None:
        hidden = rms_norm(hidden, norm_weight, eps)
    return cross_entropy_sum(F.linear(hidden, weight), targets) / divisor


@functools.cache
def compiled_loss_sum(mode: str | None = None) -> Callable[[Tensor, Tensor | None, float, Tensor, Tensor, int], Tensor]:
    """_projected_loss_sum compiled once per process and mode (the first call compiles, on the first batch)."""
    return torch.compile(_projected_loss_sum, mode=mode)


def cross_entropy_sum(logits: Tensor, targets: Tensor) -> Tensor:
    """Summed cross-entropy of logits (N, vocab) against targets (N,), in float32. The logits come in
    the autocast dtype (bf16 under training.use_amp); log-softmax over a large vocabulary needs
    float32, so they are upcast for it, and only they (in their own dtype) and each row's float32
    log-sum-exp are kept for the backward pass (_CrossEntropySum)."""
    return cast(Tensor, _CrossEntropySum.apply(logits, targets))


class _CrossEntropySum(torch.autograd.Function):
    """sum over rows of logsumexp(logits) - logits[target]; gradient (softmax - one-hot) * grad."""

    @staticmethod
    def forward(ctx: torch.autograd.function.FunctionCtx, logits: Tensor, targets: Tensor) -> Tensor:
        upcast = logits.float()
        lse = torch.logsumexp(upcast, dim=-1)  # (N,)
        ctx.save_for_backward(logits, targets, lse)
        return (lse - upcast.gather(-1, targets[:, None]).squeeze(-1)).sum()

    @staticmethod
    def backward(ctx: torch.autograd.function.FunctionCtx, grad: Tensor) -> tuple[Tensor, None]:
        logits, targets, lse = ctx.saved_tensors  # type: ignore[attr-defined]
        if torch.compiler.is_compiling():  # one fused kernel: nothing float32 is stored
            return _softmax_minus_one_hot(logits, targets, lse, grad), None
        rows = max(1, BACKWARD_SLAB_ELEMENTS // max(1, logits.shape[-1]))
        grad_logits = torch.empty_like(logits)
        for start in range(0, logits.shape[0], rows):
            part = slice(start, start + rows)
            grad_logits[part] = _softmax_minus_one_hot(logits[part], targets[part], lse[part], grad)
        return grad_logits, None


def _softmax_minus_one_hot(logits: Tensor, targets: Tensor, lse: Tensor, grad: Tensor) -> Tensor:
    """(softmax(logits) - one_hot(targets)) * grad in float32, returned in logits' dtype.
    Element-wise only (the one-hot is a comparison with the column index, not a scatter): compiled,
    it is one kernel that reads the saved logits and writes the gradient in their dtype, with no
    float32 (rows, vocab) buffer between (a scatter_add made inductor materialise one)."""
    probs = torch.exp(logits.float() - lse[:, None])  # (rows, vocab)
    hit = torch.arange(logits.shape[-1], device=logits.device) == targets[:, None]  # (rows, vocab)
    return ((probs - hit.to(probs.dtype)) * grad).to(logits.dtype)


def cross_entropy_loss(logits: Tensor, targets: Tensor) -> Tensor:
    """Mean next-token cross-entropy of logits (B, T, V) against targets (B, T), in float32.

    Logits may be bf16 under autocast; log-softmax over a large vocabulary needs float32.
    """
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(0, 1))
