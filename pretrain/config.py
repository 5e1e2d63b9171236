"""Training configuration: a tree of frozen dataclasses, named presets, strict loading.

A config is resolved in layers: a preset, then JSON files, then `--max-steps` and
`--set section.key=value`. Every layer is validated as it is applied, so an error names
the layer it came from (the file, or the option), the key path and, for a typo, the
closest valid key. Nothing here imports torch: the launcher resolves configs too.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import difflib
import inspect
import json
import math
import types
from collections.abc import Callable, Sequence
from itertools import pairwise
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Union, get_args, get_origin, get_type_hints

from pretrain.runfiles import atomic_write_text


class ConfigError(ValueError):
    """A configuration problem the user can fix; the message is one line."""


def _check(ok: bool, key: str, problem: str) -> None:
    if not ok:
        raise ConfigError(f"{key}: {problem}")


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
    ffn_dim: int = 14336
    """Hidden width of the SwiGLU feed-forward block."""
    vocab_size: int | None = 128256
    """Rows of the embedding and output projection: at least the tokenizer's vocabulary; null follows the tokenizer (set once the dataset is prepared)."""
    norm_eps: float = 1e-5
    """Epsilon of RMSNorm."""
    rope_theta: float = 500000.0
    """Base of the rotary position embedding frequencies."""
    init_std: float = 0.02
    """Standard deviation of the normal initialisation of weight matrices."""
    max_seq_len: int | None = 8192
    """Longest sequence the model is built for; data.context_length may not exceed it. null follows data.context_length."""

    def __post_init__(self) -> None:
        for name in ("dim", "n_layers", "n_heads", "n_kv_heads", "ffn_dim"):
            _check(getattr(self, name) >= 1, f"model.{name}", f"must be at least 1 (got {getattr(self, name)})")
        _check(self.dim % self.n_heads == 0, "model.dim",
               f"{self.dim} is not divisible by model.n_heads ({self.n_heads})")
        _check((self.dim // self.n_heads) % 2 == 0, "model.dim",
               f"head size {self.dim // self.n_heads} (dim / n_heads) must be even for rotary embeddings")
        _check(self.n_heads % self.n_kv_heads == 0, "model.n_heads",
               f"{self.n_heads} is not divisible by model.n_kv_heads ({self.n_kv_heads})")
        if self.vocab_size is not None:
            _check(self.vocab_size >= 2, "model.vocab_size", f"must be at least 2 or null (got {self.vocab_size})")
        _check(self.norm_eps > 0, "model.norm_eps", f"must be positive (got {self.norm_eps})")
        _check(self.rope_theta > 0, "model.rope_theta", f"must be positive (got {self.rope_theta})")
        _check(self.init_std > 0, "model.init_std", f"must be positive (got {self.init_std})")
        if self.max_seq_len is not None:
            _check(self.max_seq_len >= 2, "model.max_seq_len", f"must be at least 2 or null (got {self.max_seq_len})")


SOURCES_WITH_PATH = ("text", "jsonl", "parquet", "llmc", "megatron")
SHARD_SOURCES = ("llmc", "megatron")


@dataclass(frozen=True)
class DataConfig:
    source: Literal["builtin", "text", "jsonl", "parquet", "hub", "llmc", "megatron"] = "builtin"
    """Where the text comes from: "builtin" (Python's own documentation, no network), local "text", "jsonl" or "parquet" files, a Hugging Face "hub" dataset, or pre-tokenized "llmc" (llm.c / modded-nanogpt .bin) or "megatron" (.bin + .idx) shards, used in place."""
    path: str = ""
    """Local source: a file, a directory or a glob pattern (text, jsonl, parquet, llmc); for megatron the path without .bin/.idx. Relative paths are from the current directory."""
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
    """Use and download only the first N files matching hub_files, in name order; null: as many as the run reads (estimated from the files' sizes, chosen before training and written into the run's config); 0: all."""
    max_samples: int = 0
    """Use at most this many documents of the source (data.val_path's files are not limited); 0 uses all."""
    tokenizer: Literal["byte", "bpe", "huggingface", "tiktoken"] = "byte"
    """How text becomes token ids: "byte" (one id per UTF-8 byte plus end-of-text, 257 ids), "bpe" (byte-level BPE trained on the source, cached), "huggingface" (a tokenizer.json file or Hub repo), "tiktoken" (an OpenAI encoding)."""
    tokenizer_name: str = ""
    """huggingface: a tokenizer.json path or a Hub model repo id; tiktoken: the encoding name (gpt2, cl100k_base, o200k_base)."""
    bpe_vocab_size: int = 8192
    """Vocabulary size of the trained "bpe" tokenizer, end-of-text included."""
    eot_token: str = ""
    """End-of-text token of a huggingface tokenizer; empty picks the first it has of `<|endoftext|>`, `<|end_of_text|>`, `</s>`, `<eos>`."""
    context_length: int = 8192
    """Tokens per training sequence."""
    val_fraction: float = 0.05
    """Share of the tokens held out for validation when val_path is empty."""
    cache_dir: str = "cache/datasets"
    """Where prepared datasets are cached; a relative path is under the project root."""

    def __post_init__(self) -> None:
        _check(2 <= self.context_length <= 1 << 20, "data.context_length",
               f"must be between 2 and 1048576 (got {self.context_length})")
        _check(0 < self.val_fraction < 1, "data.val_fraction",
               f"must be between 0 and 1, exclusive (got {self.val_fraction})")
        _check(self.cache_dir != "", "data.cache_dir", "must not be empty")
        _check(self.max_samples >= 0, "data.max_samples", f"must not be negative (got {self.max_samples}); 0 uses all")
        _check(self.bpe_vocab_size >= 258, "data.bpe_vocab_size",
               f"must be at least 258 (256 bytes, end-of-text and one merge; got {self.bpe_vocab_size})")
        if self.hub_repo:
            _check(self.hub_repo.count("/") == 1 and all(self.hub_repo.split("/")), "data.hub_repo",
                   f"expected owner/name (got {self.hub_repo!r})")
        _check(self.hub_files != "", "data.hub_files", "must not be empty")
        if self.hub_max_files is not None:
            _check(self.hub_max_files >= 0, "data.hub_max_files",
                   f"must not be negative (got {self.hub_max_files}); 0 uses all files, null as many as the run reads")

    def check_complete(self) -> None:
        """The keys the chosen source and tokenizer cannot work without. Checked once every
        layer is applied: a file may choose the source and a --set give its path."""
        if self.source in SOURCES_WITH_PATH:
            _check(self.path != "", "data.path", f'source "{self.source}" needs data.path (a file, directory or glob)')
        if self.source == "hub":
            _check(self.hub_repo != "", "data.hub_repo", 'source "hub" needs data.hub_repo=owner/name')
        if self.source in SHARD_SOURCES:
            _check(self.max_samples == 0, "data.max_samples",
                   f'applies to text sources; "{self.source}" shards are used whole (set it to 0)')
        if self.source not in SOURCES_WITH_PATH:  # keys that would be silently ignored are mistakes
            for key in ("path", "val_path"):
                _check(getattr(self, key) == "", f"data.{key}",
                       f'source "{self.source}" reads no local files; set data.source to text, jsonl, parquet, '
                       "llmc or megatron to use it")
        if self.source != "hub":
            _check(self.hub_repo == "", "data.hub_repo", f'is set but data.source is "{self.source}"; set data.source=hub')
            _check(self.hub_max_files is None, "data.hub_max_files",
                   f'is set but data.source is "{self.source}"; set data.source=hub')
        if self.tokenizer in ("huggingface", "tiktoken"):
            what = "a tokenizer.json path or Hub repo id" if self.tokenizer == "huggingface" else "an encoding such as gpt2"
            _check(self.tokenizer_name != "", "data.tokenizer_name", f'tokenizer "{self.tokenizer}" needs {what}')
        else:
            _check(self.tokenizer_name == "", "data.tokenizer_name",
                   f'is set but data.tokenizer is "{self.tokenizer}"; set data.tokenizer to huggingface or tiktoken')
        if self.tokenizer == "tiktoken":
            _check(self.tokenizer_name.replace("_", "").replace("-", "").replace(".", "").isalnum(),
                   "data.tokenizer_name", f"{self.tokenizer_name!r} is not a tiktoken encoding name (gpt2, cl100k_base, ...)")


@dataclass(frozen=True)
class TrainingConfig:
    batch_size: int = 1
    """Sequences per forward pass on each rank (the micro-batch)."""
    grad_accum_nums: int = 8
    """Micro-batches accumulated into one optimizer step."""
    num_workers: int = 0
    """DataLoader worker processes per rank; 0 loads batches in the training process."""
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
    weight_decay: float = 0.1
    """AdamW weight decay, applied to weight matrices only."""
    beta1: float = 0.9
    """AdamW first-moment decay."""
    beta2: float = 0.95
    """AdamW second-moment decay."""
    max_grad_norm: float = 1.0
    """Clip the global gradient norm to this; 0 disables clipping."""
    use_amp: bool = True
    """Run the forward pass in bfloat16 autocast (weights and optimizer stay fp32)."""
    seed: int = 1337
    """Seed for initialisation and data order; identical on every rank."""
    eval_interval: int = 0
    """Compute validation loss every N steps; 0 only after the last step."""
    eval_batches: int = 4
    """Micro-batches per rank in one validation pass."""
    global_batch_size: int = 0
    """Sequences per optimizer step over all ranks; when above 0, grad_accum_nums is derived from it (it must be a multiple of batch_size x ranks), so the step stays the same whatever the number of GPUs."""
    parallelism: Literal["auto", "ddp", "fsdp"] = "auto"
    """How ranks share the model: "ddp" (a full copy on each GPU), "fsdp" (FSDP2, parameters sharded per block), or "auto" (DDP when the estimated memory fits one GPU, else FSDP)."""
    cpu_offload: bool | None = None
    """FSDP2 with CPU offload: sharded weights, gradients and AdamW state in host memory, the GPU holding only what is in flight (slower: every step copies them over PCIe); null uses it only when the model does not fit the GPUs but fits with it, within the host's memory (the launcher says so)."""
    activation_checkpointing: bool = False
    """Recompute each block's activations in the backward pass instead of keeping them: about a third more compute for much less memory."""
    compile: bool | None = None
    """torch.compile the model; null compiles on CUDA and not on CPU (where the first compile is slow)."""
    loss_chunk_tokens: int = 2048
    """Tokens per chunk of the output projection and cross-entropy, so the fp32 logits of the whole batch never exist at once; 0 computes them in one piece."""
    checkpoint_interval: int = 1000
    """Save a checkpoint every N steps (and always after the last step); 0 only after the last step."""
    keep_checkpoints: int = 3
    """How many step_<N> checkpoints to keep; older ones are deleted once a newer one is complete."""
    resume: str = ""
    """Continue from a checkpoint: "auto" (the latest one of the run directory, or of the run under runs/ whose latest checkpoint is newest), a checkpoint or run directory path, or "" to start fresh. Also --resume."""

    def __post_init__(self) -> None:
        for name in ("batch_size", "grad_accum_nums", "max_steps", "eval_batches", "keep_checkpoints"):
            _check(getattr(self, name) >= 1, f"training.{name}", f"must be at least 1 (got {getattr(self, name)})")
        for name in ("epochs", "num_workers", "warmup_steps", "weight_decay", "max_grad_norm", "eval_interval",
                     "global_batch_size", "loss_chunk_tokens", "checkpoint_interval"):
            _check(getattr(self, name) >= 0, f"training.{name}", f"must not be negative (got {getattr(self, name)})")
        _check(0 <= self.seed < 2**63, "training.seed", f"must be in [0, 2**63) (got {self.seed})")
        _check(self.learning_rate > 0, "training.learning_rate", f"must be positive (got {self.learning_rate})")
        _check(0 <= self.min_lr_ratio <= 1, "training.min_lr_ratio", f"must be between 0 and 1 (got {self.min_lr_ratio})")
        for name in ("beta1", "beta2"):
            _check(0 <= getattr(self, name) < 1, f"training.{name}", f"must be in [0, 1) (got {getattr(self, name)})")


@dataclass(frozen=True)
class SystemConfig:
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """Where to train: "cuda", "cpu", or "auto" (every free GPU, else CPU workers)."""
    device_id: int | None = None
    """Pin the run to this one physical GPU index; null lets the launcher choose."""
    collective_timeout: float = 600.0
    """Seconds a collective (all-reduce, barrier) waits for the other ranks before failing: a frozen peer stops the run instead of holding it for torch's default 30 minutes."""

    def __post_init__(self) -> None:
        if self.device_id is not None:
            _check(self.device_id >= 0, "system.device_id", f"must not be negative (got {self.device_id})")
        _check(0 < self.collective_timeout <= 86400, "system.collective_timeout",
               f"must be between 0 and 86400 seconds (got {self.collective_timeout:g})")


@dataclass(frozen=True)
class LoggingConfig:
    level: Literal["DEBUG", "INFO", "WARNING"] = "INFO"
    """Lowest level of worker log lines printed."""
    log_interval: int = 10
    """Print a step line every N optimizer steps (the first and last step always)."""
    tensorboard: bool = True
    """Also write the metrics as TensorBoard events to <run dir>/tensorboard/ when the tensorboard package is installed."""

    def __post_init__(self) -> None:
        _check(self.log_interval >= 1, "logging.log_interval", f"must be at least 1 (got {self.log_interval})")


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

    def __post_init__(self) -> None:
        _check(self.on_nonfinite in ("stop", "skip"), "debug.on_nonfinite",
               f"must be stop or skip (got {self.on_nonfinite!r})")
        _check(self.max_skips_in_a_row >= 1, "debug.max_skips_in_a_row",
               f"must be at least 1 (got {self.max_skips_in_a_row})")


@dataclass(frozen=True)
class Config:
    preset: str = "production"
    """Preset this config was built on (informational once resolved)."""
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    system: SystemConfig = field(default_factory=SystemConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    debug: DebugConfig = field(default_factory=DebugConfig)


SECTIONS: dict[str, type] = {name: hint for name, hint in get_type_hints(Config).items() if name != "preset"}


FINEWEB_EDU: dict[str, Any] = {"source": "hub", "hub_repo": "HuggingFaceFW/fineweb-edu", "hub_files": "sample/10BT/*.parquet"}
"""The real runs' data: FineWeb-Edu's 10B-token sample, 14 Parquet files of ~2 GB (~0.7B GPT-2
tokens each), of which a run downloads only what it reads (data.hub_max_files)."""


def production() -> Config:
    """Llama-3-8B shape: 32 layers, dim 4096, 32 heads, 8 KV heads, vocab 128256, with Llama-3's
    tokenizer (from an ungated copy of the weights' repository: meta-llama's own is gated, and a
    default must work without accepting terms). Activations of 8192 tokens through 32 such layers
    take ~60 GiB, so each block's are recomputed in the backward."""
    return Config(preset="production",
                  data=DataConfig(**FINEWEB_EDU, tokenizer="huggingface", tokenizer_name="NousResearch/Meta-Llama-3-8B"),
                  training=TrainingConfig(activation_checkpointing=True))


def debug() -> Config:
    """2 layers, small width, 10 steps, DEBUG logging, fp32, and hooks that name the first module
    to produce a NaN or Inf: runs in seconds on a CPU."""
    return Config(
        preset="debug",
        model=ModelConfig(dim=128, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=384,
                          vocab_size=None, rope_theta=10000.0, max_seq_len=None),
        data=DataConfig(source="builtin", tokenizer="byte", context_length=128),
        training=TrainingConfig(batch_size=8, grad_accum_nums=1, learning_rate=3e-3,
                                warmup_steps=2, max_steps=10, use_amp=False, eval_batches=2,
                                checkpoint_interval=0, keep_checkpoints=2),
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
        model=ModelConfig(dim=768, n_layers=12, n_heads=12, n_kv_heads=4, ffn_dim=2048, vocab_size=50304,
                          rope_theta=10000.0, max_seq_len=1024),
        data=DataConfig(**FINEWEB_EDU, tokenizer="huggingface", tokenizer_name="openai-community/gpt2",
                        context_length=1024),
        training=TrainingConfig(batch_size=16, grad_accum_nums=4, learning_rate=6e-4, warmup_steps=200,
                                max_steps=5000, eval_interval=250),
    )


PRESETS: dict[str, Callable[[], Config]] = {"debug": debug, "small": small, "production": production}


# --- strict loading -------------------------------------------------------------------

def _closest(word: str, choices: Sequence[str]) -> str:
    match = difflib.get_close_matches(word, list(choices), n=1, cutoff=0.5)
    return f"; did you mean {match[0]}?" if match else f"; valid: {', '.join(sorted(choices))}"


def _describe(value: Any) -> str:
    kind = {bool: "a boolean", int: "an integer", float: "a number", str: "a string",
            list: "a list", dict: "an object", type(None): "null"}.get(type(value), type(value).__name__)
    return f"{json.dumps(value)} ({kind})"


def _coerce(key: str, expected: Any, value: Any) -> Any:
    """Return value as the declared type, or raise ConfigError naming the key."""
    origin = get_origin(expected)
    if origin is Literal:
        allowed = get_args(expected)
        if value not in allowed:
            raise ConfigError(f"{key}: {_describe(value)} is not one of {', '.join(map(json.dumps, allowed))}")
        return value
    if origin in (Union, types.UnionType):
        members = get_args(expected)
        if value is None and type(None) in members:
            return None
        (inner,) = [m for m in members if m is not type(None)]
        return _coerce(key, inner, value)
    if expected is bool and isinstance(value, bool):
        return value
    if expected is int and isinstance(value, int) and not isinstance(value, bool):
        return value
    if expected is float and isinstance(value, int | float) and not isinstance(value, bool):
        if not math.isfinite(value):  # JSON's Infinity and NaN, or 1e400
            raise ConfigError(f"{key}: expected a finite number, got {value}")
        return float(value)
    if expected is str and isinstance(value, str):
        return value
    wanted = {bool: "true or false", int: "an integer", float: "a number", str: "a string"}[expected]
    raise ConfigError(f"{key}: expected {wanted}, got {_describe(value)}")


def apply_overrides(config: Config, overrides: dict[str, Any], source: str) -> Config:
    """Return config with overrides ({section: {key: value}}, as in a JSON file) applied."""
    try:
        sections: dict[str, Any] = {}
        for name, values in overrides.items():
            if name == "preset":
                continue
            if name not in SECTIONS:
                raise ConfigError(f"{name}: unknown section{_closest(name, list(SECTIONS))}")
            if not isinstance(values, dict):
                raise ConfigError(f"{name}: expected an object of keys, got {_describe(values)}")
            cls = SECTIONS[name]
            hints = get_type_hints(cls)
            changes = {}
            for key, value in values.items():
                if key not in hints:
                    valid = [f"{name}.{k}" for k in hints]
                    raise ConfigError(f"{name}.{key}: unknown key{_closest(f'{name}.{key}', valid)}")
                changes[key] = _coerce(f"{name}.{key}", hints[key], value)
            sections[name] = dataclasses.replace(getattr(config, name), **changes)
        return dataclasses.replace(config, **sections)
    except ConfigError as error:
        raise ConfigError(f"{source}: {error}") from None


def read_config_file(path: Path) -> dict[str, Any]:
    """Parse a JSON config file into a dict, with one-line errors for the usual mistakes."""
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(f"{path}: config file not found") from None
    except (OSError, UnicodeDecodeError) as error:
        raise ConfigError(f"{path}: cannot read config file ({error})") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as error:
        raise ConfigError(f"{path}: invalid JSON at line {error.lineno} column {error.colno}: {error.msg}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a JSON object of sections, got {_describe(data)}")
    preset = data.get("preset")
    if preset is not None and not isinstance(preset, str):
        raise ConfigError(f"{path}: preset: expected a preset name, got {_describe(preset)}")
    if preset is not None and preset not in PRESETS:
        raise ConfigError(f"{path}: preset: unknown preset {json.dumps(preset)}{_closest(str(preset), list(PRESETS))}")
    return data


def parse_set(assignment: str) -> dict[str, Any]:
    """Turn `section.key=value` into {section: {key: value}}; value is JSON, else a string."""
    path, sep, raw = assignment.partition("=")
    if not sep or path.count(".") != 1 or not all(path.split(".")):
        raise ConfigError(f"--set {assignment}: expected section.key=value, for example training.batch_size=4")
    section, key = path.split(".")
    if section == "preset":
        raise ConfigError(f"--set {assignment}: the preset is not a section; use --preset NAME")
    try:
        value = json.loads(raw)
    except json.JSONDecodeError:
        value = raw
    return {section: {key: value}}


def resolve(preset: str | None = None, config_file: Path | None = None,
            max_steps: int | None = None, sets: Sequence[str] = (), *, saved: bool = False) -> Config:
    """Build a config: preset (explicit, else the file's "preset", else production), then
    the file, then --max-steps, then each --set in order. saved: config_file was written by
    save() (see one_run_length)."""
    file_data = read_config_file(config_file) if config_file is not None else {}
    name = preset or file_data.get("preset") or "production"
    if name not in PRESETS:
        raise ConfigError(f"--preset {name}: unknown preset{_closest(name, list(PRESETS))}")
    config = PRESETS[name]()
    user_data_keys = set(file_data["data"]) if isinstance(file_data.get("data"), dict) else set()
    run_length_set_by: dict[str, str] = {}
    if config_file is not None:
        config = apply_overrides(config, file_data, str(config_file))
        run_length_set_by |= run_length_keys(file_data, str(config_file))
    if max_steps is not None:
        config = apply_overrides(config, {"training": {"max_steps": max_steps}}, "--max-steps")
        run_length_set_by["max_steps"] = "--max-steps"
    for assignment in sets:
        overrides = parse_set(assignment)
        user_data_keys |= set(overrides.get("data", {}))
        config = apply_overrides(config, overrides, "--set")
        run_length_set_by |= run_length_keys(overrides, "--set")
    if not saved:
        config = one_run_length(config, run_length_set_by)
    config = drop_unused_preset_keys(config, PRESETS[name]().data, user_data_keys)
    config.data.check_complete()
    check_context(config)
    return config


def run_length_keys(overrides: dict[str, Any], layer: str) -> dict[str, str]:
    """{key: layer} for training.epochs and training.max_steps, where overrides set them."""
    training = overrides.get("training")
    return {key: layer for key in ("epochs", "max_steps") if isinstance(training, dict) and key in training}


def one_run_length(config: Config, set_by: dict[str, str]) -> Config:
    """training.epochs (when above 0) sets the run length instead of training.max_steps, so
    the user's layers (a file, --max-steps, --set; set_by names the last to set each) may set
    only one of them: both is an error, never a silent choice. Where only one is the user's,
    it wins over the preset's other. A config written by save() is exempt: its max_steps is
    the one fit_to_dataset derived from its epochs (newer runs save epochs as 0)."""
    t = config.training
    if t.epochs == 0:
        return config
    if "epochs" in set_by and "max_steps" in set_by:
        raise ConfigError(f"training.epochs={t.epochs} ({set_by['epochs']}) and training.max_steps={t.max_steps} "
                          f"({set_by['max_steps']}) both set the run length; keep one of them")
    if "max_steps" in set_by:  # the preset's epochs under the user's max_steps
        return dataclasses.replace(config, training=dataclasses.replace(t, epochs=0))
    return config


HUB_KEYS = ("hub_repo", "hub_revision", "hub_files", "hub_max_files")
TOKENIZER_KEYS = ("tokenizer_name", "eot_token")


def drop_unused_preset_keys(config: Config, preset: DataConfig, user_keys: set[str]) -> Config:
    """config with the data keys that came from the preset, and that the user's choice of source
    or tokenizer makes meaningless, back at their neutral defaults: `--preset small --set
    data.source=jsonl` must not fail on the preset's data.hub_repo, nor `--set data.tokenizer=byte`
    on its data.tokenizer_name; with pre-tokenized shards its tokenizer goes too. A key the user
    set (file or --set) is kept, so check_complete still refuses it when it would be ignored."""
    data, neutral = config.data, DataConfig()
    unused: list[str] = []
    if data.source != "hub":
        unused += HUB_KEYS
    if data.source in SHARD_SOURCES and "tokenizer" not in user_keys:
        # Shards are tokenized already; "byte" is what says nothing names their tokenizer.
        data = dataclasses.replace(data, tokenizer=neutral.tokenizer)
    if data.tokenizer != preset.tokenizer:  # another tokenizer: the preset's name is not its name
        unused += TOKENIZER_KEYS
    changes = {key: getattr(neutral, key) for key in unused
               if key not in user_keys and getattr(data, key) == getattr(preset, key)}
    return dataclasses.replace(config, data=dataclasses.replace(data, **changes))


def check_context(config: Config) -> None:
    """The training sequences must fit the model's positions."""
    limit = config.model.max_seq_len
    if limit is not None and config.data.context_length > limit:
        raise ConfigError(f"data.context_length {config.data.context_length} is longer than the model supports "
                          f"(model.max_seq_len {limit}); lower data.context_length or raise model.max_seq_len")


def activation_checkpointing(config: Config) -> bool:
    """Whether blocks recompute their activations: as asked, except under debug.trace_nonfinite,
    whose hooks must see every module run once."""
    return config.training.activation_checkpointing and not config.debug.trace_nonfinite


def max_seq_len(config: Config) -> int:
    """The sequence length the model is built for."""
    return config.model.max_seq_len or config.data.context_length


def with_world_size(config: Config, world_size: int) -> Config:
    """config with grad_accum_nums derived from training.global_batch_size for world_size ranks
    (unchanged when global_batch_size is 0). ConfigError when it does not divide."""
    t = config.training
    if t.global_batch_size == 0:
        return config
    per_step = t.batch_size * world_size
    if t.global_batch_size % per_step:
        lower = t.global_batch_size // per_step * per_step
        options = " or ".join(str(n) for n in (lower, lower + per_step) if n > 0)
        raise ConfigError(f"training.global_batch_size {t.global_batch_size} is not a multiple of training.batch_size "
                          f"{t.batch_size} x {world_size} rank(s) = {per_step}; use {options}, or change batch_size")
    training = dataclasses.replace(t, grad_accum_nums=t.global_batch_size // per_step)
    return dataclasses.replace(config, training=training)


def to_dict(config: Config) -> dict[str, Any]:
    return dataclasses.asdict(config)


def save(config: Config, path: Path) -> None:
    """Write the resolved config as JSON, atomically; loading it back gives the same config."""
    atomic_write_text(path, json.dumps(to_dict(config), indent=2) + "\n")


def load(path: Path) -> Config:
    """Load a resolved config written by save() (or any complete config file)."""
    return resolve(config_file=path, saved=True)


# --- command line ---------------------------------------------------------------------

def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The config options shared by the launcher and pretrain_main.py."""
    group = parser.add_argument_group("config")
    group.add_argument("--preset", choices=sorted(PRESETS), help="base preset (default: production)")
    group.add_argument("--debug", action="store_true", help="same as --preset debug")
    group.add_argument("--config", type=Path, metavar="FILE.json", help="JSON file overriding the preset")
    group.add_argument("--max-steps", type=int, metavar="N", help="override training.max_steps")
    group.add_argument("--set", dest="sets", action="append", default=[], metavar="SECTION.KEY=VALUE",
                       help="override one key (value as JSON, else a string); repeatable")
    group.add_argument("--resume", metavar="auto|PATH",
                       help="continue from a checkpoint: auto (the latest one) or a checkpoint or run directory; "
                            "same as --set training.resume=...")


def from_args(args: argparse.Namespace) -> Config:
    if args.debug and args.preset not in (None, "debug"):
        raise ConfigError(f"--debug conflicts with --preset {args.preset}; use one of them")
    sets = list(args.sets)
    if getattr(args, "resume", None):
        if not args.resume.strip():
            raise ConfigError("--resume: expected auto or a checkpoint path")
        sets.append(f"training.resume={json.dumps(args.resume)}")
    return resolve(preset="debug" if args.debug else args.preset, config_file=args.config,
                   max_steps=args.max_steps, sets=sets)


# --- documentation --------------------------------------------------------------------

def field_docs(cls: type) -> dict[str, str]:
    """The docstring under each field of a dataclass (read from its source)."""
    tree = ast.parse(inspect.getsource(cls))
    body = tree.body[0].body  # type: ignore[attr-defined]
    docs = {}
    for node, following in pairwise(body):
        if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
                and isinstance(following, ast.Expr) and isinstance(following.value, ast.Constant)):
            docs[node.target.id] = " ".join(str(following.value.value).split())
    return docs


def reference_table() -> str:
    """A Markdown table of every key: default (production), debug value, meaning."""
    prod, dbg = to_dict(production()), to_dict(debug())
    rows = ["| key | production | debug | meaning |", "| --- | --- | --- | --- |"]
    for section, cls in SECTIONS.items():
        docs = field_docs(cls)
        for f in dataclasses.fields(cls):
            meaning = docs.get(f.name, "").replace("|", r"\|")  # a bare | would end the table cell
            rows.append(f"| `{section}.{f.name}` | `{json.dumps(prod[section][f.name])}` "
                        f"| `{json.dumps(dbg[section][f.name])}` | {meaning} |")
    return "\n".join(rows)


if __name__ == "__main__":
    print(reference_table())
