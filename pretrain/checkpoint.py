"""Checkpoints: everything a run needs to continue exactly, in <run dir>/checkpoints/<name>/.

    model.pt, optimizer.pt   single process or DDP: the full model state dict and the AdamW
                             state keyed by parameter name (rank 0 writes them)
    dcp/                     FSDP: model and optimizer state as a sharded torch.distributed.checkpoint,
                             each rank writing its own shards (no rank ever holds the whole model)
    rng_rank<r>.pt           rank r's random generators: torch CPU (and CUDA), Python, NumPy
    state.json               steps done, world size, parallelism, the data loader's position,
                             the learning-rate schedule's position, the format version
    config.json              the resolved config

Both formats hold the same names (`layers.0.attention.wq.weight`, ...), so either restores into
either: a DDP checkpoint into an FSDP run (every rank reads the full tensors and keeps its
shard) and an FSDP checkpoint into a DDP or single-process run (DCP reshards on load). The
world size may change between save and restore: the data position is converted (see
_loader_position), and ranks the saving run did not have seed their generators afresh.

Every rank writes into <name>.tmp/ and rank 0 renames it into place, so a checkpoint directory
is either complete or absent. Every .pt file loads with torch.load(weights_only=True); the
DCP metadata, which torch pickles, is read with an unpickler that admits only DCP's own
metadata classes, and only tensors are ever stored in DCP (so none of its values is unpickled).
"""

from __future__ import annotations

import json
import math
import os
import pickle
import random
import shutil
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta, TensorStorageMetadata
from torch.distributed.fsdp import FSDPModule
from torch.nn.parallel import DistributedDataParallel

from pretrain import config as cfg
from pretrain.config import Config
from pretrain.resume import latest, step_checkpoints
from pretrain.runfiles import atomic_write_text
from pretrain.runtime import Runtime

if TYPE_CHECKING:
    from pretrain.train import Trainer

__all__ = ["CheckpointError", "latest", "load_config", "load_model_state", "load_tensors", "read_state",
           "restore", "save"]

FORMAT_VERSION = 2
"""2: optimizer state keyed by parameter name, Python and NumPy RNG, DCP for FSDP. 1 (the
optimizer's own integer keys, torch RNG only) is still read."""

ARCHITECTURE_KEYS = ("dim", "n_layers", "n_heads", "n_kv_heads", "ffn_dim", "vocab_size")
"""The model keys that define its parameters. The others (norm_eps, rope_theta, max_seq_len,
init_std) may change on resume: raising rope_theta with max_seq_len is how a context is extended."""

WRAPPER_NAMES = frozenset({"module", "_orig_mod", "_checkpoint_wrapped_module", "_fsdp_wrapped_module"})
"""Name components that wrappers (DDP, torch.compile, activation checkpointing, FSDP1) insert."""


class CheckpointError(ValueError):
    """A checkpoint that cannot be used here; the message is one line that says what to do."""


# --- save -----------------------------------------------------------------------------

def save(trainer: Trainer, steps_done: int, run_dir: Path, name: str | None = None) -> Path:
    """Write a checkpoint after steps_done optimizer steps to <run_dir>/checkpoints/step_<steps_done>
    (or name) and return its path; every rank calls this. Rank 0 then deletes the oldest step_<N>
    checkpoints beyond training.keep_checkpoints."""
    runtime = trainer.runtime
    final = run_dir / "checkpoints" / (name or f"step_{steps_done}")
    tmp = final.with_name(final.name + ".tmp")
    if runtime.is_main:
        clean_unfinished(final.parent)  # a save that was killed left these
        tmp.mkdir(parents=True)
    _barrier(runtime)
    torch.save(rng_states(runtime.device), tmp / f"rng_rank{runtime.rank}.pt")
    if is_fsdp(trainer.model):
        _save_sharded(trainer, tmp / "dcp")
    elif runtime.is_main:
        model_state, optimizer_state = _full_states(trainer)
        torch.save(model_state, tmp / "model.pt")
        torch.save(optimizer_state, tmp / "optimizer.pt")
    if runtime.is_main:
        cfg.save(trainer.config, tmp / "config.json")
        atomic_write_text(tmp / "state.json", json.dumps(_state(trainer, steps_done), indent=2) + "\n")
    _barrier(runtime)  # every rank's files are in tmp
    if runtime.is_main:
        _fsync_tree(tmp)  # on disk before the rename makes them count
        _replace_dir(tmp, final)
        prune(final.parent, trainer.config.training.keep_checkpoints, final)
    _barrier(runtime)  # no rank returns before the checkpoint exists
    return final


