"""The named presets: production (the default), small and debug, each a complete Config."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from pretrain.config.schema import Config, DataConfig, DebugConfig, LoggingConfig, ModelConfig, TrainingConfig


FINEWEB_EDU: dict[str, Any] = {"source": "hub", "hub_repo": "HuggingFaceFW/fineweb-edu", "hub_files": "sample/10BT/*.parquet"}
"""The real runs' data: FineWeb-Edu's 10B-token sample, 14 Parquet files of ~2 GB (~0.7B GPT-2
tokens each), of which a run downloads only what it reads (data.hub_max_files)."""


def production() -> Config:
    """Llama-3-8B shape: 32 layers, dim 4096, 32 heads, 8 KV heads, vocab 128256, with Llama-3's
    tokenizer (from an ungated copy of the weights' repository: meta-llama's own is gated, and a
    default must work without accepting terms). Activations of 8192 tokens through 32 such layers
    take ~44 GiB eager, more than FSDP leaves of an 80 GB GPU beside three fp32 copies of the
    logits: the launcher's plan (activation checkpointing "auto") keeps only the matmul and
    attention outputs there (selective, ~26 GiB), at no extra matmul FLOPs; compiled (the default
    on GPUs) ~36 GiB and one bf16 copy of the logits fit with nothing recomputed (estimates:
    pretrain/plan/activations.py). The loss in one piece on 8 x 80 GB. One sequence per micro-batch,
    8 micro-batches: two sequences (2 x 4, half the FSDP traffic per token) fit there only with
    full checkpointing, +25% FLOPs, the dearer trade (docs/training.md)."""
    return Config(
        preset="production",
        data=DataConfig(**FINEWEB_EDU, tokenizer="huggingface", tokenizer_name="NousResearch/Meta-Llama-3-8B"),
        # Local checkpoints every 100 steps (~2.6 minutes on 8 GPUs) in /dev/shm where it has room for two
        # (~190 GB): a restart redoes at most those, not the 1000 steps between durable ones.
        training=TrainingConfig(batch_size=1, grad_accum_nums=8, local_checkpoint_interval=100),
    )


def debug() -> Config:
    """2 layers, small width, 10 steps, DEBUG logging, fp32, and hooks that name the first module
    to produce a NaN or Inf: runs in seconds on a CPU."""
    return Config(
        preset="debug",
        model=ModelConfig(
            dim=128, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=384, vocab_size=None, rope_theta=10000.0, max_seq_len=None
        ),
        data=DataConfig(source="builtin", tokenizer="byte", context_length=128),
        training=TrainingConfig(
            batch_size=8,
            grad_accum_nums=1,
            learning_rate=3e-3,
            warmup_steps=2,
            max_steps=10,
            use_amp=False,
            eval_batches=2,
            checkpoint_interval=0,
            keep_checkpoints=2,
        ),
        logging=LoggingConfig(level="DEBUG", log_interval=1),
        debug=DebugConfig(trace_nonfinite=True),
    )


def small() -> Config:
    """GPT-2 small's shape at context 1024 with GPT-2's tokenizer: 153M parameters (GPT-2's 124M
    plus an output projection of its own, 39M), a real run on one GPU."""
    return Config(
        preset="small",
        # GPT-2 has 50,257 ids; 50,304 = 64 x 786 rows (nanoGPT's choice) keeps the embedding and
        # output matmuls on multiples of 64, which GPU kernels run markedly faster. The 47 extra
        # rows are never a target, so they only learn to be unlikely.
        model=ModelConfig(
            dim=768, n_layers=12, n_heads=12, n_kv_heads=4, ffn_dim=2048, vocab_size=50304, rope_theta=10000.0, max_seq_len=1024
        ),
        data=DataConfig(**FINEWEB_EDU, tokenizer="huggingface", tokenizer_name="openai-community/gpt2", context_length=1024),
        training=TrainingConfig(
            batch_size=16,
            grad_accum_nums=4,
            learning_rate=6e-4,
            warmup_steps=200,
            max_steps=5000,
            eval_interval=250,
            local_checkpoint_interval=100,  # in /dev/shm (two of ~1.8 GB) where it has room: a restart redoes <= 100 steps
        ),
    )


PRESETS: dict[str, Callable[[], Config]] = {"debug": debug, "small": small, "production": production}
