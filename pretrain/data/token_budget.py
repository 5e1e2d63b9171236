"""The token budget: how many tokens a run reads, and how many of a Hub dataset's text files hold
them, estimated from the files' sizes (hub.py's choose_hub_files; pre-tokenized shards hold an
exact count, hub_shards.py).

Torch-free, like everything the launcher imports.
"""

from __future__ import annotations

from pretrain import registry
from pretrain.config import Config, batch_split
from pretrain.data.formats import file_format

GZIP_TOKENS_PER_BYTE = 0.3
"""Tokens per byte of a gzipped file, as Parquet's (compressed text; gzip packs more). Each format's
own figure is in pretrain/registry.py (TEXT_FORMATS), low on purpose (a low value fetches more
files, never too few), to estimate how many files a run reads. Parquet: FineWeb-Edu's
sample/10BT holds 10B GPT-2 tokens in 28.5 GB (0.35), and Llama-3's larger vocabulary makes ~15%
fewer tokens of the same text. Plain text and JSON Lines: English is ~4 bytes per token."""
MARGIN = 1.1
"""The estimate of the tokens needed is raised by this much before counting files."""


def run_tokens(config: Config, world_size: int) -> int | None:
    """Tokens the run reads (steps x batch x context x accumulation x ranks); None when it is set
    in epochs (it reads everything prepared, however much)."""
    t = config.training
    if t.epochs > 0:
        return None
    batch, accum = batch_split(config, world_size)  # grad_accum_nums "auto": any split, the same global batch
    return t.max_steps * batch * config.data.context_length * accum * world_size


def estimated_tokens(name: str, size: int) -> float:
    if name.endswith(".gz"):
        return size * GZIP_TOKENS_PER_BYTE
    return size * registry.TEXT_FORMATS[file_format(name) or "text"].tokens_per_byte


def files_for_tokens(files: list[tuple[str, int]], tokens: int, val_fraction: float) -> int:
    """How many of files (in order) hold the tokens a run reads, its validation share and MARGIN
    (all of them when even that is too few)."""
    wanted = tokens / (1 - val_fraction) * MARGIN
    held = 0.0
    for count, (name, size) in enumerate(files, 1):
        held += estimated_tokens(name, size)
        if held >= wanted:
            return count
    return len(files)
