"""What a checkpoint (or an export) was made of, for the commands that read one (generate,
evaluate, export): where it is (find_checkpoint), its config and weights, whole or one tensor at a
time (read_checkpoint, checkpoint_tensors), checked against the model its config describes, and
the tokenizer it was trained with (find_tokenizer_file, open_tokenizer). The command-line pieces
those commands share are pretrain/checkpoint/arguments.py's."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from pretrain.checkpoint import save_restore as checkpoint
from pretrain import config as cfg
from pretrain import registry
from pretrain.checkpoint.save_restore import CheckpointError
from pretrain.config import SHARD_SOURCES, Config
from pretrain.data import DataError
from pretrain.data.prepare import recipe_for
from pretrain.data.tokenizer import TOKENIZER_FILE, Tokenizer, huggingface_file, load_tokenizer, tokenizer_label
from pretrain.checkpoint.dcp_files import DIRECTORY, read_dcp_metadata
from pretrain.hf.exported import is_export, read_export
from pretrain.model.transformer import Transformer
from pretrain.checkpoint.model_state import read_sharded_tensors, sharded_model_shapes
from pretrain.checkpoint.resume import ResumeError, checkpoint_at
from pretrain.checkpoint.separate_layout import shapes_as_saved
from pretrain.model.fused_layout import fuse_separate, part_names


class TokenizerNotFound(CheckpointError):
    """The tokenizer a checkpoint was trained with is not on this machine; the message says how to get it."""


# --- reading a checkpoint ---------------------------------------------------------------------


def find_checkpoint(path: Path) -> Path:
    """The checkpoint directory path names (absolute): path itself, or a run directory's latest
    checkpoint, as --resume means it: one whose state, config and model files are all there and
    whole (checkpoint_files.checkpoint_problem; the optimizer and random state are not needed here).
    An export directory (pretrain/hf/exported.py) is taken as it is."""
    if is_export(path):
        return path.resolve()
    try:
        return checkpoint_at(path)
    except ResumeError as error:  # its message starts with the path, for the option's name to go first
        raise CheckpointError(f"--checkpoint {error}") from None


def read_checkpoint(path: Path) -> tuple[Config, dict[str, Tensor]]:
    """The resolved config and the model's state dict (CPU tensors, plain names) of a checkpoint,
    in either format (full or sharded), or of an export; CheckpointError when it is incomplete or
    does not fit."""
    if is_export(path):
        config, state = read_export(path)
        check_weights(config, state, f"export {path}")
        # Meta's separate names (wq/wk/wv, w1/w3) where the model has them fused: concatenated
        return config, fuse_separate(state, config.model)
    config = checkpoint.load_config(path)
    state = checkpoint.load_model_state(path)
    check_weights(config, state, f"checkpoint {path}")
    return config, state


def checkpoint_tensors(path: Path) -> tuple[Config, dict[str, tuple[int, ...]], Iterator[tuple[str, Tensor]]]:
    """A checkpoint's config, the shapes of its model's tensors (checked against the config) and
    the tensors themselves, whole, one at a time: a sharded checkpoint's are read from its DCP
    files one key at a time, a full one's model.pt is memory-mapped (a tensor's pages are read
    when it is written). So an export never holds the whole model. The names and shapes are the
    model's: a checkpoint of the separate layout (before the fused projections) gives each fused
    weight concatenated from its parts when it comes."""
    config = checkpoint.load_config(path)
    checkpoint.read_state(path)
    expected = expected_shapes(config)
    names = list(expected)  # the model's order
    if (path / DIRECTORY).is_dir():
        metadata = read_dcp_metadata(path)
        check_shapes(config, sharded_model_shapes(metadata), f"checkpoint {path}")

        def read(keys: list[str]) -> list[Tensor]:
            return [tensor for _, tensor in read_sharded_tensors(path, metadata, keys)]

        return config, expected, _fused_tensors(names, sharded_model_shapes(metadata), read)
    state = checkpoint.load_model_state(path, as_saved=True)
    check_weights(config, state, f"checkpoint {path}")
    return (
        config,
        expected,
        _fused_tensors(names, {name: tuple(t.shape) for name, t in state.items()}, lambda keys: [state.pop(key) for key in keys]),
    )


def _fused_tensors(
    names: list[str], saved: dict[str, tuple[int, ...]], read: Callable[[list[str]], list[Tensor]]
) -> Iterator[tuple[str, Tensor]]:
    """(name, tensor) for each of names, one at a time, read(keys) giving the saved tensors keys;
    a fused weight the checkpoint holds as its separate parts is their concatenation."""
    for name in names:
        parts = part_names(name)
        if name not in saved and parts is not None and all(part in saved for part in parts):
            yield name, torch.cat(read(parts), dim=0)
        else:
            yield name, read([name])[0]


def expected_shapes(config: Config) -> dict[str, tuple[int, ...]]:
    """Name -> shape of every entry of the model's state dict, without allocating it (meta device)."""
    with torch.device("meta"):
        model = Transformer(config.model, max_seq_len=cfg.max_seq_len(config))
    return {name: tuple(tensor.shape) for name, tensor in model.state_dict().items()}


