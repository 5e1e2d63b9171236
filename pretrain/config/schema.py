"""The config's shape: one frozen dataclass per section, each field's type, default and docstring,
and the checks a section makes on its own values (ConfigError, one line naming the key).

docs/config.md is generated from these classes and the docstring under each field
(python -m pretrain.config_reference). Nothing here imports torch.
"""

from __future__ import annotations

import difflib
import json
import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal, get_type_hints

from pretrain import registry
from pretrain.run.refusal import Refusal


class ConfigError(Refusal, ValueError):
    """A configuration problem the user can fix; the message is one line."""


def _check(ok: bool, key: str, problem: str) -> None:
    if not ok:
        raise ConfigError(f"{key}: {problem}")


# Upper bounds of the integer keys, where a larger value means nothing a run could do: checked in
# each section's __post_init__ (_check_at_most), which every layer passes through (a file,
# --max-steps, --set), and declared once, in each section's AT_MOST: the reference (config_reference.field_docs)
# appends "At most N." to the key's docstring from there.
MAX_STEPS = 10**12
"""Optimizer steps, and the intervals counted in them: 10^12 steps take 30 years at a millisecond each."""
MAX_SIZE = 1 << 16
"""A model width, batch or count of heads, layers or experts: 65536, past any model trained."""
MAX_LENGTH = 1 << 20
"""Tokens in a sequence, or ids in a vocabulary (1048576)."""
MAX_COUNT = 10**12
"""Documents, files or examples to read: more than any dataset holds."""


def _check_at_most(section: Any, prefix: str) -> None:
    """Each integer key of section (a dataclass with AT_MOST) at most its bound: one line naming
    the key, the value, the bound and what to do."""
    for name, bound in section.AT_MOST.items():
        value = getattr(section, name)
        if value is not None:
            _check(value <= bound, f"{prefix}.{name}", f"must be at most {bound} (got {value}); use a value up to {bound}")


def describe(value: Any) -> str:
    """A value as the user wrote it, and its JSON type: '"gpu" (a string)'."""
    kind = {
        bool: "a boolean",
        int: "an integer",
        float: "a number",
        str: "a string",
        list: "a list",
        dict: "an object",
        type(None): "null",
    }.get(type(value), type(value).__name__)
    return f"{json.dumps(value)} ({kind})"


def not_one_of(value: Any, choices: Iterable[str]) -> str:
    """Why value is none of the choices (a Literal's, or a registry's names), with the closest
    choice when it looks like a typo."""
    names = list(choices)
    close = difflib.get_close_matches(value, names, n=1) if isinstance(value, str) else []
    hint = f"; did you mean {json.dumps(close[0])}?" if close else ""
    return f"{describe(value)} is not one of {', '.join(map(json.dumps, names))}{hint}"


@dataclass(frozen=True)
class MoEConfig:
    num_experts: int = 0
    """Experts per layer; 0 keeps the dense feed-forward block (model.ffn). Above 0, every layer's feed-forward block is a mixture of that many SwiGLU experts of width model.ffn_dim."""
    top_k: int = 2
    """Experts each token is routed to (token-choice top-k); their outputs are summed, weighted by the router's renormalised probabilities."""
    capacity_factor: float = 1.25
    """Each expert takes at most capacity_factor x tokens x top_k / num_experts tokens per batch; the tokens over it skip that expert (the residual carries them)."""
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
        _check(self.capacity_factor > 0, "model.moe.capacity_factor", f"must be positive (got {self.capacity_factor})")
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


CheckpointingMode = Literal["none", "selective", "full"]
"""What a block recomputes in the backward pass, least first (training.activation_checkpointing once planned)."""
CHECKPOINTING_MODES: tuple[CheckpointingMode, ...] = ("none", "selective", "full")
CHECKPOINTING_CHOICES = (*CHECKPOINTING_MODES, "auto")


