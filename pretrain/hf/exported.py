"""An export read back as training's config and state dict: ours in either format, or any Hugging
Face Llama or Mixtral directory (config.json, safetensors weights, tokenizer.json), so that
generate and evaluate take `--checkpoint <run>/export` or a downloaded model as they take a
checkpoint.

- Hugging Face form (config.json has model_type; pretrain/hf/export.py writes it): the model from
  config.json's own fields (model_fields_from_hf), the weights renamed to ours and the q/k rows
  permuted back (pretrain/hf/transformers_form.py). Our exports also carry the run's config under
  "pretrain", which generate and evaluate then read as they read a checkpoint's (the tokenizer,
  whether it trained under bf16 autocast); a directory from elsewhere uses its tokenizer.json,
  and one with tied embeddings (Llama 3.2's: no lm_head.weight) gets the embedding as its output
  projection, as training.init_from does.
- this project's own format ("format": "pretrain-llama", a model with no Hugging Face form, or
  exports made before the Hugging Face form): Meta Llama's names, the separate wq, wk, wv (and
  w1, w3) joined into the fused weights the model holds (pretrain/model/fused_layout.py).

Either way every weight file is checked against its header before safetensors opens it
(pretrain/hf/safetensors_header.py check_header): a truncated one is a CheckpointError naming its size.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from pretrain import config as cfg
from pretrain.checkpoint.files import CheckpointError
from pretrain.config import Config
from pretrain.data import first_line
from pretrain.hf.safetensors_header import SafetensorsDamage, check_header
from pretrain.hf.transformers_form import (
    HF_EMBEDDING,
    HF_OUTPUT,
    HfFormatError,
    expected_hf_shapes,
    from_hf,
    hf_names,
    model_fields_from_hf,
    tied_output,
)
from pretrain.model.fused_layout import fuse_separate
from pretrain.model.transformer import Transformer
from pretrain.hf.safetensors_shards import INDEX_FILE, SINGLE_FILE, WeightFiles, weight_map

CONFIG_FILE = "config.json"
LEGACY_FORMAT = "pretrain-llama"
IGNORED_TENSORS = ("rotary_emb.inv_freq",)
"""Tensors some Hugging Face Llama checkpoints carry that the model computes (older transformers saved them)."""


def is_export(path: Path) -> bool:
    """Whether path is an export directory: a config.json with model_type (Hugging Face form) or
    this project's own export format (a checkpoint's config.json is the run's config: neither)."""
    try:
        described = json.loads((path / CONFIG_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return False
    return isinstance(described, dict) and ("model_type" in described or described.get("format") == LEGACY_FORMAT)


def read_export(path: Path) -> tuple[Config, dict[str, Tensor]]:
    """The config (the run's when the export has it) and our state dict of an export directory;
    CheckpointError in one line for what cannot be read."""
    state, described = load_exported(path)
    return export_config(described, path), state


def load_exported(out_dir: Path) -> tuple[dict[str, Tensor], dict[str, Any]]:
    """The tensors of an export under our names (tok_embed.weight, layers.0.attention.wqkv.weight,
    ...) and its config.json. Rebuild the model with
    Transformer(ModelConfig(**model_fields(described)), max_seq_len=...), or read_export's config."""
    path = Path(out_dir)
    described = _read_config(path)
    files_by_name = _checked_weight_map(path)
    from safetensors import SafetensorError

    try:
        if "model_type" not in described:  # our own format: Meta's names, the separate weights to fuse
            with WeightFiles(path, files_by_name) as files:
                state = {name: files.get(name) for name in files_by_name}
            return fuse_separate(state, _model(described, path)[0]), described
        model, max_seq_len = _model(described, path)
        return _from_hf_files(path, files_by_name, described, model, max_seq_len), described
    except (OSError, SafetensorError) as error:  # a file changed since it was checked
        raise CheckpointError(f"export {path}: cannot read its weights ({first_line(error)})") from None


def _checked_weight_map(path: Path) -> dict[str, str]:
    """Tensor name -> file of an export's weights, every file's header checked first (check_header:
    a truncated or damaged file is one line naming its size and the size its header describes,
    before safetensors opens it)."""
    try:
        if not (path / INDEX_FILE).is_file() and (path / SINGLE_FILE).is_file():
            check_header(path / SINGLE_FILE)  # weight_map opens it to list its tensors
        files_by_name = weight_map(path)
        for file in sorted(set(files_by_name.values())):
            check_header(path / file)
        return files_by_name
    except SafetensorsDamage as error:
        raise CheckpointError(f"export {path}: {error}") from None
    except (OSError, ValueError) as error:
        raise CheckpointError(f"export {path}: cannot find its weights ({first_line(error)})") from None


def model_fields(described: dict[str, Any]) -> dict[str, Any]:
    """ModelConfig's fields (max_seq_len among them) of an export's config.json, any format."""
    if "model_type" not in described:
        return dict(described["model"])
    if isinstance(described.get("pretrain"), dict):
        return dict(described["pretrain"]["model"])
    return model_fields_from_hf(described)


def export_config(described: dict[str, Any], path: Path) -> Config:
    """The config generate and evaluate use for an export: the run's own (our Hugging Face form
    keeps it), else one with the export's model and its tokenizer."""
    where = f"export {path}: {CONFIG_FILE}"
    own = described.get("pretrain") if "model_type" in described else described
    try:
        if isinstance(own, dict) and isinstance(own.get("run_config"), dict):
            run_config = own["run_config"]
            return dataclasses.replace(
                cfg.apply_overrides(Config(), run_config, where), preset=str(run_config.get("preset", Config.preset))
            )
        model = model_fields(described)
        data = _data_section(own["tokenizer"]) if isinstance(own, dict) else _foreign_tokenizer(path)
        data["context_length"] = model.get("max_seq_len") or data.get("context_length", 2048)
        return cfg.apply_overrides(Config(), {"model": model, "data": data}, where)
    except HfFormatError as error:  # its message names config.json
        raise CheckpointError(f"export {path}: {error}") from None
    except cfg.ConfigError as error:
        raise CheckpointError(str(error)) from None
    except (KeyError, TypeError) as error:
        raise CheckpointError(f"{where} is not an export's (no {error})") from None


def _data_section(tokenizer: dict[str, Any]) -> dict[str, Any]:
    """data.* for an export that describes its tokenizer only (kind, name, vocab_size)."""
    kind = tokenizer.get("kind")
    if kind == "bpe":
        return {"tokenizer": "bpe", "bpe_vocab_size": tokenizer["vocab_size"] or 8192}
    if kind in ("huggingface", "tiktoken"):
        return {"tokenizer": kind, "tokenizer_name": tokenizer["name"]}
    if kind is None:  # pre-tokenized shards of an unknown tokenizer: open_tokenizer says so
        return {"source": "llmc"}
    return {"tokenizer": kind}


def _foreign_tokenizer(path: Path) -> dict[str, Any]:
    """data.* for a Hugging Face directory not made here: its tokenizer.json, ending texts with
    the eos_token its tokenizer_config.json names (else pretrain/data/tokenizer.py's usual ones)."""
    data: dict[str, Any] = {"tokenizer": "huggingface", "tokenizer_name": str(path)}
    try:
        eos = json.loads((path / "tokenizer_config.json").read_text(encoding="utf-8")).get("eos_token")
    except (OSError, ValueError, AttributeError):
        eos = None
    eos = eos.get("content") if isinstance(eos, dict) else eos
    if isinstance(eos, str) and eos:
        data["eot_token"] = eos
    return data


def _read_config(path: Path) -> dict[str, Any]:
    try:
        described = json.loads((path / CONFIG_FILE).read_text(encoding="utf-8"))
    except OSError as error:
        raise CheckpointError(f"export {path}: cannot read {CONFIG_FILE} ({error.strerror})") from None
    except ValueError as error:
        raise CheckpointError(f"export {path}: {CONFIG_FILE} is not JSON ({error})") from None
    if not isinstance(described, dict):
        raise CheckpointError(f"export {path}: {CONFIG_FILE} is not a JSON object")
    return described


def _model(described: dict[str, Any], path: Path) -> tuple[cfg.ModelConfig, int]:
    try:
        fields = model_fields(described)
        max_seq_len = fields.pop("max_seq_len", None) or 2048
        return cfg.ModelConfig(**fields, max_seq_len=max_seq_len), max_seq_len
    except HfFormatError as error:  # its message names config.json
        raise CheckpointError(f"export {path}: {error}") from None
    except cfg.ConfigError as error:
        raise CheckpointError(f"export {path}: {CONFIG_FILE}: {error}") from None


def _from_hf_files(
    path: Path, files_by_name: dict[str, str], described: dict[str, Any], model: cfg.ModelConfig, max_seq_len: int
) -> dict[str, Tensor]:
    """Our state dict from Hugging Face tensors, one of our tensors at a time; a tied output
    projection (tied_output) read from the embedding, as training.init_from reads it."""
    expected = expected_hf_shapes(model, max_seq_len)
    source = {name: name for name in files_by_name if not name.endswith(IGNORED_TENSORS)}  # the tensor each is read from
    if tied_output(described, source):
        source[HF_OUTPUT] = HF_EMBEDDING
    problems = []
    if missing := sorted(expected.keys() - source.keys()):
        problems.append(f"{len(missing)} missing ({_some(missing)})")
    if unexpected := sorted(source.keys() - expected.keys()):
        problems.append(f"{len(unexpected)} unexpected ({_some(unexpected)})")
    if problems:
        what = "; ".join(problems)
        raise CheckpointError(f"export {path}: the weights do not fit the model its {CONFIG_FILE} describes: {what}")
    with torch.device("meta"):
        names = list(Transformer(model, max_seq_len=max_seq_len).state_dict())
    state = {}
    with WeightFiles(path, files_by_name) as files:
        for name in names:
            pieces = [files.get(source[hf_name]) for hf_name in hf_names(name, model)]
            for hf_name, piece in zip(hf_names(name, model), pieces, strict=True):
                if tuple(piece.shape) != expected[hf_name]:
                    raise CheckpointError(
                        f"export {path}: {hf_name} has shape {list(piece.shape)}, "
                        f"but its {CONFIG_FILE} makes it {list(expected[hf_name])}"
                    )
            state[name] = from_hf(name, pieces, model)
    return state


def _some(names: list[str]) -> str:
    return ", ".join(names[:3]) + (", ..." if len(names) > 3 else "")
