"""Training configuration: a tree of frozen dataclasses, named presets, strict loading.

A config is resolved in layers: a preset, then JSON files, then `--max-steps` and
`--set section.key=value`. Every layer is validated as it is applied, so an error names
the layer it came from (the file, or the option), the key path and, for a typo, the
closest valid key. Nothing here imports torch: the launcher resolves configs too.

This package's __init__ is its public face; import from it (`from pretrain import config as cfg`,
`from pretrain.config import Config`). The code lives in layers, each importing only
the ones before it:

    schema.py            ConfigError, the section dataclasses (fields, defaults, the docstring
                         under each field, per-section checks), Config, SECTIONS,
                         sources_with_path, SHARD_SOURCES
    presets.py           production(), small(), debug(), PRESETS
    loading.py           strict loading: overrides, JSON files, --set, resolve() and its
                         whole-config rules (one run length, context, unused preset keys),
                         with_world_size, to_dict/save/load, add_arguments/from_args
    reference.py         field_docs, reference_table, and docs/config.md
                         (python -m pretrain.config_reference)

`python -m pretrain.config` (__main__.py) prints every key as one Markdown table.
"""

from __future__ import annotations

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
    with_world_size,
)
from pretrain.config.presets import FINEWEB_EDU, PRESETS, debug, production, small
from pretrain.config.reference import field_docs, reference_table
from pretrain.config.schema import (
    SECTIONS,
    SHARD_SOURCES,
    CHECKPOINTING_MODES,
    CheckpointingMode,
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
    "CheckpointingMode",
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
    "to_dict",
    "save",
    "load",
    "add_arguments",
    "from_args",
    # reference
    "field_docs",
    "reference_table",
]
