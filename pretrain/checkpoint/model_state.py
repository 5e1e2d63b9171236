"""The model's and the optimizer's state out of and into whatever wraps the model (nothing,
DDP, FSDP2), keyed by plain parameter names (`layers.0.attention.wqkv.weight`), so that a
checkpoint written under one wrapper restores under any other. A checkpoint of the separate
layout (wq/wk/wv, w1/w3: before the fused projections) loads converted
(pretrain/checkpoint/separate_layout.py).

Full state dicts (single process, DDP) are whole tensors; under FSDP each rank holds, saves
and loads only its shards, through torch.distributed.checkpoint (pretrain/checkpoint/dcp_files.py).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import torch
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.tensor import DTensor

from pretrain.checkpoint.files import CheckpointError
from pretrain.checkpoint.dcp_files import dcp_load, dcp_save, tensor_entries
from pretrain.checkpoint.separate_layout import (
    fuse_optimizer_state,
    has_separate_entries,
    has_separate_layout,
    load_fused_from_parts,
    separate_order,
)
from pretrain.distributed import float8
from pretrain.distributed.parallel import has_fsdp, unwrap
from pretrain.model.fused_layout import fuse_separate, part_names, row_splits

if TYPE_CHECKING:
    from torch.distributed.checkpoint.state_dict import ValueType

WRAPPER_NAMES = frozenset({"module", "_orig_mod", "_checkpoint_wrapped_module", "_fsdp_wrapped_module"})
"""Name components that wrappers (DDP, torch.compile, activation checkpointing, FSDP1) insert;
checkpoints written by older code may carry them."""


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
    return {
        "state": {order[index]: state for index, state in raw["state"].items()},
        "param_groups": [{**group, "params": [order[i] for i in group["params"]]} for group in raw["param_groups"]],
    }


def model_shapes(model: torch.nn.Module) -> dict[str, tuple[int, ...]]:
    """Plain name -> full shape of every entry of the model's state dict (under FSDP the
    DTensors report their full shape)."""
    return {plain_name(key): tuple(value.shape) for key, value in model.state_dict().items()}


# --- full state dicts -------------------------------------------------------------------


def whole_tensors(model: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """Every entry of the model's state dict, whole and on the CPU, one at a time, under its plain
    name, in model_shapes' order: an export holds one whole tensor at a time, never the model.
    Under FSDP a collective per tensor (each rank gathers its shards into it): every rank must
    iterate it to the end."""
    for key, value in model.state_dict().items():
        if isinstance(value, DTensor):
            if value.device.type != value.device_mesh.device_type:  # offloaded to the CPU: gather on the mesh's device
                value = value.to(value.device_mesh.device_type)
            value = value.full_tensor()
        whole = value.detach().cpu()
        del value
        yield plain_name(key), whole
        del whole


def full_states(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """The model's state dict and the optimizer's, both keyed by plain parameter name (not FSDP)."""
    model_state = {plain_name(key): value.detach() for key, value in model.state_dict().items()}
    return model_state, named_optimizer_state(optimizer, model)


def load_full(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    model_state: dict[str, torch.Tensor],
    optimizer_state: dict[str, Any],
) -> list[str] | None:
    """Full state dicts (as full_states gives them, or format 1's numbered optimizer state)
    into whatever model is; the optimizer's hyperparameters stay its own. A checkpoint of the
    separate layout is converted: then the fused weights whose optimizer state could not be (it
    starts afresh) are returned, usually none; None for a checkpoint of the fused layout."""
    model_state = {plain_name(key): value for key, value in model_state.items()}
    order = _parameter_order(optimizer, model)
    reset: list[str] | None = None
    cfg = unwrap(model).cfg
    if has_separate_layout(model_state, cfg):
        model_state = fuse_separate(model_state, cfg)
        named, reset = fuse_optimizer_state(_by_name(optimizer_state, separate_order(order)), order, cfg)
    else:
        named = _by_name(optimizer_state, order)
    if has_fsdp(model):
        # Every rank holds the full tensors (memory-mapped) and keeps its own shard of each.
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict, set_state_dict

        options = StateDictOptions(full_state_dict=True)
        dcp_model_state: dict[str, ValueType] = dict(model_state)  # what DCP takes (dict is invariant: a copy, not a cast)
        if not named:  # saved before the first update (a step_0 or nan_grad_step_0): no moments yet
            set_model_state_dict(model, dcp_model_state, options=options)
            return reset
        groups = named_optimizer_state(optimizer, model)["param_groups"]
        set_state_dict(
            model,
            optimizer,
            model_state_dict=dcp_model_state,
            optim_state_dict={"state": named, "param_groups": groups},
            options=options,
        )
        return reset
    unwrap(model).load_state_dict(model_state)
    index = {name: i for i, name in enumerate(order)}
    unknown = sorted(named.keys() - index.keys())
    if unknown:
        raise CheckpointError(
            f"the optimizer state has parameter {unknown[0]}, which the model does not; "
            "resume with the same model config or start fresh"
        )
    optimizer.load_state_dict(
        {"state": {index[name]: value for name, value in named.items()}, "param_groups": optimizer.state_dict()["param_groups"]}
    )
    return reset


def _by_name(optimizer_state: dict[str, Any], order: list[str]) -> dict[str, Any]:
    """The per-parameter optimizer state keyed by name. Format 1 numbered the parameters in
    the order the optimizer was built, which build_optimizer has kept."""
    return {order[key] if isinstance(key, int) else key: value for key, value in optimizer_state["state"].items()}


# --- sharded (DCP) ------------------------------------------------------------------------


def save_sharded(model: torch.nn.Module, optimizer: torch.optim.Optimizer, directory: Path) -> None:
    """FSDP: every rank writes its shards of the model and of the optimizer's state. A collective."""
    dcp_save(sharded_content(model, optimizer), directory)


def sharded_content(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """What an FSDP checkpoint's dcp/ holds: this rank's shards of the model and of the optimizer's
    per-parameter state (views of the live tensors, not copies)."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict

    if optimizer.state:
        model_state, optimizer_state = get_state_dict(model, optimizer)
        content = {"model": model_state, "optimizer": {"state": optimizer_state["state"]}}
    else:  # no step yet; get_state_dict would initialise the optimizer's state with a dummy step
        content = {"model": get_model_state_dict(model)}
    # The param_groups (hyperparameters) are not saved: they come from the config, and DCP
    # would pickle them. Float8's FSDP2 weight wrappers are saved as the plain tensors inside.
    return float8.plain_tensors(content)


def load_sharded(model: torch.nn.Module, optimizer: torch.optim.Optimizer, path: Path, metadata: Metadata) -> list[str] | None:
    """Checkpoint path's DCP shards into whatever model is: DCP reads each rank's part of every
    tensor (all of it for an unsharded model), whatever the world size that wrote it. Returns as
    load_full does: None, or (a checkpoint of the separate layout, converted) the fused weights
    whose optimizer state could not be converted and starts afresh."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict, set_model_state_dict, set_state_dict

    has_optimizer = any(key.startswith("optimizer.") for key in metadata.state_dict_metadata)
    separate = has_separate_entries(metadata, unwrap(model).cfg)
    if not has_optimizer:  # saved before the first step: the fresh optimizer is right
        model_state = get_model_state_dict(model)
        fused = _without_fused(model_state) if separate else {}
        dcp_load(float8.plain_tensors({"model": model_state}), path)
        reset = _load_fused(model, fused, {}, path, metadata) if separate else None
        set_model_state_dict(model, model_state | fused)
        return reset
    model_state, optimizer_state = get_state_dict(model, optimizer)
    fused = _without_fused(model_state) if separate else {}
    per_parameter = cast(dict[str, Any], optimizer_state["state"])  # keyed by parameter name
    fused_optimizer = _without_fused(per_parameter) if separate else {}
    dcp_load(float8.plain_tensors({"model": model_state, "optimizer": {"state": optimizer_state["state"]}}), path)
    reset = _load_fused(model, fused, fused_optimizer, path, metadata) if separate else None
    model_state |= fused
    per_parameter |= fused_optimizer
    set_state_dict(model, optimizer, model_state_dict=model_state, optim_state_dict=optimizer_state)
    return reset


def _without_fused(state: dict[str, Any]) -> dict[str, Any]:
    """Take the fused weights' entries out of state (a DCP load request) and return them."""
    fused = [name for name in state if part_names(name) is not None]
    return {name: state.pop(name) for name in fused}


def _load_fused(
    model: torch.nn.Module, weights: dict[str, Any], optimizer_states: dict[str, Any], path: Path, metadata: Metadata
) -> list[str]:
    """The fused weights (and their optimizer states) of a separate layout's DCP checkpoint, from
    their parts, into the tensors of the load request; the weights whose optimizer state could
    not be converted are reset (zeros: what a fresh optimizer starts from) and returned."""
    cfg = unwrap(model).cfg
    for name, tensor in weights.items():
        parts, rows = part_names(name), row_splits(name, cfg)
        assert parts is not None and rows is not None
        if not load_fused_from_parts(tensor, [f"model.{part}" for part in parts], rows, path, metadata):
            raise CheckpointError(f"checkpoint {path}: cannot fuse {name} from {', '.join(parts)}; start fresh")
    reset = []
    for name, state in optimizer_states.items():
        parts, rows = part_names(name), row_splits(name, cfg)
        assert parts is not None and rows is not None
        if not all(
            load_fused_from_parts(value, [f"optimizer.state.{part}.{key}" for part in parts], rows, path, metadata)
            for key, value in state.items()
        ):
            for value in state.values():
                with torch.no_grad():
                    (value.to_local() if isinstance(value, DTensor) else value).zero_()
            reset.append(name)
    return reset


def read_sharded_model(path: Path, metadata: Metadata) -> dict[str, torch.Tensor]:
    """The model part of checkpoint path's DCP shards, assembled into full tensors in this
    process alone (no process group needed)."""
    state = {
        f"model.{key}": torch.empty(item.size, dtype=item.properties.dtype)
        for key, item in tensor_entries(metadata, "model.").items()
    }
    dcp_load(state, path, alone=True)
    return {key.removeprefix("model."): tensor for key, tensor in state.items()}


def sharded_model_shapes(metadata: Metadata) -> dict[str, tuple[int, ...]]:
    return {key: tuple(item.size) for key, item in tensor_entries(metadata, "model.").items()}


def read_sharded_tensors(path: Path, metadata: Metadata, names: list[str]) -> Iterator[tuple[str, torch.Tensor]]:
    """The model tensors names of checkpoint path's DCP shards, whole, one at a time, in this
    process alone: DCP reads only the keys asked for, so an export of a sharded checkpoint holds
    one whole tensor at a time, never the model."""
    entries = tensor_entries(metadata, "model.")
    for name in names:
        item = entries[name]
        state = {f"model.{name}": torch.empty(item.size, dtype=item.properties.dtype)}
        dcp_load(state, path, alone=True)
        yield name, state.pop(f"model.{name}")
