"""A checkpoint for use outside training: read it as a config and plain tensors, and export it as
safetensors with a config.json that says how to rebuild the model.

    python -m pretrain.export --checkpoint runs/<id>/checkpoints/step_1000   # -> runs/<id>/export/

writes

    model.safetensors   every parameter under its plain name (tok_embed.weight,
                        layers.0.attention.wq.weight, ...), in the dtype it was trained in
    config.json         the model's shape and max_seq_len, the naming convention, the tokenizer
                        (kind, name, end-of-text id) and the dtype
    tokenizer.json      the tokenizer the model was trained with, when it has a file (bpe, huggingface)

each written to a temporary file and renamed, so a reader sees a whole file or none. Loading
needs only safetensors and this repository's model:

    state, meta = load_exported(out_dir)
    model = Transformer(ModelConfig(**meta["model"]), max_seq_len=meta["max_seq_len"])
    model.load_state_dict(state)

Finding what a checkpoint was made of (find_checkpoint, read_checkpoint, find_tokenizer_file,
open_tokenizer) lives here as well: generation needs the same config, weights and tokenizer.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NoReturn, TypedDict

import torch
from torch import Tensor

from pretrain import checkpoint
from pretrain import config as cfg
from pretrain import registry
from pretrain.checkpoint import CheckpointError
from pretrain.config import SHARD_SOURCES, Config
from pretrain.data import DataError
from pretrain.data.prepare import recipe_for
from pretrain.data.tokenizer import TOKENIZER_FILE, Tokenizer, huggingface_file, load_tokenizer, tokenizer_label
from pretrain.model import Transformer
from pretrain.resume import ResumeError, checkpoint_at
from pretrain.runfiles import atomic_write, atomic_write_text, os_error_message

FORMAT = "pretrain-llama"
FORMAT_VERSION = 1
WEIGHTS_FILE = "model.safetensors"
CONFIG_FILE = "config.json"


class ParameterNaming(TypedDict):
    """config.json's parameter_naming (PARAMETER_NAMING, or parameter_naming's variant of it)."""

    convention: str
    renamed: dict[str, str]
    rotary: str


PARAMETER_NAMING: ParameterNaming = {
    "convention": "Meta Llama (consolidated.*.pth): layers.{i}.attention.{wq,wk,wv,wo}, "
    "layers.{i}.feed_forward.{w1,w2,w3}, layers.{i}.attention_norm, layers.{i}.ffn_norm, norm, output",
    "renamed": {"tok_embed": "tok_embeddings"},
    "rotary": "adjacent channel pairs (2i, 2i+1), Meta's layout; Hugging Face transformers' Llama permutes "
    "wq and wk to rotate halves instead",
}
"""How the names in model.safetensors map onto other Llama code: config.json carries this."""


class TokenizerNotFound(CheckpointError):
    """The tokenizer a checkpoint was trained with is not on this machine; the message says how to get it."""


class OneLineParser(argparse.ArgumentParser):
    """argparse whose usage errors are one line on stderr (exit 2), like every other error here."""

    def __init__(self, *args: Any, error_prefix: str, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.error_prefix = error_prefix

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.error_prefix}: error: {message} (see --help)\n")


def add_checkpoint_argument(parser: argparse.ArgumentParser) -> None:
    """--checkpoint PATH, as every command that reads a checkpoint takes it (find_checkpoint)."""
    parser.add_argument(
        "--checkpoint",
        type=Path,
        required=True,
        metavar="PATH",
        help="a checkpoint directory (<run dir>/checkpoints/step_<N>), or a run directory for its latest checkpoint",
    )


# --- reading a checkpoint ---------------------------------------------------------------------


def find_checkpoint(path: Path) -> Path:
    """The checkpoint directory path names (absolute): path itself, or a run directory's latest
    checkpoint, as --resume means it: one whose state, config and model files are all there and
    whole (checkpoint_files.checkpoint_problem; the optimizer and random state are not needed here)."""
    try:
        return checkpoint_at(path)
    except ResumeError as error:  # its message starts with the path, for the option's name to go first
        raise CheckpointError(f"--checkpoint {error}") from None


def read_checkpoint(path: Path) -> tuple[Config, dict[str, Tensor]]:
    """The resolved config and the model's state dict (CPU tensors, plain names) of a checkpoint,
    in either format (full or sharded); CheckpointError when it is incomplete or does not fit."""
    config = checkpoint.load_config(path)
    state = checkpoint.load_model_state(path)
    check_weights(config, state, f"checkpoint {path}")
    return config, state


def expected_shapes(config: Config) -> dict[str, tuple[int, ...]]:
    """Name -> shape of every entry of the model's state dict, without allocating it (meta device)."""
    with torch.device("meta"):
        model = Transformer(config.model, max_seq_len=cfg.max_seq_len(config))
    return {name: tuple(tensor.shape) for name, tensor in model.state_dict().items()}


def check_weights(config: Config, state: dict[str, Tensor], where: str) -> None:
    """CheckpointError in one line when state is not exactly the model config describes
    (load_state_dict's own message spans many lines)."""
    expected, got = expected_shapes(config), {name: tuple(t.shape) for name, t in state.items()}
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


# --- export -----------------------------------------------------------------------------------


