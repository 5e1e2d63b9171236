"""Pre-tokenized shards described as a dataset: scanned once (largest id, sha256), their tokens
left where they are, and the validation tail cut off unless data.val_path names shards of its own."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from pretrain.data.encode import progress_bar
from pretrain.data.shards import Scan, Shard, scan
from pretrain.data.splits import document_ends, split_point, splits_meta, tail_split
from pretrain.data.windows import Segment

Log = Callable[[str], None]


def index_shards(train: list[Shard], val: list[Shard], val_fraction: float, log: Log) -> dict[str, Any]:
    """Scan shards once (largest id, sha256) and describe them as segments, in place."""
    shards = train + val
    progress = progress_bar("dataset: scanning shards", total=sum(s.tokens for s in shards), unit="tok")
    scans = {shard.path: scan(shard, progress.update) for shard in shards}
    progress.close()
    train_segments = [Segment(str(s.path), s.offset, s.tokens, s.dtype) for s in train]
    val_segments = [Segment(str(s.path), s.offset, s.tokens, s.dtype) for s in val]
    if not val:
        total = sum(s.tokens for s in train)
        cut = int(split_point(total, document_ends(train), val_fraction))
        train_segments, val_segments = tail_split(train_segments, total - cut)
    max_id = max(s.max_id for s in scans.values())
    if stray := stray_id(list(scans.values()), sum(s.tokens for s in shards)):
        log(stray)
    count = {"train": sum(s.tokens for s in train_segments), "val": sum(s.tokens for s in val_segments)}
    known_documents = [s.documents for s in shards]
    return {
        "tokenizer": None,
        "vocab_size": max_id + 1,
        "eot_id": None,
        "dtype": shards[0].dtype,
        "max_token_id": max_id,
        "splits": splits_meta(train_segments, val_segments),
        "tokens": count,
        "documents": {"total": sum(known_documents) if None not in known_documents else None},
        "files": {str(s.path): {"bytes": s.path.stat().st_size, "sha256": scans[s.path].sha256} for s in shards},
    }


STRAY_GAP = 0.1
"""A largest id that grows the vocabulary by more than this share of the ids below it stands apart."""


def stray_id(scans: list[Scan], tokens: int) -> str | None:
    """One line when the largest id lies far above every other (the vocabulary, which the data
    sizes, grows to fit it: one damaged id in GPT-2 data makes 60001 ids of 50257); else None."""
    top = max(s.max_id for s in scans)
    count = sum(s.max_count for s in scans if s.max_id == top)
    below = max(s.below if s.max_id == top else s.max_id for s in scans)
    if below < 0 or top - below <= STRAY_GAP * (below + 1):
        return None
    return (
        f"dataset: token id {top:,} occurs {count:,} time(s) in {tokens:,} tokens, far above every other id "
        f"(the next is {below:,}): the vocabulary grew from {below + 1:,} to {top + 1:,} ids to fit it; "
        "if it is damage, fix the data"
    )
