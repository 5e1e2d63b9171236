"""The trainer's extension points: the names a config may choose, and where each one's code is.

    training.optimizer      OPTIMIZERS      builds the optimizer; tells the memory estimate its state size
    training.muon_orthogonalize  ORTHOGONALIZERS  how Muon orthogonalizes an update
    training.lr_schedule    LR_SCHEDULES    the learning rate at each step
    model.ffn               FEED_FORWARDS   the feed-forward block of every layer; its size for the estimate
    data.source             TEXT_FORMATS    a format of local text files (and of a Hub dataset's files)
    data.tokenizer          TOKENIZERS      text to token ids; its identity for the dataset cache

Adding one is a new file with the code and one line here (docs/extending.md). Nothing here
imports torch, because the launcher validates configs and plans memory without it: an
implementation is named as "module:attribute" and imported when a training process builds it.
Nor does it import the config, which validates its names against these tables.
"""

from __future__ import annotations

import functools
import importlib
import math
from collections.abc import Callable
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
    ((B, T, dim), {name: weighted auxiliary loss}) when it has losses of its own. Its method
    residual_outputs() returns the nn.Linear layers that write into the residual stream (the
    model initialises them scaled down with depth)."""
    parameters: Callable[[Any], int]
    """(ModelConfig) -> its parameter count in one layer (the memory estimate, the model's size line)."""
    saved_per_token: Callable[[Any], int]
    """(ModelConfig) -> values in the compute dtype it keeps per token for its backward pass (the memory estimate)."""
    saved_per_token_compiled: Callable[[Any], int] | None = None
    """(ModelConfig) -> the same under torch.compile, whose partitioner recomputes cheap element-wise
    ops in the backward pass instead of keeping their outputs; None: as many as eager."""
    active_parameters: Callable[[Any], int] | None = None
    """(ModelConfig) -> the parameters one token runs through in one layer (a mixture of experts:
    its router and top_k experts), for FLOPs and MFU; None: all of them."""
    llama_layout: bool = False
    """Its parameters are Meta Llama's feed_forward.{w1,w2,w3} (SwiGLU's w1 and w3 fused as w13:
    pretrain/model/fused_layout.py): an export says it is Llama-shaped."""


def expert_rows_per_token(model: Any) -> float:
    """The rows a mixture of experts' experts run per token in training (ModelConfig -> rows):
    top_k exactly when dropless (model.moe.capacity_factor null: however unevenly they fall on the
    experts, the grouped matmuls' rows add up to top_k x tokens, with no padding), top_k x
    capacity_factor with a capacity (every expert's buffer has its capacity's rows, used or not)."""
    factor = model.moe.capacity_factor
    return model.moe.top_k * (1.0 if factor is None else factor)


GROUPED_MM_SYNC_FREE_CUDA_MAJORS = (9, 10)
"""NVIDIA compute capabilities whose bf16 grouped matmul reads the expert offsets on the device
(CUTLASS: Hopper, Blackwell); elsewhere (8.x, 12.x, ROCm) torch copies them to the host per call."""
GROUPED_MM_STRIDE_BYTES = 16
"""What a grouped matmul's operands' leading strides must be a multiple of (torch's _grouped_mm)."""


def grouped_widths_aligned(dim: int, ffn_dim: int, itemsize: int) -> bool:
    """Whether dropless experts' grouped matmuls can take dim- and ffn_dim-wide rows of itemsize
    bytes (multiples of 8 in bf16); else they run the every-token buffer (pretrain/model/moe_dropless.py)."""
    return itemsize > 0 and all(width * itemsize % GROUPED_MM_STRIDE_BYTES == 0 for width in (dim, ffn_dim))


OPTIMIZERS: dict[str, OptimizerKind] = {
    "adamw": OptimizerKind("pretrain.optim.optimizers:build_adamw", state_bytes_per_param=8),
    # Muon keeps one fp32 momentum per matrix entry, AdamW two moments for the rest: 8 bounds both.
    "muon": OptimizerKind("pretrain.optim.muon:build_muon", state_bytes_per_param=8),
}

ORTHOGONALIZERS: dict[str, str] = {
    # (update (..., m, n), steps) -> the update with its singular values near 1 (training.muon_orthogonalize)
    "newton_schulz": "pretrain.optim.muon:newton_schulz",
    "svd": "pretrain.optim.muon:svd_orthogonalize",
}

LR_SCHEDULES: dict[str, str] = {
    "cosine": "pretrain.optim.schedule:warmup_cosine",  # (step, TrainingConfig) -> learning rate
}

FEED_FORWARDS: dict[str, FeedForwardKind] = {
    # SwiGLU: w1, w3 (dim -> ffn_dim, one fused w13 matmul) and w2 (ffn_dim -> dim); it keeps
    # w13's output (w1's and w3's), silu's output and the gated product (w2's input) for the
    # backward pass. Compiled, silu's output is recomputed from w13's (inductor's partitioner
    # keeps w13's output and the product, w2's input: 3 ffn_dim).
    "swiglu": FeedForwardKind(
        "pretrain.model.feed_forward:SwiGLU",
        parameters=lambda m: 3 * m.dim * m.ffn_dim,
        saved_per_token=lambda m: 4 * m.ffn_dim,
        saved_per_token_compiled=lambda m: 3 * m.ffn_dim,
        llama_layout=True,
    ),
    # model.moe.num_experts > 0 chooses it (ModelConfig.feed_forward): a router (dim x E) and E
    # SwiGLU experts; a token runs through top_k of them. It keeps the router's fp32 probabilities
    # (2 E), per expert row (expert_rows_per_token) the row (dim) and SwiGLU's four values (4
    # ffn_dim), and per assignment the expert's output twice, as it is weighted and summed (2 dim),
    # and its routing: three int64 indices and an fp32 weight (16; checked against autograd's
    # saved tensors: tests/pretrain/plan/test_activations.py).
    "moe": FeedForwardKind(
        "pretrain.model.moe:MixtureOfExperts",
        parameters=lambda m: m.dim * m.moe.num_experts + 3 * m.moe.num_experts * m.dim * m.ffn_dim,
        saved_per_token=lambda m: (
            2 * m.moe.num_experts + math.ceil(expert_rows_per_token(m) * (4 * m.ffn_dim + m.dim)) + m.moe.top_k * (2 * m.dim + 16)
        ),
        active_parameters=lambda m: m.dim * m.moe.num_experts + 3 * m.moe.top_k * m.dim * m.ffn_dim,
    ),
}


@dataclass(frozen=True)
class TextFormat:
    reader: str
    """"module:function" taking (path, text_field) and yielding the file's pieces of text
    (pretrain.data.sources.Piece), each saying whether a document ends with it."""
    suffixes: tuple[str, ...]
    """The file names it reads: a directory given as data.path contributes these, and a Hub
    dataset's files are read by the first format whose suffix they have."""
    tokens_per_byte: float = 0.25
    """Tokens per byte of file, low on purpose: how many of a Hub dataset's files a run reads is
    estimated from their sizes (pretrain/data/token_budget.py). English text is ~4 bytes per token."""


@dataclass(frozen=True)
class TokenizerKind:
    recipe: str
    """"module:class" of a tokenizer recipe (pretrain/data/tokenizer.py, TokenizerRecipe): its
    identity for the dataset cache, its name in the cache directory's name, and building it."""
    takes_name: bool = False
    """data.tokenizer_name names it (a file, a Hub repository, an encoding) and must be set."""
    file: bool = False
    """It is a file (its tokenizer's .path, or BPE's trained one) that is copied into the prepared
    dataset and exported with the weights; the recipe's build() takes it where it was found."""


TEXT_FORMATS: dict[str, TextFormat] = {
    "text": TextFormat("pretrain.data.sources:text_pieces", (".txt", ".txt.gz", ".md", ".text")),
    "jsonl": TextFormat("pretrain.data.sources:jsonl_pieces", (".jsonl", ".jsonl.gz", ".json", ".json.gz")),
    "parquet": TextFormat("pretrain.data.sources:parquet_pieces", (".parquet",), tokens_per_byte=0.3),  # compressed
}

TOKENIZERS: dict[str, TokenizerKind] = {
    "byte": TokenizerKind("pretrain.data.tokenizer:ByteRecipe"),
    "bpe": TokenizerKind("pretrain.data.tokenizer:BpeRecipe", file=True),  # trained by pretrain/data/prepare.py
    "huggingface": TokenizerKind("pretrain.data.tokenizer:HuggingFaceRecipe", takes_name=True, file=True),
    "tiktoken": TokenizerKind("pretrain.data.tokenizer:TiktokenRecipe", takes_name=True),
}


@functools.cache
def load(path: str) -> Any:
    """The object a "module:attribute" path names (looked up once: the schedule asks every step)."""
    module, _, attribute = path.partition(":")
    return getattr(importlib.import_module(module), attribute)
