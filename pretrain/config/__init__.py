"""Training configuration: a tree of frozen dataclasses, named presets, strict loading.

A config is resolved in layers: a preset, then JSON files, then `--max-steps` and
`--set section.key=value`. Every layer is validated as it is applied, so an error names
the layer it came from (the file, or the option), the key path and, for a typo, the
closest valid key. Nothing here imports torch: the launcher resolves configs too.

This package's __init__ is its public face; import from it (`from pretrain import config as cfg`,
`from pretrain.config import Config`). The code lives in layers, each importing only
the ones before it:

    checks.py            ConfigError, the integer bounds, how a wrong choice is said
    training.py          TrainingConfig (its fields, their docstrings, its checks),
                         CHECKPOINTING_MODES, COMPILE_MODES, SHARDED_MODES
    schema.py            the other section dataclasses (fields, defaults, the docstring
                         under each field, per-section checks), Config, SECTIONS,
                         sources_with_path, SHARD_SOURCES
    batch.py             the global batch over the ranks (with_world_size) and grad_accum_nums
                         "auto" (micro_batch_choices, with_micro_batch, batch_split)
    presets.py           production(), small(), debug(), PRESETS
    loading.py           strict loading: overrides, JSON files, --set, resolve() and its
                         whole-config rules (one run length, context, unused preset keys, the
                         global batch "auto" keeps), to_dict/save/load, add_arguments/from_args
    reference.py         field_docs, reference_table, and docs/config.md
                         (python -m pretrain.config_reference)

`python -m pretrain.config` (__main__.py) prints every key as one Markdown table.
"""

from __future__ import annotations

from pretrain.config.batch import (
    batch_split,
    check_auto_accumulation,
    grad_accum_nums,
    micro_batch_choices,
    per_rank_batch,
    with_micro_batch,
    with_world_size,
    without_gpu_memory,
)
from pretrain.config.loading import (
    HUB_KEYS,
    TOKENIZER_KEYS,
    activation_checkpointing,
    add_arguments,
    apply_overrides,
    check_context,
    drop_unused_preset_keys,
    from_args,
    load,
    loss_chunk_tokens,
    max_seq_len,
    one_run_length,
    parse_set,
    read_config_file,
    resolve,
    run_length_keys,
    save,
    to_dict,
)
from pretrain.config.presets import FINEWEB_EDU, PRESETS, debug, production, small
from pretrain.config.reference import field_docs, reference_table
from pretrain.config.schema import (
    SECTIONS,
    SHARD_SOURCES,
    CHECKPOINTING_MODES,
    SHARDED_MODES,
    COMPILE_MODES,
    CheckpointingMode,
    CompileMode,
    sources_with_path,
    Config,
    ConfigError,
    DataConfig,
    DebugConfig,
    EvaluationConfig,
    LoggingConfig,
    ModelConfig,
    MoEConfig,
    RopeScalingConfig,
    SystemConfig,
    TrainingConfig,
)

__all__ = [
    # schema
    "ConfigError",
    "Config",
    "ModelConfig",
    "MoEConfig",
    "RopeScalingConfig",
    "DataConfig",
    "TrainingConfig",
    "SystemConfig",
    "LoggingConfig",
    "EvaluationConfig",
    "DebugConfig",
    "SECTIONS",
    "sources_with_path",
    "SHARD_SOURCES",
    "CHECKPOINTING_MODES",
    "SHARDED_MODES",
    "CheckpointingMode",
    "COMPILE_MODES",
    "CompileMode",
    # presets
    "FINEWEB_EDU",
    "PRESETS",
    "production",
    "small",
    "debug",
    # loading
    "apply_overrides",
    "read_config_file",
    "parse_set",
    "resolve",
    "run_length_keys",
    "one_run_length",
    "HUB_KEYS",
    "TOKENIZER_KEYS",
    "drop_unused_preset_keys",
    "check_context",
    "activation_checkpointing",
    "loss_chunk_tokens",
    "max_seq_len",
    "with_world_size",
    "check_auto_accumulation",
    "per_rank_batch",
    "micro_batch_choices",
    "with_micro_batch",
    "without_gpu_memory",
    "batch_split",
    "grad_accum_nums",
    "to_dict",
    "save",
    "load",
    "add_arguments",
    "from_args",
    # reference
    "field_docs",
    "reference_table",
]
