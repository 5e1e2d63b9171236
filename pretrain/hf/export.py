"""A checkpoint for use outside training, in the form Hugging Face transformers loads as it is.

    python -m pretrain.export --checkpoint runs/<id>/checkpoints/step_1000   # -> runs/<id>/export/
        [--output DIR] [--dtype bfloat16|float32|float16] [--max-shard-size 5GB]

writes (training writes the same into <run dir>/export/ at its end)

    model.safetensors             the weights under transformers' names (LlamaForCausalLM, or
                                  MixtralForCausalLM for a mixture of experts), the query and key
                                  rows permuted to transformers' rotary layout, bf16 by default;
                                  a model over --max-shard-size (5 GB) is split into
                                  model-00001-of-0000N.safetensors, ... with
                                  model.safetensors.index.json
    config.json                   transformers' config (model_type llama or mixtral), and ours
                                  under "pretrain": the run's config, the tokenizer, the format
    generation_config.json        the end-of-text id as eos_token_id, ids past the tokenizer's
                                  vocabulary as suppress_tokens (greedy stays the default)
    tokenizer.json, tokenizer_config.json, special_tokens_map.json
                                  the run's tokenizer (pretrain/hf/tokenizer_files.py); a warning says
                                  when the export has none (pre-tokenized shards, a file not found)

so that AutoModelForCausalLM.from_pretrained(export) and AutoTokenizer.from_pretrained(export)
work unchanged, and so does lm-eval (`--model hf --model_args pretrained=<export>`); vLLM reads
the same layout (Llama's, Mixtral's as on the Hub), not tested here (it needs a GPU).
The conversion is pretrain/hf/transformers_form.py's; the files pretrain/hf/safetensors_shards.py's, each
written to a temporary file and renamed, config.json last, one tensor at a time: an export
never holds two copies of the model (under FSDP the ranks gather one weight at a time, and the
writer writes it before the next). A model whose feed-forward block is not Llama's has no
Hugging Face form: it is written in this project's own format (format "pretrain-llama": Meta
Llama's parameter names, the fused attention.wqkv split into wq, wk and wv as transformers' form
splits it, config.json our description only), with a warning.

generate and evaluate read an export (or any Hugging Face Llama or Mixtral directory) as they
read a checkpoint: `--checkpoint <run>/export` (pretrain/hf/exported.py). In Python:

    state, described = load_exported(out_dir)   # our parameter names, whichever format

Finding what a checkpoint was made of (find_checkpoint, read_checkpoint, find_tokenizer_file,
open_tokenizer) is pretrain/checkpoint/reading.py's, which generate and evaluate share.
"""

from __future__ import annotations

import argparse
import math
import json
import shlex
import sys
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, TypedDict

import torch
from torch import Tensor

from pretrain.checkpoint import save_restore as checkpoint
from pretrain import config as cfg
from pretrain import registry
from pretrain.checkpoint.save_restore import CheckpointError
from pretrain.config import Config
from pretrain.data.tokenizer import TOKENIZER_FILE
from pretrain.checkpoint.reading import (
    TokenizerNotFound,
    checkpoint_tensors,
    find_checkpoint,
    find_tokenizer_file,
    tokenizer_description,
)
from pretrain.hf.export_args import DEFAULT_DTYPE, parse_args
from pretrain.hf.exported import LEGACY_FORMAT, is_export, load_exported
from pretrain.hf.transformers_form import (
    HfFormatError,
    expected_hf_shapes,
    fused_parts,
    hf_config,
    hf_model_type,
    hf_names,
    to_hf,
)
from pretrain.hf.tokenizer_files import SPECIAL_TOKENS_MAP_FILE, TOKENIZER_CONFIG_FILE, HfTokenizerFiles, write_tokenizer_files
from pretrain.checkpoint.model_state import model_shapes, whole_tensors
from pretrain.distributed.parallel import has_fsdp
from pretrain.run.refusal import Refusal
from pretrain.run.files import atomic_write_text, os_error_message
from pretrain.hf.safetensors_shards import DEFAULT_MAX_SHARD_BYTES, TensorSpec, write_shards

FORMAT = "huggingface"
"""config.json's pretrain.format for an export in Hugging Face form (LEGACY_FORMAT: our own)."""
FORMAT_VERSION = 2
"""2: Hugging Face form by default, sharded safetensors in --dtype (1: our names, one file, the trained dtype)."""
CONFIG_FILE = "config.json"
GENERATION_CONFIG_FILE = "generation_config.json"
TOKENIZER_FILES = (TOKENIZER_FILE, TOKENIZER_CONFIG_FILE, SPECIAL_TOKENS_MAP_FILE)
__all__ = ["LEGACY_FORMAT", "load_exported"]  # re-exported: pretrain.hf.export.load_exported is documented