def _state(trainer: Trainer, steps_done: int) -> dict[str, Any]:
    from pretrain.train import lr_at  # train imports this module
    return {"format_version": FORMAT_VERSION, "steps_done": steps_done,
            "world_size": trainer.runtime.world_size, "parallelism": parallelism(trainer),
            "loader": trainer.loader.state_dict(),
            # The schedule is a pure function of the step; the rate is for people, and for
            # noticing on resume that the schedule changed.
            "lr_schedule": {"steps_done": steps_done, "lr": lr_at(steps_done, trainer.config.training)}}


def parallelism(trainer: Trainer) -> str:
    """"fsdp", "ddp" or "single": how the ranks held the model."""
    if is_fsdp(trainer.model):
        return "fsdp"
    return "ddp" if trainer.runtime.distributed else "single"


def is_fsdp(model: torch.nn.Module) -> bool:
    return any(isinstance(module, FSDPModule) for module in model.modules())


def _full_states(trainer: Trainer) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """The model's state dict and the optimizer's, both keyed by plain parameter name."""
    model_state = {plain_name(key): value.detach() for key, value in trainer.model.state_dict().items()}
    return model_state, named_optimizer_state(trainer.optimizer, trainer.model)


def _save_sharded(trainer: Trainer, directory: Path) -> None:
    """FSDP: every rank writes its shards of the model and of the optimizer's state."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict
    if trainer.optimizer.state:
        model_state, optimizer_state = get_state_dict(trainer.model, trainer.optimizer)
        content = {"model": model_state, "optimizer": {"state": optimizer_state["state"]}}
    else:  # no step yet; get_state_dict would initialise the optimizer's state with a dummy step
        content = {"model": get_model_state_dict(trainer.model)}
    # The param_groups (hyperparameters) are not saved: they come from the config, and DCP
    # would pickle them.
    dcp.save(content, storage_writer=FileSystemWriter(directory))


def plain_name(name: str) -> str:
    """A parameter's name without the components wrappers add: module.layers.0... -> layers.0..."""
    return ".".join(part for part in name.split(".") if part not in WRAPPER_NAMES)


def _parameter_order(optimizer: torch.optim.Optimizer, model: torch.nn.Module) -> list[str]:
    """The plain names of the optimizer's parameters, in the order its state_dict numbers them."""
    names = {id(p): plain_name(n) for n, p in model.named_parameters()}
    return [names[id(p)] for group in optimizer.param_groups for p in group["params"]]


def named_optimizer_state(optimizer: torch.optim.Optimizer, model: torch.nn.Module) -> dict[str, Any]:
    """optimizer.state_dict() with parameter names in place of its numbers (the form
    torch.distributed.checkpoint.state_dict uses), so it loads whatever wraps the model."""
    order = _parameter_order(optimizer, model)
    raw = optimizer.state_dict()
    return {"state": {order[index]: state for index, state in raw["state"].items()},
            "param_groups": [{**group, "params": [order[i] for i in group["params"]]}
                             for group in raw["param_groups"]]}


# --- files ----------------------------------------------------------------------------

def clean_unfinished(checkpoints_dir: Path) -> None:
    """Remove the .tmp directories of saves that were killed. A .old directory is a complete
    checkpoint being replaced: removed when its replacement is in place, else renamed back."""
    if not checkpoints_dir.is_dir():
        return
    for path in checkpoints_dir.iterdir():
        if path.name.endswith(".tmp"):
            shutil.rmtree(path, ignore_errors=True)
        elif path.name.endswith(".old"):
            final = path.with_name(path.name.removesuffix(".old"))
            if final.exists():
                shutil.rmtree(path, ignore_errors=True)
            else:
                os.rename(path, final)


def prune(checkpoints_dir: Path, keep: int, just_written: Path) -> list[Path]:
    """Delete step_<N> checkpoints so that `keep` remain: the one just written and the newest
    others. Checkpoints with other names are never deleted. Returns what was deleted."""
    steps = [path for _, path in step_checkpoints(checkpoints_dir)]
    others = [path for path in steps if path != just_written]
    room = keep - 1 if just_written in steps else keep
    doomed = others[:max(0, len(others) - room)]
    for path in doomed:
        shutil.rmtree(path, ignore_errors=True)  # a checkpoint left over must not end the run
    return doomed


