"""Host memory a run's checkpoints take: an asynchronous save's staged copy, and the local tier's
checkpoints where they are in /dev/shm (memory). Torch-free: the launcher's plan
(pretrain/plan/host_memory.py) counts them."""

from __future__ import annotations

import os
from pathlib import Path

from pretrain.config import SHARDED_MODES, Config
from pretrain.plan.gpu_memory import FP32, GIB, ceil_div, gib, optimizer_state_bytes, parameter_count


def state_bytes(config: Config) -> int:
    """A checkpoint's tensors: the fp32 weights and the optimizer's state."""
    return (FP32 + optimizer_state_bytes(config.training)) * parameter_count(config.model)


def staged_bytes(config: Config, world_size: int, mode: str, local_ranks: int) -> int:
    """Host memory an asynchronous checkpoint's staged copy takes on one host: under FSDP over
    several ranks each rank its shard of the state (local_ranks shares), under HSDP each rank its
    shard of a node's copy (the whole state on every host), else the writer of the whole state
    one copy (rank 0; on several nodes with local checkpoints each node's first rank)."""
    here = min(local_ranks, world_size)
    if mode in SHARDED_MODES and world_size > 1:
        return ceil_div(state_bytes(config), world_size if mode == "fsdp" else here) * here
    return state_bytes(config)


def local_tier_bytes(config: Config, world_size: int, mode: str, local_ranks: int) -> int:
    """Host memory the local checkpoint tier takes on one host when it is in /dev/shm (memory):
    the newest local checkpoint and the one being written, each the whole state (its node's
    copy; under FSDP on one node every shard). 0 without the local tier, with its directory
    elsewhere, or under FSDP or HSDP on several nodes (where it is off: pretrain/checkpoint/tiers.py;
    HSDP's checkpoint is the same sharded format, its metadata written by one rank of one node)."""
    t = config.training
    directory = os.path.abspath(os.path.expanduser(t.local_checkpoint_dir)) + "/"
    in_memory = not t.local_checkpoint_dir or directory.startswith("/dev/shm/")
    several_nodes = world_size > min(local_ranks, world_size)
    if not t.local_checkpoint_interval or not in_memory or (mode in SHARDED_MODES and several_nodes):
        return 0
    return 2 * state_bytes(config)


def held_in_memory(directory: Path | None) -> int:
    """Bytes the files under directory (a run's own local tier) hold when it is in /dev/shm: on a
    restart they are the run's own, which host_memory_bytes() no longer counts as available but
    the plan counts again as the tier's (local_tier_bytes), so they are added back. 0 elsewhere."""
    if directory is None or not str(directory.absolute()).startswith("/dev/shm/"):
        return 0
    total = 0
    for root, _dirs, files in os.walk(directory):
        for name in files:
            try:
                total += os.lstat(os.path.join(root, name)).st_size
            except OSError:  # removed meanwhile
                pass
    return total


def size(n_bytes: float) -> str:
    return f"{gib(n_bytes)} GiB" if n_bytes >= GIB else f"{n_bytes / (1 << 20):.0f} MiB"