class ParameterNaming(TypedDict):
    """config.json's parameter_naming in this project's own format (PARAMETER_NAMING, or parameter_naming's variant of it)."""

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
"""How the names of an export in this project's own format map onto other Llama code."""


def parameter_naming(config: Config) -> ParameterNaming:
    """PARAMETER_NAMING, with the feed-forward names model.ffn's block uses where they are not Llama's."""
    if registry.FEED_FORWARDS[config.model.feed_forward].llama_layout:
        return PARAMETER_NAMING
    ffn = f"layers.{{i}}.feed_forward.* of model.ffn={config.model.ffn!r} (pretrain/registry.py), not Llama's w1, w2, w3"
    convention = PARAMETER_NAMING["convention"].replace("layers.{i}.feed_forward.{w1,w2,w3}", ffn)
    return PARAMETER_NAMING | {"convention": convention}


# --- export -----------------------------------------------------------------------------------


def export(
    state: Mapping[str, Tensor],
    config: Config,
    out_dir: Path,
    tokenizer_file: Path | None = None,
    *,
    source: dict[str, Any] | None = None,
    dtype: str = DEFAULT_DTYPE,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    warn: Callable[[str], None] | None = None,
) -> Path:
    """Write the whole state dict state (plain names) of config's model into out_dir (write_export)."""
    shapes = {name: tuple(tensor.shape) for name, tensor in state.items()}
    return write_export(
        iter(state.items()),
        shapes,
        config,
        out_dir,
        tokenizer_file,
        source=source,
        dtype=dtype,
        max_shard_bytes=max_shard_bytes,
        warn=warn,
    )


def export_model(
    model: torch.nn.Module,
    config: Config,
    out_dir: Path,
    tokenizer_file: Path | None,
    *,
    writes: bool,
    warn: Callable[[str], None] | None = None,
    source: dict[str, Any] | None = None,
) -> Path | None:
    """Export the model being trained, whatever wraps it; the rank that writes passes writes=True
    (source: what config.json records as exported_from).
    Under FSDP a collective: every rank gathers each weight in turn (model_state.whole_tensors),
    and the writer writes it before the next is gathered, so no process holds the whole model."""
    tensors = whole_tensors(model)
    try:
        if writes:
            try:
                return write_export(tensors, model_shapes(model), config, out_dir, tokenizer_file, warn=warn, source=source)
            except OSError as error:  # a full disk, an unwritable directory: the checkpoint holds the weights
                raise ExportNotWritten(not_written(error, (source or {}).get("checkpoint"))) from error
    finally:
        if has_fsdp(model):  # the other ranks gather every weight: take part in the rest, whatever happened here
            for _ in tensors:
                pass
    return None


class ExportNotWritten(Refusal):
    """The export at the end of training could not be written; the message says how to write it
    from the final checkpoint, which is saved."""


def not_written(error: OSError, checkpoint_dir: str | None) -> str:
    """One line for an export that failed on error: the file and the reason, then the fix."""
    again = f"`python -m pretrain.export --checkpoint {shlex.quote(str(checkpoint_dir)) if checkpoint_dir else '<checkpoint>'}`"
    saved = f"the final checkpoint {checkpoint_dir} is saved but not exported" if checkpoint_dir else "not exported"
    return f"{os_error_message(error)}; {saved}: make room (or make the directory writable), then {again} exports it"