def _fsync_tree(directory: Path) -> None:
    for root, _dirs, files in os.walk(directory):
        for name in files:
            with open(Path(root) / name, "rb") as handle:
                os.fsync(handle.fileno())
        _fsync_dir(Path(root))


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _replace_dir(new: Path, final: Path) -> None:
    """Rename new to final; an existing final is moved aside first and removed last, so a
    complete checkpoint exists at every moment."""
    old = final.with_name(final.name + ".old")
    if final.exists():
        shutil.rmtree(old, ignore_errors=True)
        os.rename(final, old)
    os.rename(new, final)
    _fsync_dir(final.parent)  # the rename itself survives a power loss
    shutil.rmtree(old, ignore_errors=True)


def _barrier(runtime: Runtime) -> None:
    if runtime.distributed:
        dist.barrier()


# --- reading --------------------------------------------------------------------------

def read_state(path: Path) -> dict:
    """The checkpoint's state.json; CheckpointError when path is not a (complete) checkpoint."""
    try:
        state = json.loads((path / "state.json").read_text(encoding="utf-8"))
    except FileNotFoundError:
        what = "no such directory" if not path.exists() else "no state.json (not a checkpoint, or an unfinished save)"
        raise CheckpointError(f"checkpoint {path}: {what}; give a <run dir>/checkpoints/step_<N> directory") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise CheckpointError(f"checkpoint {path}: state.json is unreadable ({_first_line(error)}); "
                              "use another checkpoint of the run") from None
    if not isinstance(state, dict) or not isinstance(state.get("steps_done"), int):
        raise CheckpointError(f"checkpoint {path}: state.json has no steps_done; use another checkpoint")
    version = state.get("format_version", 1)
    if not isinstance(version, int) or version > FORMAT_VERSION:
        raise CheckpointError(f"checkpoint {path} has format version {version}, newer than this code reads "
                              f"({FORMAT_VERSION}); update the code or start fresh")
    return state


def load_config(path: Path) -> Config:
    """The resolved config the checkpoint was written with."""
    if not (path / "config.json").is_file():
        raise CheckpointError(f"checkpoint {path} is incomplete: it has no config.json; "
                              "use another checkpoint of the run")
    try:
        return cfg.load(path / "config.json")
    except cfg.ConfigError as error:
        raise CheckpointError(f"checkpoint {path}: {error}") from None


def load_tensors(path: Path, name: str, mmap: bool = False) -> Any:
    """One of the checkpoint's .pt files on CPU, without unpickling arbitrary objects. With
    mmap the tensors are views of the file: ranks reading the same file share its pages."""
    file = path / name
    if not file.is_file():
        raise CheckpointError(f"checkpoint {path} is incomplete: {name} is missing; "
                              "use another checkpoint of the run")
    try:
        return torch.load(file, map_location="cpu", weights_only=True, mmap=mmap)
    except (OSError, RuntimeError, EOFError, pickle.UnpicklingError) as error:
        raise CheckpointError(f"checkpoint {path}: cannot read {name} ({_first_line(error)}); "
                              "use another checkpoint of the run") from None


def load_model_state(path: Path) -> dict[str, torch.Tensor]:
    """The whole model's state dict on CPU with plain parameter names, in one process without a
    process group, whichever format the checkpoint has (for generation and export)."""
    read_state(path)
    if _is_sharded(path):
        return _read_sharded_model(path)
    return {plain_name(key): value for key, value in load_tensors(path, "model.pt", mmap=True).items()}


def _is_sharded(path: Path) -> bool:
    return (path / "dcp").is_dir()


def _read_sharded_model(path: Path) -> dict[str, torch.Tensor]:
    """The model part of a DCP checkpoint, assembled into full tensors built from its metadata."""
    metadata = read_dcp_metadata(path)
    state = {key: torch.empty(item.size, dtype=item.properties.dtype)
             for key, item in metadata.state_dict_metadata.items()
             if key.startswith("model.") and isinstance(item, TensorStorageMetadata)}
    _dcp_load(state, SafeReader(path / "dcp"), alone=True)
    return {key.removeprefix("model."): tensor for key, tensor in state.items()}


def _dcp_load(state: dict[str, Any], reader: SafeReader, alone: bool | None = None) -> None:
    """dcp.load in place; alone (default: when there is no process group) reads every tensor in
    this process, without a collective."""
    if alone is None:
        alone = not (dist.is_available() and dist.is_initialized())
    with warnings.catch_warnings():  # it warns whenever it runs alone, even when asked to
        warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
        dcp.load(state, storage_reader=reader, no_dist=alone)


