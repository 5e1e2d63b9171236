"""Train and validation: where the tail that validates is cut off, and how meta.json records
the two splits (as segments: file, byte offset, token count, dtype)."""

from __future__ import annotations

import bisect
import dataclasses
from collections.abc import Sequence
from typing import Any

import numpy as np

from pretrain.data import DataError
from pretrain.data.shards import Shard
from pretrain.data.windows import Segment


def split_point(total: int, boundaries: Sequence[int] | np.ndarray, val_fraction: float) -> int:
    """Tokens that go to train; the rest, the tail, is validation.

    The cut is at total * (1 - val_fraction), moved to the next document boundary when that
    leaves validation at least half its share, else to the previous one when that leaves it at
    most twice its share, else kept (one long document is cut inside). boundaries: sorted
    offsets where a document ends."""
    if total < 2:
        raise DataError(f"the source has {total} token(s), too few to split into train and validation; add data")
    target = min(max(1, round(total * val_fraction)), total - 1)
    cut = total - target
    after = bisect.bisect_left(boundaries, cut)
    if after < len(boundaries) and 0 < boundaries[after] < total and total - boundaries[after] >= (target + 1) // 2:
        return int(boundaries[after])
    if after > 0 and 0 < boundaries[after - 1] and total - boundaries[after - 1] <= 2 * target:
        return int(boundaries[after - 1])
    return cut


def splits_meta(train: list[Segment], val: list[Segment]) -> dict[str, list[dict[str, Any]]]:
    """The "splits" of meta.json, in the form windows.segments reads back."""
    return {"train": [dataclasses.asdict(s) for s in train], "val": [dataclasses.asdict(s) for s in val]}


def document_ends(shards: list[Shard]) -> Sequence[int] | np.ndarray:
    """Where documents end in the shards' joined tokens, when their index says (Megatron); else
    none, and the validation cut is at the exact share (an llm.c shard records no documents, and
    its end is no document's end: llm.c cuts shards mid-document)."""
    if not shards or any(shard.document_ends is None for shard in shards):
        return []
    starts = np.cumsum([0] + [shard.tokens for shard in shards[:-1]])
    return np.concatenate([shard.document_ends + start for shard, start in zip(shards, starts, strict=True)])


def tail_split(segments: list[Segment], val_tokens: int) -> tuple[list[Segment], list[Segment]]:
    """Cut the last val_tokens tokens off a list of segments: (train segments, val segments)."""
    train, val = list(segments), list[Segment]()
    while val_tokens > 0:
        last = train.pop()
        if last.tokens <= val_tokens:
            val.insert(0, last)
            val_tokens -= last.tokens
            continue
        kept = dataclasses.replace(last, tokens=last.tokens - val_tokens)
        train.append(kept)
        val.insert(0, dataclasses.replace(last, offset=last.offset + kept.nbytes, tokens=val_tokens))
        val_tokens = 0
    return train, val
