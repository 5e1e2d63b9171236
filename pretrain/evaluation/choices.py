"""Multiple-choice scoring by likelihood: each example's rows (pretrain/evaluation/hellaswag.py's Encoded) go
through the model together, and the ending with the lowest loss is its answer.

Batches always have the same shape, (batch_examples x endings, length), the padding masked out:
a compiled model then compiles once. Under DDP or FSDP each rank scores every world_size-th
example, and every rank runs the same number of forward passes (FSDP gathers each block's
weights from all ranks in every forward), the ranks with fewer examples padding with copies of one
that is not counted.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from pretrain.evaluation.hellaswag import Encoded, Tally, choose

PAD_ID = 0
"""Any valid id: padding comes after a row's last token, which (causal attention) it cannot change."""


class TokenLosses:
    """An output head: each position's cross-entropy against the next token, (B, T - 1) in float32,
    the logits made a few rows at a time so that a large vocabulary's never exist for a whole batch."""

    def __init__(self, tokens: Tensor, rows_at_once: int = 4) -> None:
        self.targets, self.rows_at_once = tokens[:, 1:], rows_at_once

    def __call__(self, hidden: Tensor, norm: nn.Module, output: nn.Linear) -> Tensor:
        losses = []
        for start in range(0, hidden.shape[0], self.rows_at_once):
            logits = output(norm(hidden[start : start + self.rows_at_once, :-1])).float()  # (rows, T - 1, vocab)
            targets = self.targets[start : start + self.rows_at_once]
            losses.append(F.cross_entropy(logits.transpose(1, 2), targets, reduction="none"))  # (rows, T - 1)
        return torch.cat(losses)


def pack(examples: list[Encoded], length: int) -> tuple[Tensor, Tensor]:
    """The rows of examples as tokens (rows, length) and a mask (rows, length - 1) of the positions
    whose next-token loss is an ending's."""
    rows = [(row, start) for example in examples for row, start in zip(example.rows, example.starts, strict=True)]
    tokens = torch.full((len(rows), length), PAD_ID, dtype=torch.long)
    scored = torch.zeros((len(rows), length - 1), dtype=torch.bool)
    for i, (row, start) in enumerate(rows):
        if len(row) > length:
            raise ValueError(f"a row of {len(row)} tokens does not fit batches of rows of {length}")
        tokens[i, : len(row)] = torch.tensor(row, dtype=torch.long)
        scored[i, start - 1 : len(row) - 1] = True  # position p predicts token p + 1
    return tokens, scored


def shares(count: int, rank: int, world_size: int, batch_examples: int) -> Iterator[list[int | None]]:
    """The indices of the examples rank scores, batch_examples at a time; None fills a batch with
    an example that is not counted. Every rank gets the same number of batches."""
    mine: list[int | None] = list(range(rank, count, world_size))
    batches = math.ceil(math.ceil(count / world_size) / batch_examples)
    mine += [None] * (batches * batch_examples - len(mine))
    for start in range(0, len(mine), batch_examples):
        yield mine[start : start + batch_examples]


@torch.no_grad()
def score(
    model: nn.Module,
    examples: list[Encoded],
    device: torch.device,
    *,
    rank: int = 0,
    world_size: int = 1,
    batch_examples: int = 8,
    length: int,
    amp: bool = False,
) -> Tally:
    """This rank's share of examples scored by model (a Transformer, or one wrapped by DDP or
    sharded by FSDP), for the caller to sum over the ranks. length is every batch's row length, at
    least the longest row; amp runs the forward pass in bfloat16 autocast, as training does. model
    is left in the mode it was in."""
    was_training = model.training
    model.eval()
    tally = Tally()
    try:
        for batch in shares(len(examples), rank, world_size, batch_examples):
            chosen = [examples[i if i is not None else 0] for i in batch]
            tokens, scored = pack(chosen, length)
            tokens, scored = tokens.to(device), scored.to(device)
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=amp):
                losses = model(tokens, head=TokenLosses(tokens)).out  # (rows, length - 1)
            endings = len(chosen[0].rows)
            sums = (losses * scored).sum(dim=1).view(len(chosen), endings).tolist()
            counts = scored.sum(dim=1).view(len(chosen), endings).tolist()
            for i, example, example_sums, example_counts in zip(batch, chosen, sums, counts, strict=True):
                if i is None:
                    continue
                by_sum, by_mean = choose(example_sums, example_counts)
                tally += Tally(1, int(by_sum == example.label), int(by_mean == example.label))
    finally:
        model.train(was_training)
    return tally