def write_export(
    tensors: Iterator[tuple[str, Tensor]],
    shapes: dict[str, tuple[int, ...]],
    config: Config,
    out_dir: Path,
    tokenizer_file: Path | None = None,
    *,
    source: dict[str, Any] | None = None,
    dtype: str = DEFAULT_DTYPE,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    warn: Callable[[str], None] | None = None,
) -> Path:
    """Write config's model into out_dir in Hugging Face form (see the module docstring); return out_dir.

    tensors yields (plain name, whole tensor) in shapes' order, one at a time, and each is
    converted and written before the next is asked for. A model with no Hugging Face form (a
    feed-forward block that is not Llama's) is written in this project's own format instead,
    with a warning: training never fails at its end for want of a form. Nothing is looked up:
    the caller knows where the tokenizer is (training: the prepared dataset's copy; the command
    line: find_tokenizer_file). source, when given, is recorded as exported_from."""
    warn = warn or _warn_on_stderr
    try:
        hf_model_type(config.model)
        hf = True
    except HfFormatError as error:
        warn(f"{error}; exported in this project's own format ({LEGACY_FORMAT}), which transformers does not load")
        hf = False
    max_seq_len = cfg.max_seq_len(config)
    expected = expected_hf_shapes(config.model, max_seq_len) if hf else own_shapes(shapes, config)
    specs = [
        TensorSpec(piece, expected[piece], dtype)
        for name in shapes
        for piece in (hf_names(name, config.model) if hf else [own for own, _ in own_parts(name, shapes[name], config)])
    ]
    out_dir.mkdir(parents=True, exist_ok=True)
    write_shards(out_dir, specs, _converted(tensors, config, dtype, hf), max_shard_bytes)
    files = write_tokenizer_files(config, tokenizer_file, out_dir, max_seq_len)
    if files.lacking:
        warn(files.lacking)
    for stale in set(TOKENIZER_FILES) - set(files.written):  # an earlier export's, which would not be this model's
        (out_dir / stale).unlink(missing_ok=True)
    own = own_description(config, shapes, files, tokenizer_file, dtype, hf)
    if source is not None:
        own["exported_from"] = source
    if hf:
        generation = generation_config(files, own["tokenizer"]["vocab_size"], config.model.vocab_size)
        atomic_write_text(out_dir / GENERATION_CONFIG_FILE, json.dumps(generation, indent=2) + "\n")
        described = hf_config(config.model, max_seq_len, bos_id=files.bos_id, eos_id=files.eos_id, dtype=dtype)
        described["pretrain"] = own
    else:
        (out_dir / GENERATION_CONFIG_FILE).unlink(missing_ok=True)
        described = own
    # config.json last: it describes the other files, so it never points at weights not yet written.
    atomic_write_text(out_dir / CONFIG_FILE, json.dumps(described, indent=2) + "\n")
    return out_dir


def _warn_on_stderr(message: str) -> None:
    print(f"export: warning: {message}", file=sys.stderr)


def _converted(tensors: Iterator[tuple[str, Tensor]], config: Config, dtype: str, hf: bool) -> Iterator[tuple[str, Tensor]]:
    """(written name, tensor in dtype) for every piece of every tensor, taken one at a time:
    nothing here holds a tensor once its pieces are written."""
    torch_dtype = getattr(torch, dtype)
    for name, tensor in tensors:
        if hf:
            pieces = to_hf(name, tensor, config.model)
        else:  # Meta's names: a fused weight's parts, views of its rows
            parts = own_parts(name, tuple(tensor.shape), config)
            pieces = list(zip([own for own, _ in parts], tensor.split([shape[0] for _, shape in parts]), strict=True))
        del tensor
        while pieces:
            written_name, piece = pieces.pop(0)
            yield written_name, piece.to(torch_dtype)
            del piece


def own_parts(name: str, shape: tuple[int, ...], config: Config) -> list[tuple[str, tuple[int, ...]]]:
    """The tensors (Meta Llama's name, shape) our entry name of shape is written as in this project's
    own format: a fused weight's parts (pretrain/model/fused_layout.py), anything else as it is."""
    parts = fused_parts(name, config.model)
    return [(part, (rows, *shape[1:])) for part, rows in parts] if parts else [(name, shape)]


def own_shapes(shapes: dict[str, tuple[int, ...]], config: Config) -> dict[str, tuple[int, ...]]:
    """Every tensor of the own format's export, by name, with its shape (own_parts)."""
    return {own: part_shape for name, shape in shapes.items() for own, part_shape in own_parts(name, shape, config)}


def generation_config(files: HfTokenizerFiles, tokenizer_vocab: int | None, model_vocab: int | None) -> dict[str, Any]:
    """generation_config.json: the end-of-text id as eos and pad, and the ids past the tokenizer's
    vocabulary (a model's may be rounded up beyond it) suppressed, as pretrain.evaluation.generate never draws
    them; greedy search stays transformers' default."""
    generation: dict[str, Any] = {"bos_token_id": files.bos_id, "eos_token_id": files.eos_id, "pad_token_id": files.eos_id}
    if tokenizer_vocab is not None and model_vocab is not None and tokenizer_vocab < model_vocab:
        generation["suppress_tokens"] = list(range(tokenizer_vocab, model_vocab))
    return {key: value for key, value in generation.items() if value is not None}


