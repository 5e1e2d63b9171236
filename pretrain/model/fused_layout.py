"""The fused projections' layout: how this model's parameter names map to Meta Llama's.

A block runs one matmul where Llama's layout has several that read the same input: attention's
queries, keys and values are one `attention.wqkv` (rows: wq's, then wk's, then wv's), and SwiGLU's
gate and up projections are one `feed_forward.w13` (rows: w1's, then w3's). One wider matmul keeps
a GPU busier than three narrow ones (wk and wv are only n_kv_heads x head_dim wide under
grouped-query attention), and the block's input is read, and saved for the backward pass, once.

Everything outside the model speaks Meta's names: the Hugging Face export writes them, --init-from
reads them, Muon orthogonalizes the parts as the separate matrices they are, and a checkpoint of
the separate layout (written before the fusion) still loads. This module is where the two meet.
MoE experts keep their own batched w1/w2/w3 parameters (no `.weight` suffix): they are not fused.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING

from pretrain.config import ModelConfig

if TYPE_CHECKING:  # torch is not imported: the launcher reaches this module (docs/design.md), and a
    from torch import Tensor  # tensor's own methods do what is needed here

FUSED_PARTS: dict[str, tuple[str, ...]] = {
    "attention.wqkv": ("attention.wq", "attention.wk", "attention.wv"),
    "feed_forward.w13": ("feed_forward.w1", "feed_forward.w3"),
}
"""Fused module (its path inside a block) -> the separate modules it stands for, in row order."""

_FUSED_NAME = re.compile(
    r"^(?P<prefix>(?:.*\.)?layers\.\d+\.)(?P<module>" + "|".join(map(re.escape, FUSED_PARTS)) + r")\.weight$"
)
_PART_NAME = re.compile(
    r"^(?P<prefix>(?:.*\.)?layers\.\d+\.)(?P<module>"
    + "|".join(re.escape(part) for parts in FUSED_PARTS.values() for part in parts)
    + r")\.weight$"
)
_FUSED_OF = {part: fused for fused, parts in FUSED_PARTS.items() for part in parts}


def part_rows(cfg: ModelConfig, fused: str) -> list[int]:
    """The rows of each part of the fused module fused ("attention.wqkv" or "feed_forward.w13"),
    in order: [wq, wk, wv] = [n_heads, n_kv_heads, n_kv_heads] x head_dim; [w1, w3] = [ffn_dim] x 2."""
    if fused == "attention.wqkv":
        head_dim = cfg.dim // cfg.n_heads
        return [cfg.n_heads * head_dim, cfg.n_kv_heads * head_dim, cfg.n_kv_heads * head_dim]
    if fused == "feed_forward.w13":
        return [cfg.ffn_dim, cfg.ffn_dim]
    raise KeyError(f"not a fused module: {fused!r} (one of {', '.join(FUSED_PARTS)})")


def fused_module(name: str) -> str | None:
    """The fused module a parameter name belongs to ("layers.3.attention.wqkv.weight" ->
    "attention.wqkv"), with any prefix before `layers.`; None for every other name."""
    match = _FUSED_NAME.match(name)
    return match["module"] if match else None


def row_splits(name: str, cfg: ModelConfig) -> list[int] | None:
    """The rows of each separate matrix inside the parameter called name, in order; None when it
    is not a fused one (then it is one matrix, or not a matrix)."""
    module = fused_module(name)
    return part_rows(cfg, module) if module is not None else None


def part_names(name: str) -> list[str] | None:
    """The separate weights' names a fused weight's name stands for, in row order
    ("layers.3.attention.wqkv.weight" -> layers.3.attention.wq.weight, ...wk.weight, ...wv.weight),
    with any prefix before `layers.`; None for every other name."""
    match = _FUSED_NAME.match(name)
    if match is None:
        return None
    return [f"{match['prefix']}{part}.weight" for part in FUSED_PARTS[match["module"]]]


def fused_modules(cfg: ModelConfig) -> tuple[str, ...]:
    """The fused modules a model of cfg has: attention's wqkv always, and w13 when its blocks'
    feed-forward is this project's SwiGLU. Another feed-forward (a registered plugin) may name its
    own weights feed_forward.w1/w2/w3, as Llama does: those are its weights, never parts to fuse."""
    return ("attention.wqkv", "feed_forward.w13") if cfg.feed_forward == "swiglu" else ("attention.wqkv",)


def _separate_part(name: str, cfg: ModelConfig) -> re.Match[str] | None:
    """name's match as a part of one of the fused modules cfg's model has, else None."""
    match = _PART_NAME.match(name)
    return match if match is not None and _FUSED_OF[match["module"]] in fused_modules(cfg) else None


def has_separate_layout(names: Iterable[str], cfg: ModelConfig) -> bool:
    """Whether names (a state dict's keys) hold Meta's separate wq/wk/wv or w1/w3 weights where a
    model of cfg has them fused (a checkpoint written before the fusion)."""
    return any(_separate_part(name, cfg) for name in names)


def split_fused(state: Mapping[str, Tensor], cfg: ModelConfig) -> dict[str, Tensor]:
    """state with every fused weight replaced by its parts under Meta's names (views of it, no
    copy), in the same place among the keys; every other entry as it is."""
    out: dict[str, Tensor] = {}
    for name, value in state.items():
        match = _FUSED_NAME.match(name)
        if match is None:
            out[name] = value
            continue
        parts = FUSED_PARTS[match["module"]]
        for part, piece in zip(parts, value.split(part_rows(cfg, match["module"]), dim=0), strict=True):
            out[f"{match['prefix']}{part}.weight"] = piece
    return out


def fuse_separate(state: Mapping[str, Tensor], cfg: ModelConfig) -> dict[str, Tensor]:
    """state with Meta's separate weights concatenated into the fused ones a model of cfg has (the
    fused name takes the place of its first part); every other entry as it is. A fused weight with a part missing
    is an error naming it."""
    out: dict[str, Tensor] = {}
    for name, value in state.items():
        match = _separate_part(name, cfg)
        if match is None:
            out[name] = value
            continue
        fused = _FUSED_OF[match["module"]]
        fused_name = f"{match['prefix']}{fused}.weight"
        if fused_name in out:
            continue  # made when its first part was met
        names = [f"{match['prefix']}{part}.weight" for part in FUSED_PARTS[fused]]
        missing = [n for n in names if n not in state]
        if missing:
            raise KeyError(f"cannot fuse {fused_name}: {', '.join(missing)} missing")
        out[fused_name] = _concatenated_rows([state[n] for n in names])
    return out


def _concatenated_rows(parts: list[Tensor]) -> Tensor:
    """torch.cat(parts, dim=0), through the tensors' own methods."""
    rows = sum(part.shape[0] for part in parts)
    out = parts[0].new_empty((rows, *parts[0].shape[1:]))
    start = 0
    for part in parts:
        out[start : start + part.shape[0]].copy_(part)
        start += part.shape[0]
    return out