# DCP pickles its metadata (.metadata). Unpickling runs whatever the file names, so only
# the classes DCP's own metadata is made of are admitted.
_METADATA_CLASSES = {
    ("torch.distributed.checkpoint.metadata", name) for name in (
        "Metadata", "MetadataIndex", "StorageMeta", "TensorProperties", "TensorStorageMetadata",
        "ChunkStorageMetadata", "BytesStorageMetadata", "_MEM_FORMAT_ENCODING")
} | {("torch.distributed.checkpoint.filesystem", "_StorageInfo"), ("torch", "Size"),
     ("torch.serialization", "_get_layout"), ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath"),
     ("collections", "OrderedDict")}


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _METADATA_CLASSES or (module == "torch" and isinstance(getattr(torch, name, None),
                                                                                    torch.dtype)):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not part of checkpoint metadata")


def read_dcp_metadata(path: Path) -> Metadata:
    """The DCP metadata of checkpoint path (its dcp/.metadata), read without running foreign code."""
    file = path / "dcp" / ".metadata"
    if not file.is_file():
        raise CheckpointError(f"checkpoint {path} is incomplete: dcp/.metadata is missing; "
                              "use another checkpoint of the run")
    try:
        with open(file, "rb") as handle:
            metadata = _MetadataUnpickler(handle).load()
    except (OSError, EOFError, pickle.UnpicklingError, AttributeError, TypeError) as error:
        raise CheckpointError(f"checkpoint {path}: cannot read dcp/.metadata ({_first_line(error)}); "
                              "use another checkpoint of the run") from None
    if not isinstance(metadata, Metadata):
        raise CheckpointError(f"checkpoint {path}: dcp/.metadata is not DCP metadata; use another checkpoint")
    return metadata


class SafeReader(FileSystemReader):
    """FileSystemReader whose metadata goes through _MetadataUnpickler instead of pickle.load."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        metadata = read_dcp_metadata(Path(self.checkpoint_id).parent)  # the reader is given <checkpoint>/dcp
        if metadata.storage_meta is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


# --- restore --------------------------------------------------------------------------

def restore(trainer: Trainer, path: Path) -> int:
    """Load model, optimizer, data position and this rank's random generators from the
    checkpoint at path into trainer; return the steps it had done. Every rank calls this.
    The optimizer's hyperparameters stay those of trainer's config."""
    # Everything that can refuse the checkpoint runs before anything is loaded into trainer.
    state = read_state(path)
    saved_config = load_config(path)
    check_same_model(path, saved_config.model, trainer.config.model)
    rng = _read_rng(path, state, trainer.runtime.rank)
    position = _loader_position(path, state, saved_config, trainer)
    if _is_sharded(path):
        metadata = read_dcp_metadata(path)
        check_shapes(path, _dcp_model_shapes(metadata), trainer.model)
        _load_sharded(trainer, path, metadata)
    else:
        model_state = load_tensors(path, "model.pt", mmap=True)
        check_shapes(path, {plain_name(k): tuple(v.shape) for k, v in model_state.items()}, trainer.model)
        _load_full(trainer, model_state, load_tensors(path, "optimizer.pt", mmap=True))
    trainer.loader.load_state_dict(position)
    trainer.batches = iter(trainer.loader)  # from the restored position
    if rng is None:
        _seed_new_rank(trainer, path, state)
    else:
        set_rng_states(rng, trainer.runtime.device)
    _warn_if_schedule_changed(trainer, path, state)
    return state["steps_done"]


def check_same_model(path: Path, saved: cfg.ModelConfig, current: cfg.ModelConfig) -> None:
    for key in ARCHITECTURE_KEYS:
        there, here = getattr(saved, key), getattr(current, key)
        if there != here:
            raise CheckpointError(f"checkpoint {path} is for a different model: model.{key} is {there} there, "
                                  f"{here} here; resume with the same model config or start fresh")


def check_shapes(path: Path, saved: dict[str, tuple[int, ...]], model: torch.nn.Module) -> None:
    """The checkpoint has exactly the model's tensors, each of the same (full) shape."""
    current = {plain_name(key): tuple(value.shape) for key, value in model.state_dict().items()}
    for key in sorted(saved.keys() | current.keys()):
        there, here = saved.get(key), current.get(key)
        if there != here:
            def show(shape: tuple[int, ...] | None) -> str:
                return "absent" if shape is None else f"of shape {list(shape)}"
            raise CheckpointError(f"checkpoint {path} is for a different model: {key} is {show(there)} there, "
                                  f"{show(here)} here; resume with the same model config or start fresh")


