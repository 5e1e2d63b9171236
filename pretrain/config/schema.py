"""The config's shape: one frozen dataclass per section, each field's type, default and docstring,
and the checks a section makes on its own values (ConfigError, one line naming the key).

docs/config.md is generated from these classes and the docstring under each field
(python -m pretrain.config_reference). Nothing here imports torch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import ClassVar, Literal, get_type_hints

from pretrain import registry
from pretrain.config.checks import (
    MAX_COUNT,
    MAX_LENGTH,
    MAX_SIZE,
    MAX_STEPS,
    ConfigError,
    check as _check,
    check_at_most as _check_at_most,
    describe,
    not_one_of,
)
from pretrain.config.training import (
    CHECKPOINTING_CHOICES,
    CHECKPOINTING_MODES,
    SHARDED_MODES,
    COMPILE_MODES,
    CheckpointingMode,
    CompileMode,
    TrainingConfig,
)

__all__ = [  # the names other modules import from here, the checks' and training's included
    "MAX_COUNT",
    "MAX_LENGTH",
    "MAX_SIZE",
    "MAX_STEPS",
    "ConfigError",
    "describe",
    "not_one_of",
    "CHECKPOINTING_CHOICES",
    "CHECKPOINTING_MODES",
    "SHARDED_MODES",
    "CheckpointingMode",
    "COMPILE_MODES",
    "CompileMode",
    "TrainingConfig",
    "MoEConfig",
    "RopeScalingConfig",
    "ModelConfig",
    "SHARD_SOURCES",
    "sources_with_path",
    "sources",
    "DataConfig",
    "SystemConfig",
    "LoggingConfig",
    "EvaluationConfig",
    "DebugConfig",
    "Config",
    "SECTIONS",
]


@dataclass(frozen=True)
class MoEConfig:
    num_experts: int = 0
    """Experts per layer; 0 keeps the dense feed-forward block (model.ffn). Above 0, every layer's feed-forward block is a mixture of that many SwiGLU experts of width model.ffn_dim."""
    top_k: int = 2
    """Experts each token is routed to (token-choice top-k); their outputs are summed, weighted by the router's renormalised probabilities."""
    capacity_factor: float | None = None
    """null: dropless, every token reaches its top_k experts (sorted by expert, grouped matmuls; MegaBlocks' dropless MoE). A number: capacity routing, each expert takes at most capacity_factor x tokens x top_k / num_experts tokens per batch in training and the tokens over it skip that expert (the residual carries them; the step line counts them as Dropped)."""
    aux_loss_weight: float = 0.01
    """Weight of the load-balancing loss (num_experts x sum of each expert's token share x its mean router probability; 1 when balanced) added to the training loss."""

    AT_MOST: ClassVar[dict[str, int]] = {"num_experts": MAX_SIZE, "top_k": MAX_SIZE}

    def __post_init__(self) -> None:
        _check(self.num_experts >= 0, "model.moe.num_experts", f"must not be negative (got {self.num_experts})")
        _check(self.top_k >= 1, "model.moe.top_k", f"must be at least 1 (got {self.top_k})")
        _check_at_most(self, "model.moe")
        if self.num_experts > 0:
            _check(
                self.top_k <= self.num_experts,
                "model.moe.top_k",
                f"{self.top_k} is more than model.moe.num_experts ({self.num_experts}); a token cannot go to more experts than there are",
            )
        _check(
            self.capacity_factor is None or (math.isfinite(self.capacity_factor) and self.capacity_factor > 0),
            "model.moe.capacity_factor",
            f"must be a positive number, or null for dropless routing (got {self.capacity_factor})",
        )
        _check(self.aux_loss_weight >= 0, "model.moe.aux_loss_weight", f"must not be negative (got {self.aux_loss_weight})")


