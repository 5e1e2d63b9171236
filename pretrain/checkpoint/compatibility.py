"""Whether a checkpoint fits the run that resumes it: its steps, model, optimizer and data,
checked before anything is loaded (pretrain/checkpoint/save_restore.py restore). Each refusal is
a CheckpointError, one line naming the checkpoint and the fix."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import torch

from pretrain import config as cfg
from pretrain.checkpoint.files import CheckpointError
from pretrain.checkpoint.model_state import model_shapes
from pretrain.checkpoint.separate_layout import shapes_as_saved
from pretrain.distributed.parallel import unwrap

ARCHITECTURE_KEYS = ("dim", "n_layers", "n_heads", "n_kv_heads", "ffn", "ffn_dim", "vocab_size", "moe")
"""The model keys that define its parameters. The others (norm_eps, rope_theta, max_seq_len,
init_std) may change on resume: raising rope_theta with max_seq_len is how a context is extended."""
ROUTING_KEYS = ("capacity_factor",)
"""The model.moe keys that may change on resume: how tokens reach the experts, not the experts'
weights (a run of the capacity routing, 1.25 before dropless was the default, resumes dropless)."""


def check_steps(path: Path, steps_done: int, max_steps: int) -> None:
    """A checkpoint past the end of this run would train backwards (equal: nothing left to train)."""
    if steps_done > max_steps:
        raise CheckpointError(
            f"checkpoint {path} has {steps_done} steps done, more than training.max_steps "
            f"{max_steps}; raise --max-steps or resume an earlier checkpoint"
        )


def check_same_model(path: Path, saved: cfg.ModelConfig, current: cfg.ModelConfig) -> None:
    for key in ARCHITECTURE_KEYS:
        there, here = getattr(saved, key), getattr(current, key)
        if key == "moe":  # the routing may change (ROUTING_KEYS): compared as the current run's
            there = dataclasses.replace(there, **{name: getattr(here, name) for name in ROUTING_KEYS})
        if there != here:
            raise CheckpointError(
                f"checkpoint {path} is for a different model: model.{key} is {there} there, "
                f"{here} here; resume with the same model config or start fresh"
            )


def check_same_optimizer(path: Path, saved: cfg.TrainingConfig, current: cfg.TrainingConfig) -> None:
    """One optimizer's state does not load into another's."""
    if saved.optimizer != current.optimizer:
        raise CheckpointError(
            f"checkpoint {path} was trained with training.optimizer={saved.optimizer}, not "
            f"{current.optimizer}; resume with --set training.optimizer={saved.optimizer} or start fresh"
        )


def check_same_hub_files(path: Path, saved: cfg.DataConfig, current: cfg.DataConfig) -> None:
    """A Hub dataset read from other files or another commit is another token stream: the saved
    data position would name other windows, so training would repeat or skip data silently.
    (Local files are not compared: their identity includes modification times, which a copy
    changes without changing a byte.)"""
    if saved.source != "hub" or current.source != "hub":
        return
    for key in ("hub_repo", "hub_files", "hub_revision", "hub_max_files"):
        there, here = getattr(saved, key), getattr(current, key)
        if there != here:
            raise CheckpointError(
                f"checkpoint {path} was trained on other Hub data: data.{key} is {there!r} there, "
                f"{here!r} here; resume with --set data.{key}={json.dumps(there)} or start fresh"
            )


def check_shapes(path: Path, saved: dict[str, tuple[int, ...]], model: torch.nn.Module) -> None:
    """The checkpoint has exactly the model's tensors, each of the same (full) shape: under their
    separate names and shapes in a checkpoint of the separate layout (before the fused projections)."""
    current = shapes_as_saved(model_shapes(model), saved, unwrap(model).cfg)
    for key in sorted(saved.keys() | current.keys()):
        there, here = saved.get(key), current.get(key)
        if there != here:

            def show(shape: tuple[int, ...] | None) -> str:
                return "absent" if shape is None else f"of shape {list(shape)}"

            raise CheckpointError(
                f"checkpoint {path} is for a different model: {key} is {show(there)} there, "
                f"{show(here)} here; resume with the same model config or start fresh"
            )