def _dcp_model_shapes(metadata: Metadata) -> dict[str, tuple[int, ...]]:
    return {key.removeprefix("model."): tuple(item.size) for key, item in metadata.state_dict_metadata.items()
            if key.startswith("model.") and isinstance(item, TensorStorageMetadata)}


def _load_full(trainer: Trainer, model_state: dict[str, torch.Tensor], optimizer_state: dict[str, Any]) -> None:
    """Full state dicts (single process or DDP) into whatever trainer.model is."""
    model_state = {plain_name(key): value for key, value in model_state.items()}
    order = _parameter_order(trainer.optimizer, trainer.model)
    named = _by_name(optimizer_state, order)
    if is_fsdp(trainer.model):
        # Every rank holds the full tensors (memory-mapped) and keeps its own shard of each.
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict
        groups = named_optimizer_state(trainer.optimizer, trainer.model)["param_groups"]
        set_state_dict(trainer.model, trainer.optimizer, model_state_dict=model_state,
                       optim_state_dict={"state": named, "param_groups": groups} if named else {},
                       options=StateDictOptions(full_state_dict=True))
        return
    _plain_module(trainer.model).load_state_dict(model_state)
    index = {name: i for i, name in enumerate(order)}
    unknown = sorted(named.keys() - index.keys())
    if unknown:
        raise CheckpointError(f"the optimizer state has parameter {unknown[0]}, which the model does not; "
                              "resume with the same model config or start fresh")
    trainer.optimizer.load_state_dict({"state": {index[name]: value for name, value in named.items()},
                                       "param_groups": trainer.optimizer.state_dict()["param_groups"]})


def _by_name(optimizer_state: dict[str, Any], order: list[str]) -> dict[str, Any]:
    """The per-parameter optimizer state keyed by name. Format 1 numbered the parameters in
    the order the optimizer was built, which build_optimizer has kept."""
    return {order[key] if isinstance(key, int) else key: value for key, value in optimizer_state["state"].items()}


def _plain_module(model: torch.nn.Module) -> torch.nn.Module:
    """The module whose state_dict keys are the plain names (DDP and torch.compile wrap it)."""
    while isinstance(model, DistributedDataParallel) or hasattr(model, "_orig_mod"):
        model = model.module if isinstance(model, DistributedDataParallel) else model._orig_mod
    return model


def _load_sharded(trainer: Trainer, path: Path, metadata: Metadata) -> None:
    """A DCP checkpoint into whatever trainer.model is: DCP reads each rank's part of every
    tensor (all of it for an unsharded model), whatever the world size that wrote it."""
    from torch.distributed.checkpoint.state_dict import (get_model_state_dict, get_state_dict,
                                                         set_model_state_dict, set_state_dict)
    has_optimizer = any(key.startswith("optimizer.") for key in metadata.state_dict_metadata)
    reader = SafeReader(path / "dcp")
    if not has_optimizer:  # saved before the first step: the fresh optimizer is right
        model_state = get_model_state_dict(trainer.model)
        _dcp_load({"model": model_state}, reader)
        set_model_state_dict(trainer.model, model_state)
        return
    model_state, optimizer_state = get_state_dict(trainer.model, trainer.optimizer)
    _dcp_load({"model": model_state, "optimizer": {"state": optimizer_state["state"]}}, reader)
    set_state_dict(trainer.model, trainer.optimizer, model_state_dict=model_state, optim_state_dict=optimizer_state)