@dataclass(frozen=True)
class RopeScalingConfig:
    """Llama 3.1's rotary scaling (rope_type "llama3" in a Hugging Face config.json): the slow
    rotary frequencies, those whose wavelength exceeds the context the model was first trained at,
    turn factor times slower, so that positions up to factor times further apart stay apart; the
    fast ones are kept, and those between are blended. Off while factor is 1."""

    factor: float = 1.0
    """How many times slower the low rotary frequencies turn (Llama 3.1's "llama3" rope_scaling: 8 for Llama 3.1, 32 for Llama 3.2); 1 leaves the rotary embedding unscaled and the other keys unused."""
    low_freq_factor: float = 1.0
    """Frequencies whose wavelength exceeds original_max_seq_len / low_freq_factor positions are divided by factor."""
    high_freq_factor: float = 4.0
    """Frequencies whose wavelength is below original_max_seq_len / high_freq_factor positions are kept; those between the two bounds are blended. Above low_freq_factor."""
    original_max_seq_len: int = 8192
    """The context the unscaled model was trained at (original_max_position_embeddings), which sets both wavelength bounds."""

    AT_MOST: ClassVar[dict[str, int]] = {"original_max_seq_len": MAX_LENGTH}

    @property
    def scales(self) -> bool:
        """Whether the rotary embedding is scaled at all (factor 1 is the identity, whatever the other keys)."""
        return self.factor != 1.0

    def __post_init__(self) -> None:
        key = "model.rope_scaling"
        _check(
            self.factor >= 1, f"{key}.factor", f"must be at least 1 (got {self.factor}); 1 leaves the rotary embedding unscaled"
        )
        _check(self.low_freq_factor > 0, f"{key}.low_freq_factor", f"must be positive (got {self.low_freq_factor})")
        _check(
            self.high_freq_factor > self.low_freq_factor,
            f"{key}.high_freq_factor",
            f"{self.high_freq_factor} must be above {key}.low_freq_factor ({self.low_freq_factor}); Llama 3.1's are 4 and 1",
        )
        _check(
            self.original_max_seq_len >= 1, f"{key}.original_max_seq_len", f"must be at least 1 (got {self.original_max_seq_len})"
        )
        _check_at_most(self, key)


