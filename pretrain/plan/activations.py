"""What a training step keeps for its backward pass, per token, from the config alone: the
activations of pretrain/plan/gpu_memory.py's estimate. Torch-free, like the whole plan.

Each count is of the model as pretrain/model/ builds it: the residual stream in the compute dtype
(bf16 under autocast; RMSNorm keeps its input and an fp32 reciprocal RMS per token), one fused
matmul for queries, keys and values (wqkv) and one for SwiGLU's gate and up projections (w13), so
a norm's output is kept once, as the input of the one matmul that reads it. Eager, autograd keeps
what each op's backward reads (checked against autograd's saved tensors: tests/pretrain/plan/test_memory.py).

Compiled (training.compile, the blocks and the loss head under torch.compile: inductor), the
partitioner that splits each compiled region into its forward and backward graphs keeps the
outputs of the matmuls and the attention kernel and recomputes the cheap element-wise ops from
them in the backward pass, where eager autograd keeps every intermediate those ops' backwards
read. What it kept for one block, read off the forward graph's saved outputs (CPU, torch 2.13,
min-cut partitioner with inductor's rules): the block's input, both norms' outputs (the matmuls'
inputs: recomputing a norm would read its input again, no cheaper than keeping the output), the
rotated q and k and v (attention's inputs), attention's output twice (as the kernel returns it,
heads first, and as wo's input), wo's output (the residual sum is recomputed from it), w13's
output and the gated product (w2's input); silu's output and the rotation are recomputed. And in
the loss head one copy of the logits in the compute dtype, not three fp32 ones: the fp32 upcast
and the log-softmax are fused, and the backward is one element-wise kernel that writes the gradient
in the compute dtype (measured on CPU: the compiled head's forward and backward grow the peak by
1.01 bf16 copies of the logits; tests/pretrain/model/test_loss.py). The H200's figures (benchmarks/results/
2026-11-25-h200.md: compiled `small` allocated 8.7 GiB at its peak, 19.3 without compile) are the
only GPU measurement there is, and they were taken before issue 38 (fp32 residual stream, separate
projections, torch's cross-entropy): the tests hold the estimate to them; the GPU acceptance's
"memory estimate vs measured" rows measure the model as it is now.
"""

from __future__ import annotations

import dataclasses
import math

from pretrain import config as cfg
from pretrain import registry
from pretrain.config import Config, ModelConfig
from pretrain.plan.compile_prerequisites import compile_requested

FP32 = 4
BF16 = 2
LOGIT_COPIES = 3
"""fp32 tensors of one loss chunk's size at the peak of its backward, eager: the recomputed logits,
the log-probabilities cross_entropy keeps, and their gradient. benchmarks/train.py measured 2.95 GiB
for 2048 tokens x 128,256 ids, where two copies would be 1.96."""
COMPILED_LOGIT_COPIES = 1
"""Tensors of one loss chunk's logits, in the compute dtype, at the peak of a compiled head's
backward: the logits; the element-wise backward writes their gradient as it reads them (the module
docstring)."""


def require_vocab(model: ModelConfig) -> int:
    if model.vocab_size is None:
        raise ValueError("model.vocab_size is null: count parameters once the dataset has fixed it (fit_to_dataset)")
    return model.vocab_size


def compiled(config: Config) -> bool:
    """Whether the run the estimate is for compiles its blocks and loss head: training.compile, on
    a GPU (null compiles there), never under debug.trace_nonfinite. A machine without
    torch.compile's compiler gets compile turned off in its config before the plan (launcher/prepare.py)."""
    return compile_requested(config, "cuda")


def compute_bytes(config: Config) -> int:
    """Bytes of a value in the compute dtype: bf16 under training.use_amp, else fp32."""
    return BF16 if config.training.use_amp else FP32


