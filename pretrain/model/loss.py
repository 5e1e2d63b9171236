"""The training loss: next-token cross-entropy, plus whatever auxiliary losses the model's
blocks returned (already weighted by their own config).

The model returns logits, or what an output head made of its final hidden states: the head
here (ChunkedCrossEntropy) runs inside the model's forward, where DDP and FSDP2 expect every
parameter to be used. It computes the loss in one piece when the memory plan says the logits fit
(training.loss_chunk_tokens 0, pretrain/plan/parallelism.py), or a chunk of tokens at a time, each
recomputed in the backward pass, so the logits of a whole batch never exist together.

When pretrain/distributed/parallel.py compiles the blocks it compiles this head too (the model's
compile_loss_head): the output projection runs in bf16 under autocast, and the fp32 upcast,
log-softmax and the gather of the targets' terms fuse into one kernel instead of materialising
fp32 logits and log-probabilities in global memory, forward and backward."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint


class Loss(NamedTuple):
    total: Tensor
    """What the backward pass starts from: cross_entropy plus every auxiliary loss."""
    cross_entropy: Tensor
    """The mean next-token cross-entropy: the loss the step line and the metrics report."""
    aux_losses: dict[str, Tensor]
    """Each block's auxiliary loss by name (empty for the dense model)."""


def next_token_loss(model: nn.Module, tokens: Tensor, targets: Tensor, chunk_tokens: int = 0) -> Loss:
    """The loss of model on tokens (B, T) against targets (B, T), chunk_tokens positions of the
    output projection at a time (0: all at once). model may be wrapped by DDP or sharded by FSDP;
    its head is compiled when the model's blocks are (compile_loss_head)."""
    compiled = bool(getattr(getattr(model, "module", model), "compile_loss_head", False))
    cross_entropy, aux_losses = model(tokens, head=ChunkedCrossEntropy(targets, chunk_tokens, compiled))
    total = cross_entropy + sum(aux_losses.values()) if aux_losses else cross_entropy
    return Loss(total, cross_entropy, aux_losses)


class ChunkedCrossEntropy:
    """An output head: the mean cross-entropy of output(hidden) against targets, chunk_tokens rows
    at a time.

    At Llama-3's vocabulary of 128256, the fp32 logits of 8192 tokens take 4 GiB, and autograd
    would keep them (as log-probabilities) until the backward pass. Each chunk is checkpointed
    instead: only its input is kept, and its logits are recomputed in the backward pass, one
    chunk at a time. The price is one more output-projection matmul per step.
    """

    def __init__(self, targets: Tensor, chunk_tokens: int, compiled: bool = False) -> None:
        self.targets, self.chunk_tokens, self.compiled = targets, chunk_tokens, compiled

    def __call__(self, hidden: Tensor, output: nn.Linear) -> Tensor:
        return chunked_cross_entropy(hidden.flatten(0, 1), output, self.targets.flatten(0, 1), self.chunk_tokens, self.compiled)


ChunkLoss = Callable[[Tensor, Tensor], Tensor]
"""(hidden (N, dim), targets (N,)) -> the summed cross-entropy of that chunk."""


def chunked_cross_entropy(
    hidden: Tensor, output: nn.Linear, targets: Tensor, chunk_tokens: int, compiled: bool = False
) -> Tensor:
    """Mean cross-entropy of output(hidden) (N, vocab) against targets (N,), chunk_tokens rows at a
    time (0, or at least N: in one piece, nothing recomputed), with torch.compile when compiled."""
    chunk_loss = _compiled_chunk_loss(output) if compiled else _eager_chunk_loss(output)
    n = hidden.shape[0]
    if chunk_tokens <= 0 or n <= chunk_tokens:
        return chunk_loss(hidden, targets) / n
    total = hidden.new_zeros((), dtype=torch.float32)
    for start in range(0, n, chunk_tokens):
        h, t = hidden[start : start + chunk_tokens], targets[start : start + chunk_tokens]
        if torch.is_grad_enabled():
            total = total + checkpoint(chunk_loss, h, t, use_reentrant=False)
        else:
            total = total + chunk_loss(h, t)
    return total / n


def _eager_chunk_loss(output: nn.Linear) -> ChunkLoss:
    """Through the module's call, so hooks on it fire (debug.trace_nonfinite names `output`)."""
    return lambda hidden, targets: _cross_entropy_sum(output(hidden), targets)


def _compiled_chunk_loss(output: nn.Linear) -> ChunkLoss:
    """Through the weight, not the module: under FSDP2 the module's parameter is swapped between
    its shard and the gathered tensor, and a compiled function guards on tensors' shapes, not on
    their identities. (Compile is never on with the debug hooks.)"""
    weight = output.weight
    return lambda hidden, targets: compiled_loss_sum()(hidden, weight, targets)


def _cross_entropy_sum(logits: Tensor, targets: Tensor) -> Tensor:
    """Summed cross-entropy of logits (N, vocab) against targets (N,). The logits come in the
    autocast dtype (bf16 under training.use_amp); log-softmax over a large vocabulary needs fp32,
    so they are upcast for it (compiled, the upcast is fused into the log-softmax, never stored)."""
    return F.cross_entropy(logits.float(), targets, reduction="sum")


def _projected_loss_sum(hidden: Tensor, weight: Tensor, targets: Tensor) -> Tensor:
    """Summed cross-entropy of hidden (N, dim) @ weight.T against targets (N,)."""
    return _cross_entropy_sum(F.linear(hidden, weight), targets)


@functools.cache
def compiled_loss_sum() -> Callable[[Tensor, Tensor, Tensor], Tensor]:
    """_projected_loss_sum compiled once per process (the first call compiles, on the first batch)."""
    return torch.compile(_projected_loss_sum)


def cross_entropy_loss(logits: Tensor, targets: Tensor) -> Tensor:
    """Mean next-token cross-entropy of logits (B, T, V) against targets (B, T), in float32.

    Logits may be bf16 under autocast; log-softmax over a large vocabulary needs float32.
    """
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(0, 1))