@dataclass(frozen=True)
class ModelConfig:
    dim: int = 4096
    """Width of the residual stream (embedding size)."""
    n_layers: int = 32
    """Number of transformer blocks."""
    n_heads: int = 32
    """Query heads per attention layer; dim must be divisible by it."""
    n_kv_heads: int = 8
    """Key/value heads (grouped-query attention); n_heads must be divisible by it."""
    ffn: str = "swiglu"
    """The feed-forward block of every layer, by its name in pretrain/registry.py (FEED_FORWARDS): "swiglu" (Llama's)."""
    ffn_dim: int = 14336
    """Hidden width of the feed-forward block."""
    vocab_size: int | None = 128256
    """Rows of the embedding and output projection: at least the tokenizer's vocabulary; null follows the tokenizer (set once the dataset is prepared)."""
    norm_eps: float = 1e-5
    """Epsilon of RMSNorm."""
    rope_theta: float = 500000.0
    """Base of the rotary position embedding frequencies."""
    rope_scaling: RopeScalingConfig = field(default_factory=RopeScalingConfig)
    """Llama 3.1's scaling of the rotary frequencies (a Hugging Face config.json's rope_scaling of rope_type "llama3"); off while rope_scaling.factor is 1."""
    init_std: float = 0.02
    """Standard deviation of the normal initialisation of weight matrices."""
    max_seq_len: int | None = 8192
    """Longest sequence the model is built for; data.context_length may not exceed it. null follows data.context_length."""
    moe: MoEConfig = field(default_factory=MoEConfig)
    """Mixture of experts (the MegaBlocks knobs); off while moe.num_experts is 0."""

    AT_MOST: ClassVar[dict[str, int]] = {
        "dim": MAX_SIZE,
        "n_layers": MAX_SIZE,
        "n_heads": MAX_SIZE,
        "n_kv_heads": MAX_SIZE,
        "ffn_dim": MAX_LENGTH,
        "vocab_size": MAX_LENGTH,
        "max_seq_len": MAX_LENGTH,
    }

    @property
    def feed_forward(self) -> str:
        """The block every layer has, by its name in FEED_FORWARDS: "moe" with experts, else model.ffn."""
        return "moe" if self.moe.num_experts > 0 else self.ffn

    def __post_init__(self) -> None:
        if isinstance(self.moe, dict):  # ModelConfig(**json_dict), as an export's config.json is read
            object.__setattr__(self, "moe", MoEConfig(**self.moe))
        if isinstance(self.rope_scaling, dict):
            object.__setattr__(self, "rope_scaling", RopeScalingConfig(**self.rope_scaling))
        for name in ("dim", "n_layers", "n_heads", "n_kv_heads", "ffn_dim"):
            _check(getattr(self, name) >= 1, f"model.{name}", f"must be at least 1 (got {getattr(self, name)})")
        _check_at_most(self, "model")
        _check(self.dim % self.n_heads == 0, "model.dim", f"{self.dim} is not divisible by model.n_heads ({self.n_heads})")
        _check(
            (self.dim // self.n_heads) % 2 == 0,
            "model.dim",
            f"head size {self.dim // self.n_heads} (dim / n_heads) must be even for rotary embeddings",
        )
        _check(
            self.n_heads % self.n_kv_heads == 0,
            "model.n_heads",
            f"{self.n_heads} is not divisible by model.n_kv_heads ({self.n_kv_heads})",
        )
        _check(self.ffn in registry.FEED_FORWARDS, "model.ffn", not_one_of(self.ffn, registry.FEED_FORWARDS))
        _check(self.ffn != "moe" or self.moe.num_experts > 0, "model.ffn", "moe needs model.moe.num_experts above 0")
        if self.vocab_size is not None:
            _check(self.vocab_size >= 2, "model.vocab_size", f"must be at least 2 or null (got {self.vocab_size})")
        _check(self.norm_eps > 0, "model.norm_eps", f"must be positive (got {self.norm_eps})")
        _check(self.rope_theta > 0, "model.rope_theta", f"must be positive (got {self.rope_theta})")
        _check(self.init_std > 0, "model.init_std", f"must be positive (got {self.init_std})")
        if self.max_seq_len is not None:
            _check(self.max_seq_len >= 2, "model.max_seq_len", f"must be at least 2 or null (got {self.max_seq_len})")


SHARD_SOURCES = ("llmc", "nanogpt", "megatron")


def sources_with_path() -> tuple[str, ...]:
    """The sources read from data.path: the text formats of pretrain/registry.py, and the shards."""
    return (*registry.TEXT_FORMATS, *SHARD_SOURCES)


def sources() -> tuple[str, ...]:
    """Every data.source: the built-in corpus, the text formats, the Hub, the shards."""
    return ("builtin", *registry.TEXT_FORMATS, "hub", *SHARD_SOURCES)


@dataclass(frozen=True)
class DataConfig:
    source: str = "builtin"
    """Where the text comes from: "builtin" (Python's own documentation, no network), local "text", "jsonl" or "parquet" files (or another format of TEXT_FORMATS in pretrain/registry.py), a Hugging Face "hub" dataset, or pre-tokenized "llmc" (llm.c / modded-nanogpt .bin), "nanogpt" (nanoGPT's header-less uint16 train.bin / val.bin) or "megatron" (.bin + .idx) shards, used in place."""
    path: str = ""
    """Local source: a file, a directory or a glob pattern (text, jsonl, parquet, llmc, nanogpt); for megatron the path without .bin/.idx. Relative paths are from the current directory. llmc and nanogpt also take a Hub dataset's shards, hf://datasets/OWNER/NAME[@REVISION]/PATTERN, fetched into the Hugging Face cache (only those the run reads) and read there."""
    val_path: str = ""
    """Validation files, same form as path; empty holds out the last val_fraction of the tokens instead."""
    text_field: str = "text"
    """The JSON Lines field or Parquet column that holds the text (jsonl, parquet and hub sources)."""
    hub_repo: str = ""
    """Hugging Face dataset repository id (owner/name) for source "hub"."""
    hub_revision: str = "main"
    """Branch, tag or commit of hub_repo."""
    hub_files: str = "*.parquet"
    """Glob pattern of the files of hub_repo to use (.parquet, .jsonl, .json, .txt, optionally .gz)."""
    hub_max_files: int | None = None
    """Use and download only the first N files matching hub_files (or an hf:// data.path's shards), in name order; null: as many as the run reads (estimated from the files' sizes, chosen before training and written into the run's config); 0: all."""
    max_samples: int = 0
    """Use at most this many documents of the source (data.val_path's files are not limited); 0 uses all."""
    tokenizer: str = "byte"
    """How text becomes token ids (TOKENIZERS in pretrain/registry.py): "byte" (one id per UTF-8 byte plus end-of-text, 257 ids), "bpe" (byte-level BPE trained on the source, cached), "huggingface" (a tokenizer.json file or Hub repo), "tiktoken" (an OpenAI encoding)."""
    tokenizer_name: str = ""
    """huggingface: a tokenizer.json path or a Hub model repo id; tiktoken: the encoding name (gpt2, cl100k_base, o200k_base)."""
    bpe_vocab_size: int = 8192
    """Vocabulary size of the trained "bpe" tokenizer, end-of-text included."""
    eot_token: str = ""
    """End-of-text token of a huggingface tokenizer; empty picks the first it has of `<|endoftext|>`, `<|end_of_text|>`, `</s>`, `<eos>`."""
    context_length: int = 8192
    """Tokens per training sequence; at least 2."""
    val_fraction: float = 0.05
    """Share of the tokens held out for validation when val_path is empty."""
    cache_dir: str = "cache/datasets"
    """Where prepared datasets are cached; a relative path is under the cache root (PRETRAIN_CACHE_DIR or --cache-dir, default ./cache), whose name a leading cache/ stands for."""

    AT_MOST: ClassVar[dict[str, int]] = {
        "hub_max_files": MAX_COUNT,
        "max_samples": MAX_COUNT,
        "bpe_vocab_size": MAX_LENGTH,
        "context_length": MAX_LENGTH,
    }

    def __post_init__(self) -> None:
        _check(self.source in sources(), "data.source", not_one_of(self.source, sources()))
        _check(self.tokenizer in registry.TOKENIZERS, "data.tokenizer", not_one_of(self.tokenizer, registry.TOKENIZERS))
        _check(self.context_length >= 2, "data.context_length", f"must be at least 2 (got {self.context_length})")
        _check(0 < self.val_fraction < 1, "data.val_fraction", f"must be between 0 and 1, exclusive (got {self.val_fraction})")
        _check(self.cache_dir != "", "data.cache_dir", "must not be empty")
        _check(self.max_samples >= 0, "data.max_samples", f"must not be negative (got {self.max_samples}); 0 uses all")
        _check(
            self.bpe_vocab_size >= 258,
            "data.bpe_vocab_size",
            f"must be at least 258 (256 bytes, end-of-text and one merge; got {self.bpe_vocab_size})",
        )
        if self.hub_repo:
            _check(
                self.hub_repo.count("/") == 1 and all(self.hub_repo.split("/")),
                "data.hub_repo",
                f"expected owner/name (got {self.hub_repo!r})",
            )
        _check(self.hub_files != "", "data.hub_files", "must not be empty")
        if self.hub_max_files is not None:
            _check(
                self.hub_max_files >= 0,
                "data.hub_max_files",
                f"must not be negative (got {self.hub_max_files}); 0 uses all files, null as many as the run reads",
            )
        _check_at_most(self, "data")

    def check_complete(self) -> None:
        """The keys the chosen source and tokenizer cannot work without. Checked once every
        layer is applied: a file may choose the source and a --set give its path."""
        with_path = sources_with_path()
        if self.source in with_path:
            _check(self.path != "", "data.path", f'source "{self.source}" needs data.path (a file, directory or glob)')
        if self.source == "hub":
            _check(self.hub_repo != "", "data.hub_repo", 'source "hub" needs data.hub_repo=owner/name')
        if self.source in SHARD_SOURCES:
            _check(
                self.max_samples == 0,
                "data.max_samples",
                f'applies to text sources; "{self.source}" shards are used whole (set it to 0)',
            )
        if self.source not in with_path:  # keys that would be silently ignored are mistakes
            for key in ("path", "val_path"):
                _check(
                    getattr(self, key) == "",
                    f"data.{key}",
                    f'source "{self.source}" reads no local files; set data.source to '
                    f"{', '.join(with_path[:-1])} or {with_path[-1]} to use it",
                )
        hub_shards = self.path.startswith("hf://")
        for key in ("path", "val_path"):
            _check(
                self.source in ("llmc", "nanogpt") or not getattr(self, key).startswith("hf://"),
                f"data.{key}",
                f'source "{self.source}" reads local files; hf:// paths are for llmc and nanogpt shards (a Hub dataset of text: data.source=hub)',
            )
        if self.source != "hub":
            _check(self.hub_repo == "", "data.hub_repo", f'is set but data.source is "{self.source}"; set data.source=hub')
            _check(
                self.hub_max_files is None or hub_shards,
                "data.hub_max_files",
                f'is set but data.source is "{self.source}"; set data.source=hub, or data.path to an hf:// path of shards',
            )
        named = [name for name, kind in registry.TOKENIZERS.items() if kind.takes_name]
        if self.tokenizer in named:
            what = {"huggingface": "a tokenizer.json path or Hub repo id", "tiktoken": "an encoding such as gpt2"}
            _check(
                self.tokenizer_name != "",
                "data.tokenizer_name",
                f'tokenizer "{self.tokenizer}" needs {what.get(self.tokenizer, "its name")}',
            )
        else:
            _check(
                self.tokenizer_name == "",
                "data.tokenizer_name",
                f'is set but data.tokenizer is "{self.tokenizer}"; set data.tokenizer to {" or ".join(named)}',
            )
        if self.tokenizer == "tiktoken":
            _check(
                self.tokenizer_name.replace("_", "").replace("-", "").replace(".", "").isalnum(),
                "data.tokenizer_name",
                f"{self.tokenizer_name!r} is not a tiktoken encoding name (gpt2, cl100k_base, ...)",
            )


@dataclass(frozen=True)
class SystemConfig:
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """Where to train: "cuda", "cpu", or "auto" (every free GPU, else CPU workers)."""
    device_id: int | None = None
    """Pin the run to this one physical GPU index; null lets the launcher choose."""
    collective_timeout: float = 600.0
    """Seconds a collective (all-reduce, barrier) waits for the other ranks before failing: a frozen peer stops the run instead of holding it for torch's default 30 minutes. More than 0, at most 86400 (a day)."""
    gpu_memory_gib: float | None = None
    """GPU memory per GPU, in GiB, that the memory plan counts on (a share of a GPU others use too); null: the smallest chosen GPU's total as NVML reports it. The launcher writes the figure it planned with into the run's config, so every worker checks the run against the same number it was accepted with."""

    AT_MOST: ClassVar[dict[str, int]] = {"device_id": 1023}

    def __post_init__(self) -> None:
        if self.device_id is not None:
            _check(self.device_id >= 0, "system.device_id", f"must not be negative (got {self.device_id})")
        _check_at_most(self, "system")
        if self.gpu_memory_gib is not None:
            _check(
                0 < self.gpu_memory_gib < 1 << 20,
                "system.gpu_memory_gib",
                f"must be a positive number of GiB (got {self.gpu_memory_gib:g})",
            )
        _check(
            0 < self.collective_timeout <= 86400,
            "system.collective_timeout",
            f"must be more than 0 seconds and at most 86400, a day (got {self.collective_timeout:g})",
        )


@dataclass(frozen=True)
class LoggingConfig:
    level: Literal["DEBUG", "INFO", "WARNING"] = "INFO"
    """Lowest level of worker log lines printed."""
    log_interval: int = 10
    """Print a step line every N optimizer steps (the first and last step always)."""
    tensorboard: bool = True
    """Also write the metrics as TensorBoard events to <run dir>/tensorboard/ when the tensorboard package is installed."""
    wandb: bool = False
    """Also log the metrics to Weights & Biases (pip install wandb; WANDB_MODE=offline keeps the run in <run dir>/wandb/ for a later `wandb sync`)."""
    wandb_project: str = "pretrain"
    """The Weights & Biases project the runs go to (with logging.wandb)."""
    straggler_window: int = 50
    """With several ranks: every N steps the ranks compare the median of their own compute time per step (the forwards and losses of a step's micro-batches, docs/training.md) in one tiny all-gather, and rank 0 names a rank slower than the median of all ranks by logging.straggler_threshold; 0: off."""
    straggler_threshold: float = 1.2
    """A rank whose window median is above this many times the median of all ranks is logged as a straggler (1.2: 20% slower)."""

    AT_MOST: ClassVar[dict[str, int]] = {"log_interval": MAX_STEPS, "straggler_window": MAX_STEPS}

    def __post_init__(self) -> None:
        _check(self.log_interval >= 1, "logging.log_interval", f"must be at least 1 (got {self.log_interval})")
        _check(self.straggler_window >= 0, "logging.straggler_window", f"must not be negative (got {self.straggler_window})")
        _check(
            math.isfinite(self.straggler_threshold) and self.straggler_threshold > 1,
            "logging.straggler_threshold",
            f"must be a number above 1, a ratio to the median rank (got {self.straggler_threshold})",
        )
        _check_at_most(self, "logging")


@dataclass(frozen=True)
class EvaluationConfig:
    task: Literal["hellaswag"] = "hellaswag"
    """The benchmark scored during training (when evaluation.data is set): "hellaswag", the right one of four endings by the model's likelihood (pretrain/evaluation/hellaswag.py)."""
    data: str = ""
    """The task's examples: a .jsonl file (HellaSwag's hellaswag_val.jsonl) or a Hub dataset's file, hf://datasets/OWNER/NAME[@REVISION]/PATH; empty: no benchmark during training. python -m pretrain.evaluate scores a checkpoint afterwards."""
    interval: int = 0
    """Score the task every N steps (a fresh run from step 0, before training) and after the last step; 0: only after the last step. The score logged at step N is that of the weights checkpoint step_N holds."""
    max_examples: int = 0
    """Score the first N examples of the file; 0: all (HellaSwag's validation file holds 10042)."""
    batch_examples: int = 8
    """Examples per forward pass on each rank (four rows each, one per ending)."""

    AT_MOST: ClassVar[dict[str, int]] = {"interval": MAX_STEPS, "max_examples": MAX_COUNT, "batch_examples": MAX_SIZE}

    def __post_init__(self) -> None:
        for name in ("interval", "max_examples"):
            _check(getattr(self, name) >= 0, f"evaluation.{name}", f"must not be negative (got {getattr(self, name)})")
        _check(self.batch_examples >= 1, "evaluation.batch_examples", f"must be at least 1 (got {self.batch_examples})")
        _check_at_most(self, "evaluation")


@dataclass(frozen=True)
class DebugConfig:
    check_finite: bool = True
    """Check every step's loss and gradient norm for NaN or Inf before the update (one small all-reduce); on_nonfinite says what then."""
    on_nonfinite: Literal["stop", "skip"] = "stop"
    """stop: report the bad tensors, save checkpoint nan_grad_step_<N> and the dump, exit 3. skip: drop that update and go on."""
    max_skips_in_a_row: int = 3
    """With on_nonfinite=skip: skip at most this many updates in a row; the next non-finite step stops as with stop."""
    trace_nonfinite: bool = False
    """Hooks on every module name the first whose output or gradient is not finite (slow; turns off compile and activation checkpointing)."""
    dump_tensors: bool = True
    """On a stop for NaN/Inf, write every parameter and gradient (float32) to <run dir>/debug/nan_debug_step_<N>.npz."""
    detect_anomaly: bool = False
    """Run autograd anomaly detection (names the backward op that made a NaN; slow)."""

    AT_MOST: ClassVar[dict[str, int]] = {"max_skips_in_a_row": MAX_STEPS}

    def __post_init__(self) -> None:
        _check(self.on_nonfinite in ("stop", "skip"), "debug.on_nonfinite", f"must be stop or skip (got {self.on_nonfinite!r})")
        _check(self.max_skips_in_a_row >= 1, "debug.max_skips_in_a_row", f"must be at least 1 (got {self.max_skips_in_a_row})")
        _check_at_most(self, "debug")


@dataclass(frozen=True)
class Config:
    preset: str = "production"
    """Preset this config was built on (informational once resolved)."""
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    system: SystemConfig = field(default_factory=SystemConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    evaluation: EvaluationConfig = field(default_factory=EvaluationConfig)
    debug: DebugConfig = field(default_factory=DebugConfig)


SECTIONS: dict[str, type] = {name: hint for name, hint in get_type_hints(Config).items() if name != "preset"}
