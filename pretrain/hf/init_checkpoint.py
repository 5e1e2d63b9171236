"""The Hugging Face checkpoint a run starts from (training.init_from): where it is, what it holds,
and whether it fits the model config, checked before any worker starts.

Where: a local directory, or a Hub model id (owner/name, or owner/name@revision) found in the
Hugging Face cache, downloaded into it where the Hub can be reached (only config.json and the
safetensors), and offline (HF_HUB_OFFLINE, or no network) taken from what the cache holds, as the
data's Hub files are (pretrain/data/hub_client.py). What: config.json, and every tensor's name,
dtype and shape from the safetensors headers (8 bytes of length, then JSON), no weight read.
Whole: each file's size is what its header describes (data_offsets consistent with dtype x
shape), so a truncated download is refused here, not by safetensors in a worker. Fits: every
tensor of the model's Hugging Face form (pretrain/hf/transformers_form.py) is there with its shape, and the
fields that change what the model computes without changing a shape (heads, rotary base and
scaling, norm epsilon, experts per token) agree. Each refusal is one line (InitFromError, a
ConfigError: exit 2) naming the tensor or field, both values, and every key that config.json
says to set (all of them, so that one change fixes the command).

No torch here: the launcher runs this (pretrain/hf/init_from.py loads the weights in the workers).
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pretrain.config import Config, ConfigError, ModelConfig, RopeScalingConfig, max_seq_len
from pretrain.data import DataError, first_line
from pretrain.data.hub_client import access_error, download_command, is_commit, offline_error
from pretrain.hf.safetensors_header import FIX_DAMAGED, SafetensorsDamage, check_header
from pretrain.hf.transformers_form import (
    HF_EMBEDDING,
    HF_OUTPUT,
    MIXTRAL,
    HfFormatError,
    expected_hf_shapes,
    model_fields_from_hf,
    tied_output,
)

Log = Callable[[str], None]

INDEX_FILE = "model.safetensors.index.json"
HUB_FILES = ["config.json", "model.safetensors", "model-*.safetensors", INDEX_FILE, "tokenizer.json", "tokenizer_config.json"]
"""What a run needs of a Hub model repository: never its pickles (.bin, .pt) or duplicates (consolidated.*);
its tokenizer, to be compared with the run's (pretrain/hf/init_tokenizer.py)."""
PICKLES = ("*.bin", "*.pt", "*.pth", "*.ckpt", "*.pkl")
FLOAT_DTYPES = {"F64", "F32", "F16", "BF16"}
HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+(@[\w./-]+)?")
TIED, EMBEDDING = HF_OUTPUT, HF_EMBEDDING
"""A Llama whose config.json says tie_word_embeddings stores no lm_head: the embedding stands for it."""
BUFFERS = re.compile(r".*\.rotary_emb\.inv_freq")
"""What older checkpoints store besides the weights (computed here from rope_theta)."""

# Which of our model's fields sets each axis of a Hugging Face tensor, by the end of its name.
_AXIS_FIELDS = {
    "embed_tokens.weight": ("vocab_size", "dim"),
    "lm_head.weight": ("vocab_size", "dim"),
    "q_proj.weight": ("dim", "dim"),
    "k_proj.weight": ("n_kv_heads", "dim"),
    "v_proj.weight": ("n_kv_heads", "dim"),
    "o_proj.weight": ("dim", "dim"),
    "gate_proj.weight": ("ffn_dim", "dim"),
    "up_proj.weight": ("ffn_dim", "dim"),
    "down_proj.weight": ("dim", "ffn_dim"),
    "w1.weight": ("ffn_dim", "dim"),
    "w3.weight": ("ffn_dim", "dim"),
    "w2.weight": ("dim", "ffn_dim"),
    "gate.weight": ("moe.num_experts", "dim"),
    "norm.weight": ("dim",),
    "layernorm.weight": ("dim",),
}
_FUNCTION_FIELDS = ("n_heads", "rope_theta", "norm_eps", "moe.top_k")
"""The fields that change what the model computes, and not always a shape (n_heads: not when n_kv_heads changes with it)."""
_MODEL_FIELDS = ("dim", "n_layers", "n_heads", "n_kv_heads", "ffn_dim", "vocab_size", "moe.num_experts", *_FUNCTION_FIELDS[1:])
"""Every field of config.json's that the model must share, in the order a refusal names them."""