def eager_bytes_per_token(model: ModelConfig, compute: int) -> int:
    """What one block keeps per token for its backward pass, eager (flash attention: nothing of T x T).

    In the compute dtype: the residual stream twice, the block's input and its sum after attention
    (each the input of an RMSNorm, dim each); each norm's output, the input of the one matmul that
    reads it (wqkv, w13: 2 dim); attention's q and k after the rotation (dim + kv_dim) and v, a view
    of wqkv's output that keeps all of it (dim + 2 kv_dim), or in fp32, where k and v are repeated to
    every query head for the memory-efficient kernel (pretrain/model/transformer.py), q, k and v as
    that kernel reads them (3 dim); attention's output, which wo reads through a view (dim); and what
    the feed-forward block keeps (pretrain/registry.py; SwiGLU: w13's output, silu's output and the
    gated product: 4 ffn_dim). In fp32: the norms' reciprocal RMS (2) and attention's logsumexp (one
    per head). The rotation keeps nothing: its tables are constants.
    """
    d, kv = model.dim, model.n_kv_heads * (model.dim // model.n_heads)
    ffn = registry.FEED_FORWARDS[model.feed_forward].saved_per_token(as_routed(model, compute))
    attention = 3 * d if compute == FP32 else (d + 2 * kv) + (d + kv)
    return compute * (2 * d + 2 * d + attention + d + ffn) + FP32 * (2 + model.n_heads)


def compiled_bytes_per_token(model: ModelConfig, compute: int) -> int:
    """What one compiled block keeps per token (the module docstring says why these).

    In the compute dtype: the block's input (dim), both norms' outputs (2 dim), attention's inputs,
    q, k and v (dim + 2 kv_dim; in fp32 k and v repeated to every head: 3 dim), its output twice
    (2 dim), wo's output (dim) and the feed-forward block's compiled count (pretrain/registry.py,
    saved_per_token_compiled; SwiGLU: w13's output and the gated product, 3 ffn_dim). In fp32: the
    norms' reciprocal RMS (2) and attention's logsumexp (one per head). Never more than eager keeps.
    """
    d, kv = model.dim, model.n_kv_heads * (model.dim // model.n_heads)
    kind = registry.FEED_FORWARDS[model.feed_forward]
    ffn = (kind.saved_per_token_compiled or kind.saved_per_token)(as_routed(model, compute))
    attention = 3 * d if compute == FP32 else d + 2 * kv
    kept = compute * (d + 2 * d + attention + 2 * d + d + ffn) + FP32 * (2 + model.n_heads)
    return min(kept, eager_bytes_per_token(model, compute))


def block_bytes_per_token(model: ModelConfig, compute: int, is_compiled: bool) -> int:
    """Everything one block keeps per token without checkpointing, compiled or eager."""
    return compiled_bytes_per_token(model, compute) if is_compiled else eager_bytes_per_token(model, compute)


def selective_bytes_per_token(model: ModelConfig, compute: int) -> int:
    """What one block keeps per token under selective checkpointing (pretrain/distributed/parallel.py
    keeps the outputs of the matmuls and attention kernels and recomputes everything else).

    In the compute dtype: the block's input, which the checkpoint keeps (dim), and the matmuls'
    outputs, wqkv's (dim + 2 kv_dim: the fp32 path repeats k and v to every head after the matmul,
    and that is recomputed) and wo's (dim), attention's output (dim), and the feed-forward block's
    matmul outputs (selective_feed_forward_per_token; SwiGLU: w13's, 2 ffn_dim, and w2's, dim). In
    fp32: attention's logsumexp (one per head).
    """
    d, kv = model.dim, model.n_kv_heads * (model.dim // model.n_heads)
    return compute * (4 * d + 2 * kv + selective_feed_forward_per_token(model, compute)) + FP32 * model.n_heads


def selective_feed_forward_per_token(model: ModelConfig, compute: int = BF16) -> int:
    """Values the feed-forward block's matmuls return per token (what selective checkpointing keeps
    of it). SwiGLU: w13 (2 ffn_dim) and w2 (dim); a mixture of experts: its router (one per
    expert) and each expert row's SwiGLU matmuls (registry.expert_rows_per_token: top_k rows
    dropless, capacity_factor-padded with a capacity); another block: everything it keeps
    (registry.FeedForwardKind.saved_per_token), which cannot be less."""
    if model.feed_forward == "swiglu":
        return 2 * model.ffn_dim + model.dim
    routed = as_routed(model, compute)
    if model.feed_forward == "moe":
        return model.moe.num_experts + math.ceil((2 * model.ffn_dim + model.dim) * registry.expert_rows_per_token(routed))
    return registry.FEED_FORWARDS[model.feed_forward].saved_per_token(routed)


def as_routed(model: ModelConfig, compute: int) -> ModelConfig:
    """model as its mixture of experts runs at this compute dtype. Dropless runs grouped matmuls
    in bf16 with dim and ffn_dim multiples of 8, top_k rows a token, on every GPU that trains in
    bf16 (compute capability 8.0 and up) and on CPU; in fp32 (training.use_amp false), or with a
    width grouped matmuls cannot take, the fallback gives every expert a row for every token: the
    capacity routing's buffer at capacity_factor num_experts / top_k, which is what it keeps
    (pretrain/model/moe_dropless.py)."""
    moe = model.moe
    if model.feed_forward != "moe" or moe.capacity_factor is not None:
        return model
    if compute == BF16 and registry.grouped_widths_aligned(model.dim, model.ffn_dim, BF16):
        return model
    return dataclasses.replace(model, moe=dataclasses.replace(moe, capacity_factor=moe.num_experts / moe.top_k))


def kept_per_token(config: Config, mode: cfg.CheckpointingMode) -> int:
    """What one block keeps per token between its forward and its backward in each mode."""
    model, compute = config.model, compute_bytes(config)
    whole = block_bytes_per_token(model, compute, compiled(config))
    if mode == "full":
        return compute * model.dim  # its input: the residual stream
    if mode == "selective":
        return min(selective_bytes_per_token(model, compute), whole)
    return whole


def head_bytes_per_token(config: Config) -> int:
    """What the model keeps per token outside its blocks and the logits: the token ids and targets
    (int64) and the final RMSNorm's input, in the compute dtype (pretrain/model/loss.py runs the
    norm inside the loss head); in one piece also the norm's output (the output projection's
    input) and two fp32 values, the norm's reciprocal RMS and the cross-entropy's logsumexp. A
    chunked loss recomputes those in each chunk's backward."""
    compute = compute_bytes(config)
    return 2 * 8 + compute * config.model.dim + (0 if loss_chunked(config) else compute * config.model.dim + 2 * FP32)


def loss_chunked(config: Config) -> bool:
    """Whether the loss runs in more than one chunk of the micro-batch (training.loss_chunk_tokens;
    null, before the launcher's plan decides, counts as 0: one piece)."""
    chunk = cfg.loss_chunk_tokens(config)
    return 0 < chunk < config.training.batch_size * config.data.context_length


def tokens_per_micro_batch(config: Config) -> int:
    return config.training.batch_size * config.data.context_length


def activation_bytes(config: Config) -> int:
    """Autograd's saved tensors for one micro-batch (batch_size x context_length tokens).

    Each block keeps what its checkpointing mode keeps (kept_per_token: everything without
    checkpointing, compiled or eager; its matmul and attention outputs under selective; its
    input under full), and one block at a time, the one whose backward runs, holds everything
    again once recomputed. The final norm and the hidden states fed to the loss are kept in
    every mode. Before the launcher's plan makes "auto" concrete it counts as none.
    """
    model = config.model
    whole = block_bytes_per_token(model, compute_bytes(config), compiled(config))
    kept = kept_per_token(config, cfg.activation_checkpointing(config))
    return tokens_per_micro_batch(config) * (model.n_layers * kept + whole - kept + head_bytes_per_token(config))


def logits_bytes(config: Config) -> int:
    """One loss chunk's logits (the whole micro-batch's when training.loss_chunk_tokens is 0 or
    larger than it) at the peak of their backward: LOGIT_COPIES fp32 tensors eager,
    COMPILED_LOGIT_COPIES in the compute dtype compiled."""
    tokens = tokens_per_micro_batch(config)
    chunk = cfg.loss_chunk_tokens(config)
    per_token = require_vocab(config.model) * (
        compute_bytes(config) * COMPILED_LOGIT_COPIES if compiled(config) else FP32 * LOGIT_COPIES
    )
    return (min(tokens, chunk) if chunk > 0 else tokens) * per_token


def temporary_bytes(config: Config) -> int:
    """The backward's buffers for one block at a time: the gradients of what it saved."""
    whole = block_bytes_per_token(config.model, compute_bytes(config), compiled(config))
    return tokens_per_micro_batch(config) * whole
