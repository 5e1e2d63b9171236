"""The training loss: next-token cross-entropy, plus whatever auxiliary losses the model's
blocks returned (already weighted by their own config).

The model returns logits, or what an output head made of its final hidden states: the head
here (ChunkedCrossEntropy) takes the output projection a chunk of tokens at a time, so the fp32
logits of a whole batch never exist together. It runs inside the model's forward, where DDP and
FSDP2 expect every parameter to be used."""

from __future__ import annotations

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
    output projection at a time (0: all at once). model may be wrapped by DDP or sharded by FSDP."""
    cross_entropy, aux_losses = model(tokens, head=ChunkedCrossEntropy(targets, chunk_tokens))
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

    def __init__(self, targets: Tensor, chunk_tokens: int) -> None:
        self.targets, self.chunk_tokens = targets, chunk_tokens

    def __call__(self, hidden: Tensor, output: nn.Linear) -> Tensor:
        return chunked_cross_entropy(hidden.flatten(0, 1), output, self.targets.flatten(0, 1), self.chunk_tokens)


def chunked_cross_entropy(hidden: Tensor, output: nn.Linear, targets: Tensor, chunk_tokens: int) -> Tensor:
    """Mean cross-entropy of output(hidden) (N, vocab) against targets (N,), chunk_tokens rows at a time."""
    n = hidden.shape[0]
    if chunk_tokens <= 0 or n <= chunk_tokens:
        return _chunk_loss_sum(hidden, output, targets) / n
    total = hidden.new_zeros((), dtype=torch.float32)
    for start in range(0, n, chunk_tokens):
        h, t = hidden[start : start + chunk_tokens], targets[start : start + chunk_tokens]
        if torch.is_grad_enabled():
            total = total + checkpoint(_chunk_loss_sum, h, output, t, use_reentrant=False)
        else:
            total = total + _chunk_loss_sum(h, output, t)
    return total / n


def _chunk_loss_sum(hidden: Tensor, output: nn.Linear, targets: Tensor) -> Tensor:
    """Summed cross-entropy of one chunk: hidden (N, dim), targets (N,)."""
    return F.cross_entropy(output(hidden).float(), targets, reduction="sum")


def cross_entropy_loss(logits: Tensor, targets: Tensor) -> Tensor:
    """Mean next-token cross-entropy of logits (B, T, V) against targets (B, T), in float32.

    Logits may be bf16 under autocast; log-softmax over a large vocabulary needs float32.
    """
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(0, 1))