def own_description(
    config: Config, shapes: dict[str, tuple[int, ...]], files: HfTokenizerFiles, tokenizer_file: Path | None, dtype: str, hf: bool
) -> dict[str, Any]:
    """What this project says about an export (config.json's "pretrain", or all of it in its own
    format): the format, the run's config (so that generate and evaluate treat the export as
    they treat its checkpoint), the model, the tokenizer, the naming and the dtype."""
    max_seq_len = cfg.max_seq_len(config)
    exported_tokenizer = TOKENIZER_FILE if TOKENIZER_FILE in files.written else None
    return {
        "format": FORMAT if hf else LEGACY_FORMAT,
        "format_version": FORMAT_VERSION,
        "model": cfg.to_dict(config)["model"] | {"max_seq_len": max_seq_len},
        "max_seq_len": max_seq_len,
        "parameter_naming": hf_parameter_naming(config) if hf else parameter_naming(config),
        "tokenizer": tokenizer_description(config, tokenizer_file) | {"file": exported_tokenizer},
        "torch_dtype": dtype,
        "num_parameters": sum(math.prod(shape) for shape in shapes.values()),
        "run_config": cfg.to_dict(config),
    }


def hf_parameter_naming(config: Config) -> dict[str, str]:
    """config.json's pretrain.parameter_naming for an export in Hugging Face form."""
    if hf_model_type(config.model) == "mixtral":
        convention = (
            "Hugging Face transformers' MixtralForCausalLM, each expert its own "
            "model.layers.{i}.block_sparse_moe.experts.{j}.{w1,w2,w3}.weight (as Mixtral on the Hub), "
            "the router model.layers.{i}.block_sparse_moe.gate.weight"
        )
    else:
        convention = (
            "Hugging Face transformers' LlamaForCausalLM: model.embed_tokens, "
            "model.layers.{i}.self_attn.{q,k,v,o}_proj, model.layers.{i}.mlp.{gate,up,down}_proj, "
            "model.layers.{i}.{input,post_attention}_layernorm, model.norm, lm_head"
        )
    return {
        "convention": convention,
        "rotary": "rotate halves, as transformers does: the rows of q_proj and k_proj are permuted "
        "within each head from training's adjacent pairs (pretrain/hf/transformers_form.py permute_qk)",
    }


# --- command line -----------------------------------------------------------------------------


def default_output(checkpoint_dir: Path) -> Path:
    """<run dir>/export for a checkpoint in <run dir>/checkpoints/, else <checkpoint>/export."""
    if checkpoint_dir.parent.name == "checkpoints":
        return checkpoint_dir.parent.parent / "export"
    return checkpoint_dir / "export"


def run(args: argparse.Namespace) -> Path:
    if args.output is not None and args.output.exists() and not args.output.is_dir():
        raise CheckpointError(f"--output {args.output} is a file; give a directory (it is created if missing)")
    checkpoint_dir = find_checkpoint(args.checkpoint)
    if is_export(checkpoint_dir):
        raise CheckpointError(f"--checkpoint {checkpoint_dir} is an export already; give a checkpoint or a run directory")
    config, shapes, tensors = checkpoint_tensors(checkpoint_dir)
    try:
        tokenizer_file = find_tokenizer_file(config, checkpoint_dir)
    except TokenizerNotFound as error:  # the weights are still worth exporting
        _warn_on_stderr(str(error))  # and write_export says what the export lacks
        tokenizer_file = None
    source = {"checkpoint": str(checkpoint_dir), "steps_done": checkpoint.read_state(checkpoint_dir)["steps_done"]}
    out_dir = args.output or default_output(checkpoint_dir)
    write_export(
        tensors, shapes, config, out_dir, tokenizer_file, source=source, dtype=args.dtype, max_shard_bytes=args.max_shard_bytes
    )
    count = sum(math.prod(shape) for shape in shapes.values())
    print(f"exported {checkpoint_dir} ({count / 1e6:.2f}M parameters) to {out_dir}")
    return out_dir


def main(argv: Sequence[str] | None = None) -> int:
    return run_command(parse_args(sys.argv[1:] if argv is None else argv))


def run_command(args: argparse.Namespace) -> int:
    """The command on arguments already read (parse_args): its output, or one error line and its exit code."""
    try:
        run(args)
    except Refusal as error:
        print(f"export: error: {error}", file=sys.stderr)
        return error.exit_code
    except OSError as error:  # an unwritable output directory, a full disk
        print(f"export: error: {os_error_message(error)}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