class InitFromError(ConfigError):
    """training.init_from names no usable checkpoint, or one that does not fit the model; one line."""


@dataclass(frozen=True)
class TensorInfo:
    """One tensor of a checkpoint as its safetensors header describes it."""

    file: str
    dtype: str
    shape: tuple[int, ...]


@dataclass(frozen=True)
class HfCheckpoint:
    """A Hugging Face checkpoint on this machine, as far as it can be known without its weights."""

    source: str
    """training.init_from as the workers get it: a local directory, or owner/name@<commit>."""
    directory: Path
    config: dict[str, Any]
    """Its config.json."""
    tensors: dict[str, TensorInfo]
    """Every tensor by its name, without buffers (BUFFERS)."""

    @property
    def tied(self) -> bool:
        """The embedding is also the output projection (no lm_head stored): our model gets a copy."""
        return tied_output(self.config, self.tensors)


# --- where -------------------------------------------------------------------------------------


def find_checkpoint(init_from: str, log: Log) -> HfCheckpoint:
    """The checkpoint init_from names: a directory when one is there, else a Hub model id."""
    path = Path(init_from).expanduser()
    if path.exists() or not HUB_ID.fullmatch(init_from) or init_from.startswith((".", "~")):
        if not path.is_dir():
            what = "not a directory" if path.exists() else "no such directory"
            raise InitFromError(
                f"training.init_from: {init_from}: {what}; give a Hugging Face checkpoint directory "
                "(config.json and *.safetensors) or a Hub model id (owner/name)"
            )
        return read_checkpoint(str(path.resolve()), path.resolve())
    repo, _, revision = init_from.partition("@")
    directory, commit = hub_snapshot(repo, revision or "main", log, f"no directory {init_from} here either")
    return read_checkpoint(f"{repo}@{commit}", directory)


def hub_snapshot(repo: str, revision: str, log: Log, aside: str = "") -> tuple[Path, str]:
    """The Hub cache's folder of repo's config.json and safetensors at revision, and its commit:
    downloaded where the Hub can be reached, else (offline) what the cache holds. aside: said
    after the repository where it is not cached."""
    try:
        from huggingface_hub import constants, errors, snapshot_download
    except ImportError:
        raise InitFromError(
            "training.init_from: a Hub id needs the huggingface_hub package: pip install huggingface_hub"
        ) from None
    where = f"model {repo}@{revision}"
    commit = None if constants.HF_HUB_OFFLINE else _commit_now(repo, revision)
    if commit is None:  # offline, or the Hub cannot be reached: the cache answers
        try:
            folder = Path(snapshot_download(repo, revision=revision, allow_patterns=HUB_FILES, local_files_only=True))
        except errors.LocalEntryNotFoundError:
            error = offline_error(
                f"{where} ({aside})" if aside else where,
                download_command(repo, revision, include=HUB_FILES),
                "set training.init_from to a local checkpoint directory",
            )
            raise InitFromError(f"training.init_from: {error}") from None
        return folder, folder.name
    from pretrain.data.hub_process import download_in_child

    try:  # a commit never changes: when the cache holds its files, nothing is downloaded
        folder = Path(snapshot_download(repo, revision=commit, allow_patterns=HUB_FILES, local_files_only=True))
        if (folder / "config.json").is_file() and _weight_files(folder, where):
            return folder, commit
    except (errors.LocalEntryNotFoundError, InitFromError):  # not cached, or only some of its files
        pass
    log(f"training.init_from: downloading {where} ({commit[:12]}) into the Hugging Face cache ({constants.HF_HUB_CACHE})")
    try:
        return download_in_child(repo, commit, HUB_FILES, "model", log), commit
    except DataError as error:
        raise InitFromError(f"training.init_from: {error}") from None