def export(
    state: dict[str, Tensor],
    config: Config,
    out_dir: Path,
    tokenizer_file: Path | None = None,
    *,
    source: dict[str, Any] | None = None,
) -> Path:
    """Write model.safetensors, config.json and, given tokenizer_file, a copy of it as
    tokenizer.json into out_dir; return it.

    Nothing is looked up: the caller knows where the tokenizer is (training: the prepared
    dataset's copy; the command line: find_tokenizer_file), and finding it from the config alone
    means recomputing the data recipe, which may hash the source files or reach the Hub.
    source, when given, is recorded in config.json as "exported_from" (the checkpoint, its step)."""
    from safetensors.torch import save_file  # only exporting needs safetensors

    tensors = standalone_tensors(state)
    atomic_write(out_dir / WEIGHTS_FILE, lambda tmp: save_file(tensors, str(tmp), metadata={"format": "pt"}))
    if tokenizer_file is not None:
        atomic_write(out_dir / TOKENIZER_FILE, lambda tmp: shutil.copyfile(tokenizer_file, tmp))
    # config.json last: it describes the other files, so it never points at weights not yet written.
    described = export_config(config, tensors, tokenizer_file)
    if source is not None:
        described["exported_from"] = source
    atomic_write_text(out_dir / CONFIG_FILE, json.dumps(described, indent=2) + "\n")
    return out_dir


def standalone_tensors(state: dict[str, Tensor]) -> dict[str, Tensor]:
    """CPU, contiguous tensors that share no storage with each other (safetensors refuses shared
    storage); a tensor is copied only when it has to be."""
    seen: set[int] = set()
    tensors = {}
    for name, tensor in state.items():
        tensor = tensor.detach().to("cpu").contiguous()
        if tensor.untyped_storage().data_ptr() in seen:
            tensor = tensor.clone()  # tied or a view of another entry: give it storage of its own
        seen.add(tensor.untyped_storage().data_ptr())
        tensors[name] = tensor
    return tensors


def parameter_naming(config: Config) -> ParameterNaming:
    """PARAMETER_NAMING, with the feed-forward names model.ffn's block uses where they are not Llama's."""
    if registry.FEED_FORWARDS[config.model.feed_forward].llama_layout:
        return PARAMETER_NAMING
    ffn = f"layers.{{i}}.feed_forward.* of model.ffn={config.model.ffn!r} (pretrain/registry.py), not Llama's w1, w2, w3"
    convention = PARAMETER_NAMING["convention"].replace("layers.{i}.feed_forward.{w1,w2,w3}", ffn)
    return PARAMETER_NAMING | {"convention": convention}


def export_config(config: Config, state: dict[str, Tensor], tokenizer_file: Path | None) -> dict[str, Any]:
    """What config.json says: enough to rebuild the model and to know its tokenizer."""
    max_seq_len = cfg.max_seq_len(config)
    dtypes = sorted({str(t.dtype).removeprefix("torch.") for t in state.values() if t.is_floating_point()})
    return {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "model": cfg.to_dict(config)["model"] | {"max_seq_len": max_seq_len},
        "max_seq_len": max_seq_len,
        "parameter_naming": parameter_naming(config),
        "tokenizer": tokenizer_description(config, tokenizer_file),
        "torch_dtype": dtypes[0] if len(dtypes) == 1 else dtypes,
        "num_parameters": sum(t.numel() for t in state.values()),
    }


def load_exported(out_dir: Path) -> tuple[dict[str, Tensor], dict[str, Any]]:
    """The tensors and the config.json of an export (see the module docstring to rebuild the model)."""
    from safetensors.torch import load_file

    config = json.loads((Path(out_dir) / CONFIG_FILE).read_text(encoding="utf-8"))
    return load_file(str(Path(out_dir) / WEIGHTS_FILE)), config


# --- command line -----------------------------------------------------------------------------


def default_output(checkpoint_dir: Path) -> Path:
    """<run dir>/export for a checkpoint in <run dir>/checkpoints/, else <checkpoint>/export."""
    if checkpoint_dir.parent.name == "checkpoints":
        return checkpoint_dir.parent.parent / "export"
    return checkpoint_dir / "export"


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    parser = OneLineParser(
        prog="python -m pretrain.export",
        error_prefix="export",
        description="Export a checkpoint's model as safetensors, with a config.json "
        "and its tokenizer.json, for use outside training.",
    )
    add_checkpoint_argument(parser)
    parser.add_argument(
        "--output", type=Path, metavar="DIR", help="where to write (default: <run dir>/export, or <checkpoint>/export)"
    )
    return parser.parse_args(argv)


def run(args: argparse.Namespace) -> Path:
    checkpoint_dir = find_checkpoint(args.checkpoint)
    config, state = read_checkpoint(checkpoint_dir)
    try:
        tokenizer_file = find_tokenizer_file(config, checkpoint_dir)
    except TokenizerNotFound as error:  # the weights are still worth exporting
        print(f"export: warning: {error}; exporting without tokenizer.json", file=sys.stderr)
        tokenizer_file = None
    source = {"checkpoint": str(checkpoint_dir), "steps_done": checkpoint.read_state(checkpoint_dir)["steps_done"]}
    out_dir = export(state, config, args.output or default_output(checkpoint_dir), tokenizer_file, source=source)
    count = sum(t.numel() for t in state.values())
    print(f"exported {checkpoint_dir} ({count / 1e6:.2f}M parameters) to {out_dir}")
    return out_dir


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        run(args)
    except CheckpointError as error:
        print(f"export: error: {error}", file=sys.stderr)
        return 2
    except OSError as error:  # an unwritable output directory, a full disk
        print(f"export: error: {os_error_message(error)}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
