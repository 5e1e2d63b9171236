"""Checkpoints of the separate layout: written before a block fused its projections, they hold
Meta's separate `attention.wq/wk/wv` and `feed_forward.w1/w3` weights where the model now has
`attention.wqkv` and `feed_forward.w13` (pretrain/model/fused_layout.py). They still load: the
weights are concatenated in row order, and so is the optimizer's state of each part (AdamW's
moments, Muon's momentum: one row per weight row, so the fused weight's state is the parts'
stacked, exactly what it would have been had the weight been fused from the start; the step
count, the same for every part, is kept once). A state that cannot be combined that way (parts
that disagree, a shape that is not the weight's) is reset: that weight's optimizer starts afresh,
and the note restore() prints says so.

Both checkpoint formats: full state dicts (model.pt, optimizer.pt; the dicts are converted before
they load) and sharded DCP ones (the fused entries are left out of the DCP load, and each rank
reads their parts whole, one tensor at a time, and keeps its own rows of the concatenation).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import Tensor
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata
from torch.distributed.tensor import DTensor, Replicate

from pretrain.checkpoint.dcp_files import dcp_load
from pretrain.config import ModelConfig
from pretrain.model import shards
from pretrain.model.fused_layout import has_separate_layout, part_names, row_splits

__all__ = [
    "fuse_optimizer_state",
    "has_separate_layout",
    "load_fused_from_parts",
    "note",
    "separate_order",
    "separate_shapes",
    "shapes_as_saved",
]


def note(path: Path, reset: list[str]) -> str:
    """The one line restore() logs after converting checkpoint path (reset: the fused weights whose
    optimizer state could not be converted)."""
    line = (
        f"Checkpoint {path} has the separate wq/wk/wv and w1/w3 weights of the layout before the fused "
        "projections; converted them to wqkv and w13, "
    )
    if not reset:
        return line + "their optimizer state too"
    more = f" and {len(reset) - 1} more" if len(reset) > 1 else ""
    return line + f"but the optimizer state of {reset[0]}{more} could not be combined and starts afresh"


def separate_shapes(shapes: Mapping[str, tuple[int, ...]], cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """The model's shapes (fused names) as a checkpoint of the separate layout holds them."""
    out: dict[str, tuple[int, ...]] = {}
    for name, shape in shapes.items():
        parts, rows = part_names(name), row_splits(name, cfg)
        if parts is None or rows is None:
            out[name] = shape
            continue
        out |= {part: (part_rows, *shape[1:]) for part, part_rows in zip(parts, rows, strict=True)}
    return out


MOVED_AFTER = {"feed_forward.w3.weight": "feed_forward.w2.weight"}
"""Parts that the separate layout's module registered after another weight of the same block:
SwiGLU registered w1, w2, w3, so w3 came after w2, not next to w1 as in w13's rows."""


def shapes_as_saved(
    expected: Mapping[str, tuple[int, ...]], saved: Iterable[str], cfg: ModelConfig
) -> dict[str, tuple[int, ...]]:
    """The shapes (fused names) a checkpoint whose tensors are called saved should hold: under the
    separate layout's names and shapes when it was written before the fusion, else expected itself."""
    return separate_shapes(expected, cfg) if has_separate_layout(saved, cfg) else dict(expected)


def separate_order(order: list[str]) -> list[str]:
    """The optimizer's parameter names (fused) in the order the separate layout's optimizer had
    them (a format-1 checkpoint numbers its state by it): each fused weight's parts where it is
    (the same group, the same place among the others), and a part the old module registered later
    (MOVED_AFTER: SwiGLU's w3, after w2) moved there when that weight is in the same list."""
    expanded = [part for name in order for part in (part_names(name) or [name])]
    for part_suffix, after_suffix in MOVED_AFTER.items():
        for part in [name for name in expanded if name.endswith(part_suffix)]:
            after = part[: -len(part_suffix)] + after_suffix
            if after in expanded:
                expanded.remove(part)
                expanded.insert(expanded.index(after) + 1, part)
    return expanded