def _loader_position(path: Path, state: dict[str, Any], saved_config: Config, trainer: Trainer) -> dict[str, int]:
    """The data position for this run. With another world size or batch size it is converted:
    in an epoch, ranks read a permutation of the windows round-robin, so the windows consumed
    are a prefix of it (batch_index x batch_size x world_size windows), and the new run starts
    after the same prefix when that is a whole number of its own batches."""
    position = {"epoch": int(state["loader"]["epoch"]), "batch_index": int(state["loader"]["batch_index"])}
    saved_ranks, saved_batch = int(state["world_size"]), saved_config.training.batch_size
    ranks, batch = trainer.runtime.world_size, trainer.config.training.batch_size
    if (saved_ranks, saved_batch) == (ranks, batch):
        return position
    consumed = position["batch_index"] * saved_batch * saved_ranks
    if consumed % (batch * ranks):
        raise CheckpointError(
            f"checkpoint {path} stopped {consumed} windows into epoch {position['epoch']} "
            f"({saved_ranks} rank(s) x batch {saved_batch}), not a whole number of batches of {ranks} rank(s) x "
            f"batch {batch}; resume with {saved_ranks} rank(s) and training.batch_size {saved_batch}")
    batch_index = consumed // (batch * ranks)
    if batch_index >= trainer.loader.batches_per_epoch:  # the rest is the tail this run drops
        return {"epoch": position["epoch"] + 1, "batch_index": 0}
    trainer.log.info(f"Checkpoint written by {saved_ranks} rank(s) with batch {saved_batch}; continuing on "
                     f"{ranks} with batch {batch} at batch {batch_index} of epoch {position['epoch']}")
    return {"epoch": position["epoch"], "batch_index": batch_index}


def _warn_if_schedule_changed(trainer: Trainer, path: Path, state: dict[str, Any]) -> None:
    from pretrain.train import lr_at  # train imports this module
    saved = state.get("lr_schedule", {}).get("lr")
    here = lr_at(state["steps_done"], trainer.config.training)
    if saved is not None and not math.isclose(saved, here, rel_tol=1e-9, abs_tol=1e-15):
        trainer.log.warning(
            f"The learning-rate schedule changed: step {state['steps_done']} runs at {here:.3e} now, "
            f"{saved:.3e} in the run that saved {path} (training.learning_rate, warmup_steps, max_steps or "
            "min_lr_ratio differ)")


# --- random generators ----------------------------------------------------------------

def rng_states(device: torch.device) -> dict[str, Any]:
    """Every random generator of this process, as tensors and plain values (weights_only loads them)."""
    version, mt_state, gauss_next = random.getstate()
    bit_generator, keys, pos, has_gauss, cached_gaussian = np.random.get_state()
    states: dict[str, Any] = {
        "cpu": torch.get_rng_state(),
        "python": {"version": version, "state": torch.tensor(mt_state, dtype=torch.int64),
                   "gauss_next": gauss_next},
        "numpy": {"bit_generator": bit_generator, "keys": torch.from_numpy(keys.astype(np.int64)), "pos": int(pos),
                  "has_gauss": int(has_gauss), "cached_gaussian": float(cached_gaussian)},
    }
    if device.type == "cuda":
        states["cuda"] = torch.cuda.get_rng_state(device)
    return states


def set_rng_states(states: dict[str, Any], device: torch.device) -> None:
    """Undo rng_states. Generators a checkpoint lacks (format 1 had torch's only, a CPU run no
    CUDA) are left as they are."""
    torch.set_rng_state(states["cpu"])
    if "cuda" in states and device.type == "cuda":
        torch.cuda.set_rng_state(states["cuda"], device)
    if "python" in states:
        python = states["python"]
        random.setstate((python["version"], tuple(python["state"].tolist()), python["gauss_next"]))
    if "numpy" in states:
        numpy = states["numpy"]
        np.random.set_state((numpy["bit_generator"], numpy["keys"].numpy().astype(np.uint32), numpy["pos"],
                             numpy["has_gauss"], numpy["cached_gaussian"]))


def _read_rng(path: Path, state: dict[str, Any], rank: int) -> dict[str, Any] | None:
    """This rank's saved generators; None for a rank the saving run did not have."""
    if rank >= int(state["world_size"]):
        return None
    return load_tensors(path, f"rng_rank{rank}.pt")


def _seed_new_rank(trainer: Trainer, path: Path, state: dict[str, Any]) -> None:
    """A rank beyond the saving run's world size: seed every generator from (seed, step, rank),
    so a second resume on the same ranks repeats it, and ranks do not share one stream."""
    rank, steps_done = trainer.runtime.rank, state["steps_done"]
    seed = int(np.random.SeedSequence([trainer.config.training.seed, steps_done, rank]).generate_state(1)[0])
    torch.manual_seed(seed)
    random.seed(seed)
    np.random.seed(seed)
    trainer.log.warning(f"Checkpoint {path} was written by {state['world_size']} rank(s) and has no random "
                        f"state for rank {rank}; its generators are seeded from (training.seed, step "
                        f"{steps_done}, rank {rank}) instead")


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__

