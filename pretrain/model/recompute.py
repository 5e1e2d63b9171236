"""What recomputation costs: the FLOPs that activation checkpointing and the chunked loss add to
a training step, per token and as a share of the model FLOPs the step line's MFU counts
(pretrain/observe/metrics.py). The launcher's plan (pretrain/plan/parallelism.py) orders its choices by them
and its `parallelism:` line prints them. Torch-free: the launcher imports it.

Counted as torch's FlopCounterMode counts (matmuls and attention; benchmarks/efficiency.py
measures what a step executes that way), with the model's own convention (metrics.flops_per_token:
a causal attention counted in full):

    full        one more forward of every block, less a dense feed-forward block's output matmul
                (SwiGLU's w2): nothing in the backward needs its output, and non-reentrant
                checkpointing stops recomputing once it has what the backward needs (so does
                torch.compile's partitioner). A mixture of experts' w2 runs again: its output,
                times the router's weight, is what that weight's gradient needs. About a quarter
                to a third more FLOPs.
    selective   nothing counted: the matmul and attention outputs are kept, and only the
                element-wise ops between them (norms, rotary, silu, products) run again; they
                cost memory bandwidth, not tensor-core FLOPs.
    chunked loss  the output projection's forward once more (2 x dim x vocab per token): each
                chunk's logits are recomputed in the backward pass.
"""

from __future__ import annotations

import dataclasses

from pretrain import config as cfg
from pretrain.config import Config, ModelConfig
from pretrain.plan.gpu_memory import loss_chunked
from pretrain.observe.metrics import flops_per_token


def model_flops_per_token(config: Config) -> float:
    """The step line's model FLOPs per token (forward and backward, nothing recomputed)."""
    return flops_per_token(config.model, config.data.context_length)


def block_forward_flops_per_token(model: ModelConfig, seq_len: int) -> float:
    """One block's forward: a third of what one more layer adds to flops_per_token."""
    one, two = (flops_per_token(dataclasses.replace(model, n_layers=n), seq_len) for n in (1, 2))
    return (two - one) / 3


def ffn_output_matmul_flops_per_token(model: ModelConfig) -> float:
    """The feed-forward block's last matmul, which full checkpointing does not recompute: a dense
    block's w2 (ffn_dim -> dim). A mixture of experts has none: each expert's w2 output is scaled
    by its router weight, whose gradient needs that output, so the backward recomputes it."""
    return 0.0 if model.moe.num_experts > 0 else 2.0 * model.ffn_dim * model.dim


def checkpointing_flops_per_token(config: Config) -> float:
    """What config's activation checkpointing recomputes per token, over every block."""
    if cfg.activation_checkpointing(config) != "full":
        return 0.0
    model = config.model
    per_block = block_forward_flops_per_token(model, config.data.context_length) - ffn_output_matmul_flops_per_token(model)
    return model.n_layers * per_block


def loss_flops_per_token(config: Config) -> float:
    """What a chunked loss recomputes per token: the output projection's forward."""
    if not loss_chunked(config):
        return 0.0
    return 2.0 * config.model.dim * (config.model.vocab_size or 0)


def extra_flops_share(config: Config) -> float:
    """Every recomputation's FLOPs as a share of the model FLOPs: 0.31 executes 1.31 x them."""
    return (checkpointing_flops_per_token(config) + loss_flops_per_token(config)) / model_flops_per_token(config)


def percent(share: float) -> str:
    """+0%, +1.8%, +31%: a share of the model FLOPs as the parallelism line shows it."""
    return f"+{100 * share:.0f}%" if share == 0 or share >= 0.095 else f"+{100 * share:.1f}%"