def _commit_now(repo: str, revision: str) -> str | None:
    """The commit revision names on the Hub now; None when the Hub cannot be reached. One line
    (InitFromError) for a repository that is gated, private, missing, or a revision that is not."""
    from huggingface_hub import HfApi

    if is_commit(revision):
        return revision
    try:
        return HfApi().repo_info(repo, revision=revision).sha
    except Exception as error:  # offline, no network, the Hub down: the cache may hold it
        if found := access_error(error, f"model {repo}@{revision}"):
            raise InitFromError(f"training.init_from: {found}") from None
        return None


# --- what ----------------------------------------------------------------------------------------


def read_checkpoint(source: str, directory: Path) -> HfCheckpoint:
    """config.json and the safetensors headers of directory; one line for what a checkpoint lacks."""
    where = f"training.init_from: {source}"
    pickles = sorted(p.name for pattern in PICKLES for p in directory.glob(pattern))
    if not (directory / "config.json").is_file():
        raise InitFromError(f"{where}: no config.json; give a Hugging Face checkpoint directory (from save_pretrained)")
    try:
        config = json.loads((directory / "config.json").read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise InitFromError(f"{where}: config.json cannot be read ({first_line(error)})") from None
    if not isinstance(config, dict):
        raise InitFromError(f"{where}: config.json is not a JSON object; give a Hugging Face checkpoint directory")
    files = _weight_files(directory, where)
    if not files:
        held = f"only pickled weights ({', '.join(pickles[:3])}), which are never unpickled here" if pickles else "no weights"
        raise InitFromError(
            f"{where}: {held}; it needs *.safetensors (transformers: "
            "model.save_pretrained(DIR, safe_serialization=True); `hf download` includes them where the repository has them)"
        )
    tensors: dict[str, TensorInfo] = {}
    for name in files:
        for tensor, (dtype, shape) in read_header(directory / name, where).items():
            if not BUFFERS.fullmatch(tensor):
                tensors[tensor] = TensorInfo(name, dtype, shape)
    return HfCheckpoint(source, directory, config, tensors)


def _weight_files(directory: Path, where: str) -> list[str]:
    """The safetensors files of a checkpoint: those its index names, else model.safetensors, else every one."""
    index = directory / INDEX_FILE
    if index.is_file():
        try:
            files = sorted(set(index_weight_map(index).values()))
        except SafetensorsDamage as error:
            raise InitFromError(f"{where}: {error}") from None
        if missing := [name for name in files if not (directory / name).is_file()]:
            raise InitFromError(f"{where}: {missing[0]} is named by {INDEX_FILE} but missing; fetch or copy it")
        return files
    if (directory / "model.safetensors").is_file():
        return ["model.safetensors"]
    return sorted(p.name for p in directory.glob("*.safetensors"))


def index_weight_map(index: Path) -> dict[str, str]:
    """Tensor name -> file, from a model.safetensors.index.json's weight_map. SafetensorsDamage in
    one line for an index that cannot be read, or one naming a file by a path (a separator, `..`,
    an absolute path): a checkpoint's weight files sit beside its index, and a file elsewhere
    (../other/model.safetensors, /etc/passwd) is never opened."""
    try:
        entries = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        files_by_name = {str(name): file for name, file in entries.items()}
    except UnicodeDecodeError:
        raise SafetensorsDamage(f"{index.name} cannot be read (not UTF-8 text); {FIX_DAMAGED}") from None
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as error:
        raise SafetensorsDamage(f"{index.name} cannot be read ({first_line(error)}); {FIX_DAMAGED}") from None
    for name, file in files_by_name.items():
        if not (isinstance(file, str) and _beside(file)):
            raise SafetensorsDamage(
                f"{index.name} names {file!r} for {name}, which is not a file beside it (a path, or no file name); "
                "give a checkpoint whose index names only files in its own directory"
            )
    return files_by_name


def _beside(name: str) -> bool:
    """Whether name is a plain file name: joined to a directory, a file in that directory."""
    return name not in ("", ".", "..") and not any(separator in name for separator in ("/", "\\", "\0"))


def read_header(path: Path, where: str) -> dict[str, tuple[str, tuple[int, ...]]]:
    """name -> (dtype, shape) of every tensor in a safetensors file, from its header alone, the
    file checked whole (check_header); one line (InitFromError) for a damaged one."""
    try:
        return check_header(path)
    except SafetensorsDamage as error:
        raise InitFromError(f"{where}: {error}") from None


# --- fits ------------------------------------------------------------------------------------------


def check_fits(checkpoint: HfCheckpoint, config: Config) -> None:
    """InitFromError unless checkpoint holds exactly the model's tensors, with its shapes, and
    agrees on what the model computes; each refusal names every key where config.json differs
    from the model. model.vocab_size null (before the dataset is prepared) takes the
    checkpoint's, checked again once the tokenizer has set it."""
    where = f"training.init_from: {checkpoint.source}"
    model = config.model
    try:
        theirs = model_fields_from_hf(checkpoint.config)
    except HfFormatError as error:
        raise InitFromError(f"{where}: {error}") from None
    except (TypeError, ValueError, ArithmeticError, AttributeError) as error:  # a field of the wrong type
        raise InitFromError(f"{where}: config.json is not a Llama's or Mixtral's ({first_line(error)})") from None
    experts = theirs.get("moe", {}).get("num_experts", 0)
    if experts and not model.moe.num_experts:
        raise InitFromError(
            f"{where} is a Mixtral ({experts} experts, {theirs['moe']['top_k']} per token) but the model is dense; "
            f"set model.moe.num_experts={experts} and model.moe.top_k={theirs['moe']['top_k']}"
        )
    if model.moe.num_experts and not experts:
        raise InitFromError(
            f"{where} is a dense Llama but the model is a mixture of experts (model.moe.num_experts "
            f"{model.moe.num_experts}); set model.moe.num_experts=0"
        )
    if model.vocab_size is None:
        model = dataclasses.replace(model, vocab_size=theirs["vocab_size"])
    try:
        their_scaling = RopeScalingConfig(**theirs["rope_scaling"])
    except ConfigError as error:
        raise InitFromError(f"{where}: its rotary scaling (rope_scaling) is not one this model computes ({error})") from None
    # Every key where config.json describes another model, in each refusal: one change fixes them all.
    rope_sets = _rope_scaling_sets(their_scaling, model.rope_scaling)
    sets = " ".join([f"model.{key}={value}" for key, value in _differences(theirs, model, _MODEL_FIELDS)] + rope_sets)
    _check_tensors(checkpoint, model, max_seq_len(config), where, sets)
    if differences := _differences(theirs, model, _FUNCTION_FIELDS):
        said = ", ".join(f"its {key} is {value} but model.{key} is {_field(model, key)}" for key, value in differences)
        raise InitFromError(f"{where}: {said} (the same shapes computing another function); set {sets}")
    if rope_sets:
        raise InitFromError(
            f"{where}: its rotary scaling (rope_scaling) is {_scaling(their_scaling)} but model.rope_scaling is "
            f"{_scaling(model.rope_scaling)} (the same shapes computing another function); set {sets}"
        )


def _rope_scaling_sets(theirs: RopeScalingConfig, ours: RopeScalingConfig) -> list[str]:
    """The model.rope_scaling keys to set for the model to compute the checkpoint's rotary scaling
    (none where both are unscaled: any two with factor 1 are the same)."""
    if theirs == ours or not (theirs.scales or ours.scales):
        return []
    if not theirs.scales:
        return ["model.rope_scaling.factor=1"]
    ours_by_key = dataclasses.asdict(ours)
    return [f"model.rope_scaling.{key}={value}" for key, value in dataclasses.asdict(theirs).items() if value != ours_by_key[key]]


def _scaling(scaling: RopeScalingConfig) -> str:
    """A rotary scaling in words: its keys and values, or none."""
    return ", ".join(f"{key} {value}" for key, value in dataclasses.asdict(scaling).items()) if scaling.scales else "none"


def _check_tensors(checkpoint: HfCheckpoint, model: ModelConfig, seq_len: int, where: str, sets: str) -> None:
    """InitFromError for the first tensor missing, of another shape or not a float, or one too many;
    sets: every key to set, where the checkpoint's config.json describes another model than this one
    (else the fields behind the axes that differ are named)."""
    expected = expected_hf_shapes(model, seq_len)
    held = dict(checkpoint.tensors)
    if checkpoint.tied and EMBEDDING in held:
        held[TIED] = held[EMBEDDING]
    hint = f"; set {sets} (from its config.json)" if sets else ""
    for name, shape in expected.items():
        found = held.get(name)
        if found is None:
            missing = [n for n in expected if n not in held]
            more = f" and {len(missing) - 1} more" if len(missing) > 1 else ""
            raise InitFromError(f"{where}: no tensor {name}{more}, which the model needs{hint}")
        if found.shape != shape:
            fields = _axis_fields(name, found.shape, shape)
            fix = hint or (f"; set {fields} to match it" if fields else "")
            raise InitFromError(
                f"{where}: {name} is {list(found.shape)} in the checkpoint but {list(shape)} in the model{fix}"
                + (" and a tokenizer with its vocabulary (data.tokenizer=huggingface)" if "model.vocab_size" in fields else "")
            )
        if found.dtype not in FLOAT_DTYPES:
            raise InitFromError(
                f"{where}: {name} is {found.dtype}, not a float (a quantized checkpoint?); give unquantized weights"
            )
    if extra := [n for n in held if n not in expected]:
        more = f" and {len(extra) - 1} more" if len(extra) > 1 else ""
        raise InitFromError(f"{where}: holds {extra[0]}{more}, which the model has no place for{hint}")


def _differences(theirs: dict[str, Any], model: ModelConfig, keys: tuple[str, ...]) -> list[tuple[str, Any]]:
    """(key, the checkpoint's value) for each of keys where config.json and model differ."""
    flat = {**theirs, **{f"moe.{k}": v for k, v in theirs.get("moe", {}).items()}}
    return [(key, flat[key]) for key in keys if key in flat and flat[key] != _field(model, key)]


def _field(model: ModelConfig, key: str) -> Any:
    section, _, name = key.rpartition(".")
    return getattr(model.moe if section == "moe" else model, name)


def _axis_fields(name: str, found: tuple[int, ...], wanted: tuple[int, ...]) -> str:
    """The model fields behind the axes where a tensor's shapes differ, as `model.x`."""
    fields = next((f for end, f in _AXIS_FIELDS.items() if name.endswith(end)), ())
    if len(found) != len(wanted):
        return ""
    return " and ".join(
        dict.fromkeys(f"model.{fields[axis]}" for axis in range(len(found)) if found[axis] != wanted[axis] and axis < len(fields))
    )


def model_type(checkpoint: HfCheckpoint) -> str:
    """The checkpoint's architecture in words, for the line saying where the weights came from."""
    return "Mixtral" if checkpoint.config.get("model_type") == MIXTRAL else "Llama"


def for_workers(config: Config, log: Log) -> tuple[Config, HfCheckpoint | None]:
    """The launcher's part, before any worker starts: training.init_from found (downloaded where
    the Hub can be reached) and checked, and pinned in the config the workers get (an absolute
    directory, or a Hub id at the commit found) so that every rank reads the same files offline.
    None when there is nothing to load: no init_from, or a checkpoint to resume from (said in a line)."""
    training = config.training
    if not training.init_from:
        return config, None
    if training.resume:
        log(f"training.init_from {training.init_from} is not used: the run resumes from {training.resume}")
        return config, None
    checkpoint = find_checkpoint(training.init_from, log)
    check_fits(checkpoint, config)
    tensors = len(checkpoint.tensors)
    log(f"weights: {checkpoint.source} ({model_type(checkpoint)}, {tensors} tensors; names and shapes fit the model)")
    return dataclasses.replace(config, training=dataclasses.replace(training, init_from=checkpoint.source)), checkpoint
