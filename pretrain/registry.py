"""The trainer's extension points: the names a config may choose, and where each one's code is.

    training.optimizer      OPTIMIZERS      builds the optimizer; tells the memory estimate its state size
    training.lr_schedule    LR_SCHEDULES    the learning rate at each step
    model.ffn               FEED_FORWARDS   the feed-forward block of every layer; its size for the estimate

Adding one is a new file with the code and one line here (docs/extending.md). Nothing here
imports torch, because the launcher validates configs and plans memory without it: an
implementation is named as "module:attribute" and imported when a training process builds it.
Nor does it import the config, which validates its names against these tables.
"""

from __future__ import annotations

import difflib
import importlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class OptimizerKind:
    build: str
    """"module:function" taking (model, TrainingConfig, torch.device) and returning a torch.optim.Optimizer."""
    state_bytes_per_param: int
    """Bytes of optimizer state per parameter, for the memory estimate (AdamW: two fp32 moments, 8)."""


@dataclass(frozen=True)
class FeedForwardKind:
    module: str
    """"module:class" built from the ModelConfig; maps (B, T, dim) to (B, T, dim), or to
    ((B, T, dim), {name: weighted auxiliary loss}) when it has losses of its own."""
    parameters: Callable[[Any], int]
    """(ModelConfig) -> its parameter count in one layer (the memory estimate, FLOPs, the model's size line)."""
    saved_per_token: Callable[[Any], int]
    """(ModelConfig) -> values in the compute dtype it keeps per token for its backward pass (the memory estimate)."""
    llama_layout: bool = False
    """Its parameters are Meta Llama's feed_forward.{w1,w2,w3}: an export says it is Llama-shaped."""


OPTIMIZERS: dict[str, OptimizerKind] = {
    "adamw": OptimizerKind("pretrain.optim:build_adamw", state_bytes_per_param=8),
}

LR_SCHEDULES: dict[str, str] = {
    "cosine": "pretrain.schedule:warmup_cosine",  # (step, TrainingConfig) -> learning rate
}

FEED_FORWARDS: dict[str, FeedForwardKind] = {
    # SwiGLU: w1, w3 (dim -> ffn_dim) and w2 (ffn_dim -> dim); it keeps w1's and w3's outputs,
    # silu's output and the gated product (w2's input) for the backward pass.
    "swiglu": FeedForwardKind(
        "pretrain.feed_forward:SwiGLU",
        parameters=lambda m: 3 * m.dim * m.ffn_dim,
        saved_per_token=lambda m: 4 * m.ffn_dim,
        llama_layout=True,
    ),
}


def unknown_name(name: str, choices: Mapping[str, object]) -> str:
    """Why name is not one of choices, with the closest one when it looks like a typo."""
    close = difflib.get_close_matches(name, list(choices), n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    return f"unknown name {name!r}{hint}; choose one of {', '.join(sorted(choices))}"


def load(path: str) -> Any:
    """The object a "module:attribute" path names."""
    module, _, attribute = path.partition(":")
    return getattr(importlib.import_module(module), attribute)