def check_weights(config: Config, state: dict[str, Tensor], where: str) -> None:
    """CheckpointError in one line when state is not exactly the model config describes
    (load_state_dict's own message spans many lines)."""
    check_shapes(config, {name: tuple(t.shape) for name, t in state.items()}, where)


def check_shapes(config: Config, got: dict[str, tuple[int, ...]], where: str) -> None:
    """check_weights, from the tensors' shapes alone; got may hold the separate layout's weights
    (before the fused projections): they are checked under their own names."""
    expected = shapes_as_saved(expected_shapes(config), got, config.model)
    problems = []
    if missing := sorted(expected.keys() - got.keys()):
        problems.append(f"{len(missing)} missing ({_some(missing)})")
    if unexpected := sorted(got.keys() - expected.keys()):
        problems.append(f"{len(unexpected)} unexpected ({_some(unexpected)})")
    if wrong := sorted(name for name in expected.keys() & got.keys() if expected[name] != got[name]):
        problems.append(
            "wrong shape: "
            + ", ".join(f"{name} {list(got[name])} instead of {list(expected[name])}" for name in wrong[:2])
            + (" ..." if len(wrong) > 2 else "")
        )
    if problems:
        raise CheckpointError(f"{where}: the weights do not fit the model its config.json describes: {'; '.join(problems)}")


def _some(names: list[str]) -> str:
    return ", ".join(names[:3]) + (", ..." if len(names) > 3 else "")


# --- the tokenizer a checkpoint was trained with -----------------------------------------------


def find_tokenizer_file(config: Config, checkpoint_dir: Path) -> Path | None:
    """The tokenizer.json the model was trained with (None for byte and tiktoken, which have none).

    Looked for, offline first: in the checkpoint directory (where a copy may be put by hand), in
    the prepared dataset (preparing copies it there), then for a huggingface tokenizer where
    data.tokenizer_name points (a file, or the Hugging Face cache). TokenizerNotFound otherwise."""
    data = config.data
    if not registry.TOKENIZERS[data.tokenizer].file:
        return None
    candidates = [checkpoint_dir / TOKENIZER_FILE]
    if (dataset := _dataset_dir(config)) is not None:
        candidates.append(dataset / TOKENIZER_FILE)
    for candidate in candidates:
        if candidate.is_file():
            return candidate
    if data.tokenizer == "huggingface":
        try:
            return huggingface_file(data.tokenizer_name)
        except DataError as error:
            raise TokenizerNotFound(f"the model's tokenizer (huggingface {data.tokenizer_name}) is not here: {error}") from None
    what = f"bpe, {data.bpe_vocab_size} ids, trained on its data" if data.tokenizer == "bpe" else data.tokenizer
    raise TokenizerNotFound(
        f"the model's tokenizer ({what}) is not in "
        f"{' or '.join(map(str, candidates))}; prepare the dataset again with the run's config "
        f"(python3 prepare_dataset.py --config {checkpoint_dir / 'config.json'}), or copy the run's "
        f"tokenizer.json into {checkpoint_dir}"
    )


def _dataset_dir(config: Config) -> Path | None:
    """Where the run's dataset was prepared, when its source can still be identified here."""
    try:
        return recipe_for(config.data).path
    except (DataError, OSError):  # the source's files moved, the Hub is unreachable: look elsewhere
        return None


def shards_without_tokenizer(config: Config) -> bool:
    """Pre-tokenized shards do not use data.tokenizer: left at "byte", nothing says which made them."""
    return config.data.source in SHARD_SOURCES and config.data.tokenizer == "byte"


def open_tokenizer(config: Config, tokenizer_file: Path | None) -> Tokenizer:
    """The tokenizer of config, from tokenizer_file for bpe and huggingface (find_tokenizer_file).
    TokenizerNotFound when it is unknown or not available here."""
    data = config.data
    if shards_without_tokenizer(config):
        raise TokenizerNotFound(
            f"the model was trained on pre-tokenized {data.source} shards, and its config does "
            "not say which tokenizer made them; set data.tokenizer and data.tokenizer_name "
            "in the checkpoint's config.json (for example tiktoken and gpt2)"
        )
    if registry.TOKENIZERS[data.tokenizer].file and tokenizer_file is None:
        raise TokenizerNotFound(f"the {data.tokenizer} tokenizer needs its tokenizer.json")
    try:
        return load_tokenizer(data, tokenizer_file)
    except DataError as error:  # tiktoken's files not downloaded, a damaged tokenizer.json
        raise TokenizerNotFound(f"the model's tokenizer: {error}") from None


def tokenizer_description(config: Config, tokenizer_file: Path | None) -> dict[str, Any]:
    """kind, name, end-of-text id and vocabulary of the model's tokenizer (None where unknown)."""
    data = config.data
    kind = None if shards_without_tokenizer(config) else data.tokenizer
    name = data.tokenizer_name if registry.TOKENIZERS[data.tokenizer].takes_name else tokenizer_label(data)
    description = {
        "kind": kind,
        "name": name if kind else None,
        "eot_id": None,
        "vocab_size": None,
        "file": TOKENIZER_FILE if tokenizer_file else None,
    }
    try:
        tokenizer = open_tokenizer(config, tokenizer_file)
    except TokenizerNotFound:
        return description
    return description | {"eot_id": tokenizer.eot_id, "vocab_size": tokenizer.vocab_size}