def fuse_optimizer_state(state: Mapping[str, Any], names: Iterable[str], cfg: ModelConfig) -> tuple[dict[str, Any], list[str]]:
    """Per-parameter optimizer state keyed by the separate layout's names -> keyed by the model's
    (names: its parameter names), and the fused weights whose state could not be combined (left
    out, so they start afresh). Every other entry as it is."""
    out = dict(state)
    reset = []
    for name in names:
        parts, rows = part_names(name), row_splits(name, cfg)
        if parts is None or rows is None:
            continue
        states = [out.pop(part, None) for part in parts]
        if all(value is None for value in states):
            continue  # no state yet (saved before the first step)
        combined = _combine(states, rows)
        if combined is None:
            reset.append(name)
        else:
            out[name] = combined
    return out, reset


def _combine(states: list[Any], rows: list[int]) -> dict[str, Any] | None:
    """The parts' states (dicts of the same keys) as one: row-wise tensors concatenated, values
    every part shares kept once; None when anything else is met."""
    if any(not isinstance(state, dict) for state in states) or any(state.keys() != states[0].keys() for state in states):
        return None
    combined = {}
    for key in states[0]:
        value = _combine_values([state[key] for state in states], rows)
        if value is None:
            return None
        combined[key] = value
    return combined


def _combine_values(values: list[Any], rows: list[int]) -> Any:
    if not all(isinstance(value, Tensor) for value in values):
        return values[0] if all(value == values[0] for value in values) else None
    first = values[0]
    if all(v.dim() >= 1 and v.shape[0] == n and v.shape[1:] == first.shape[1:] for v, n in zip(values, rows, strict=True)):
        return torch.cat(values, dim=0)  # one row per weight row
    if all(v.shape == first.shape and v.numel() == 1 and torch.equal(v, first) for v in values):
        return first  # the step count
    return None


# --- sharded (DCP) ------------------------------------------------------------------------


def load_fused_from_parts(dest: Tensor, part_keys: list[str], rows: list[int], path: Path, metadata: Metadata) -> bool:
    """Fill dest (a fused weight, or a per-row state of one, or a scalar state such as the step;
    its shard when a DTensor) from its parts' DCP entries part_keys, each read whole in this
    process alone. False (dest untouched) when a part is missing or they do not combine."""
    entries = metadata.state_dict_metadata
    if not all(isinstance(entries.get(key), TensorStorageMetadata) for key in part_keys):
        return False
    values = []
    for key in part_keys:
        item = entries[key]
        assert isinstance(item, TensorStorageMetadata)
        request = {key: torch.empty(item.size, dtype=item.properties.dtype)}
        dcp_load(request, path, alone=True)
        values.append(request[key])
    full = _combine_values(values, rows)
    if full is None or tuple(full.shape) != tuple(dest.shape):
        return False
    local = dest.to_local() if isinstance(dest, DTensor) else dest
    mine = _shard_rows(full, dest)
    if mine is None or mine.shape != local.shape:
        return False
    with torch.no_grad():
        local.copy_(mine)
    return True


def _shard_rows(full: Tensor, dest: Tensor) -> Tensor | None:
    """This rank's part of full as FSDP2 places dest (Shard(0) over one mesh dimension, Replicate over
    any other, as HSDP; split as torch.chunk does); full itself for a plain tensor or a replicated one."""
    if not isinstance(dest, DTensor) or all(isinstance(p, Replicate) for p in dest.placements):
        return full
    if shards.row_mesh_dim(dest) is None:
        return None
    return shards.rows_of(full, dest)


def has_separate_entries(metadata: Metadata, cfg: ModelConfig) -> bool:
    """Whether a DCP checkpoint's model holds the separate layout's weights where a model of cfg has them fused."""
    names = [key.removeprefix("model.") for key in metadata.state_dict_metadata if key.startswith("model.")]
    return has_separate_layout(names, cfg)