@dataclass(frozen=True)
class TrainingConfig:
    batch_size: int = 1
    """Sequences per forward pass on each rank (the micro-batch)."""
    grad_accum_nums: int = 8
    """Micro-batches accumulated into one optimizer step."""
    num_workers: int = 0
    """DataLoader worker processes per rank; 0 loads batches in the training process."""
    optimizer: str = "adamw"
    """The optimizer, by its name in pretrain/registry.py (OPTIMIZERS): "adamw" (decoupled weight decay on matrices only), or "muon" (Muon for the matrices inside the blocks, AdamW for embeddings, norms and the output layer)."""
    lr_schedule: str = "cosine"
    """The learning-rate schedule, by its name in pretrain/registry.py (LR_SCHEDULES): "cosine" (linear warmup, then cosine decay to min_lr_ratio)."""
    learning_rate: float = 3e-4
    """Peak learning rate, reached at the end of warmup."""
    min_lr_ratio: float = 0.1
    """Learning rate at the last step, as a fraction of the peak (cosine decay)."""
    warmup_steps: int = 2000
    """Optimizer steps of linear warmup from zero to the peak learning rate."""
    max_steps: int = 10000
    """Optimizer steps to train for (when epochs is 0)."""
    epochs: int = 0
    """Passes over the train split; sets the run length instead of max_steps when above 0 (setting both is an error)."""
    by_epoch: bool = False
    """Count the run in epochs: the step line shows how many are done, and a checkpoint is saved at the end of each. The launcher sets it for a run whose length is training.epochs (the workers then get that length as max_steps)."""
    weight_decay: float = 0.1
    """AdamW weight decay, applied to weight matrices only."""
    beta1: float = 0.9
    """AdamW first-moment decay."""
    beta2: float = 0.95
    """AdamW second-moment decay."""
    muon_learning_rate: float = 0.02
    """Muon's peak learning rate for the matrices inside the blocks (training.optimizer=muon); the schedule scales it as it scales learning_rate, which the AdamW groups use."""
    muon_momentum: float = 0.95
    """Muon's momentum (Nesterov) before the update is orthogonalized."""
    muon_orthogonalize: str = "newton_schulz"
    """How Muon orthogonalizes an update, by its name in pretrain/registry.py (ORTHOGONALIZERS): "newton_schulz" (a few bfloat16 iterations) or "svd" (exact, slow)."""
    muon_ns_steps: int = 5
    """Newton-Schulz iterations per Muon update."""
    max_grad_norm: float = 1.0
    """Clip the global gradient norm to this; 0 disables clipping."""
    use_amp: bool = True
    """Run the forward pass in bfloat16 autocast (weights and optimizer stay fp32)."""
    seed: int = 1337
    """Seed for initialisation and data order; identical on every rank. Below 2^63."""
    eval_interval: int = 0
    """Compute validation loss every N steps (a fresh run from step 0, before training) and after the last step; 0 only after the last step. The loss logged at step N is that of the weights checkpoint step_N holds."""
    eval_batches: int = 4
    """Global batches in one validation pass: the first eval_batches x the global batch (batch_size x grad_accum_nums x ranks) windows of the val split (all of it when it holds fewer), shared out over the ranks, so validation covers the same windows whatever the number of GPUs; each rank runs eval_batches x grad_accum_nums micro-batches."""
    global_batch_size: int = 0
    """Sequences per optimizer step over all ranks; when above 0, grad_accum_nums is derived from it (it must be a multiple of batch_size x ranks), so the step stays the same whatever the number of GPUs."""
    parallelism: Literal["auto", "ddp", "fsdp"] = "auto"
    """How ranks share the model: "ddp" (a full copy on each GPU), "fsdp" (FSDP2, parameters sharded per block), or "auto" (DDP when the estimated memory fits one GPU, else FSDP)."""
    cpu_offload: bool | None = None
    """FSDP2 with CPU offload: sharded weights, gradients and AdamW state in host memory, the GPU holding only what is in flight (slower: every step copies them over PCIe); null uses it only when the model does not fit the GPUs but fits with it, within the host's memory (the launcher says so)."""
    activation_checkpointing: Literal["none", "selective", "full", "auto"] | bool = "auto"
    """What each block recomputes in the backward pass instead of keeping: "none"; "selective" (keeps the matmul and attention outputs, recomputes the element-wise ops: norms, rotary, silu, products; no matmul FLOPs added); "full" (keeps only the block's input and runs its forward again: ~20-25% more FLOPs); "auto": the least that fits the GPU, chosen by the launcher's plan (on CPU workers none unless the host memory needs more). true and false mean full and none."""
    compile: bool | None = None
    """torch.compile the model; null compiles on CUDA and not on CPU (where the first compile is slow)."""
    loss_chunk_tokens: int | None = None
    """Tokens per chunk of the output projection and cross-entropy, each chunk's fp32 logits recomputed in the backward pass (one more output-projection matmul) so that those of the whole micro-batch never exist at once; 0 computes them in one piece; null: one piece when the whole micro-batch's logits fit the GPU, else 2048 (the launcher's plan decides)."""
    reshard_after_forward: bool | None = None
    """FSDP: free each block's gathered bf16 weights after its forward and all-gather them again for its backward (true), or keep them gathered until then (false: one all-gather fewer per micro-batch, every block's weights unsharded at the start of the backward pass); null: false when those weights fit the GPU (the launcher's plan decides)."""
    checkpoint_interval: int = 1000
    """Save a checkpoint every N steps (and always after the last step); 0 only after the last step."""
    keep_checkpoints: int = 3
    """How many step_<N> checkpoints to keep; older ones are deleted once a newer one is complete."""
    resume: str = ""
    """Continue from a checkpoint: "auto" (the latest one of the run directory, or of the run under runs/ whose latest checkpoint is newest), a checkpoint or run directory path, or "" to start fresh. Also --resume."""
    init_from: str = ""
    """Start a fresh run from a Hugging Face Llama or Mixtral checkpoint: a local directory (config.json and safetensors) or a Hub model id (owner/name, or owner/name@revision), read through the Hugging Face cache (offline: what the cache holds). Every tensor's name and shape, and the fields that change what the model computes (heads, rotary base, norm epsilon, experts), are checked against model before any worker starts; the optimizer and the learning-rate schedule start afresh at step 0. A checkpoint to resume from (training.resume) wins over it. "" starts from random weights. Also --init-from."""

    AT_MOST: ClassVar[dict[str, int]] = {
        "batch_size": MAX_SIZE,
        "grad_accum_nums": MAX_SIZE,
        "num_workers": 1024,
        "warmup_steps": MAX_STEPS,
        "max_steps": MAX_STEPS,
        "epochs": 10**6,
        "muon_ns_steps": 100,
        "eval_interval": MAX_STEPS,
        "eval_batches": MAX_SIZE,
        "global_batch_size": 1 << 32,
        "loss_chunk_tokens": MAX_COUNT,
        "checkpoint_interval": MAX_STEPS,
        "keep_checkpoints": MAX_STEPS,
    }

    def __post_init__(self) -> None:
        for name in ("batch_size", "grad_accum_nums", "max_steps", "eval_batches", "keep_checkpoints", "muon_ns_steps"):
            _check(getattr(self, name) >= 1, f"training.{name}", f"must be at least 1 (got {getattr(self, name)})")
        for name in (
            "epochs",
            "num_workers",
            "warmup_steps",
            "weight_decay",
            "max_grad_norm",
            "eval_interval",
            "global_batch_size",
            "checkpoint_interval",
        ):
            _check(getattr(self, name) >= 0, f"training.{name}", f"must not be negative (got {getattr(self, name)})")
        _check_at_most(self, "training")
        if self.loss_chunk_tokens is not None:
            _check(
                self.loss_chunk_tokens >= 0,
                "training.loss_chunk_tokens",
                f"must not be negative (got {self.loss_chunk_tokens}); 0 computes the loss in one piece, null lets the plan decide",
            )
        if isinstance(self.activation_checkpointing, bool):  # the older true/false: full or none
            object.__setattr__(self, "activation_checkpointing", "full" if self.activation_checkpointing else "none")
        _check(
            self.activation_checkpointing in CHECKPOINTING_CHOICES,
            "training.activation_checkpointing",
            not_one_of(self.activation_checkpointing, CHECKPOINTING_CHOICES) + " (true and false mean full and none)",
        )
        _check(0 <= self.seed < 2**63, "training.seed", f"must be in [0, 2**63) (got {self.seed})")
        _check(self.learning_rate > 0, "training.learning_rate", f"must be positive (got {self.learning_rate})")
        _check(0 <= self.min_lr_ratio <= 1, "training.min_lr_ratio", f"must be between 0 and 1 (got {self.min_lr_ratio})")
        for name in ("beta1", "beta2"):
            _check(0 <= getattr(self, name) < 1, f"training.{name}", f"must be in [0, 1) (got {getattr(self, name)})")
        _check(
            self.optimizer in registry.OPTIMIZERS,
            "training.optimizer",
            not_one_of(self.optimizer, registry.OPTIMIZERS),
        )
        _check(self.muon_learning_rate > 0, "training.muon_learning_rate", f"must be positive (got {self.muon_learning_rate})")
        _check(0 <= self.muon_momentum < 1, "training.muon_momentum", f"must be in [0, 1) (got {self.muon_momentum})")
        _check(
            self.muon_orthogonalize in registry.ORTHOGONALIZERS,
            "training.muon_orthogonalize",
            not_one_of(self.muon_orthogonalize, registry.ORTHOGONALIZERS),
        )
        _check(
            self.lr_schedule in registry.LR_SCHEDULES,
            "training.lr_schedule",
            not_one_of(self.lr_schedule, registry.LR_SCHEDULES),
        )
        _check(
            self.init_from == self.init_from.strip(),
            "training.init_from",
            f"{self.init_from!r} has leading or trailing spaces; give a directory or a Hub id (owner/name)",
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
