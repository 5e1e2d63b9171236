"""Where this process runs: its rank, its device, its log label, its process group.

Reads the worker contract's environment (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, GPU_RANK,
LAUNCHER_CUDA_DEVICE_INDEX, MASTER_*), so the same code runs under the launcher, under torchrun,
or alone."""

from __future__ import annotations

import logging
import os
import sys
from dataclasses import dataclass
from datetime import timedelta
from typing import NoReturn

import torch
import torch.distributed as dist

from pretrain.config import Config
from pretrain.distributed.peer_loss import peer_gone
from pretrain.run.refusal import Refusal

CUDA_DEVICE_INDEX_VAR = "LAUNCHER_CUDA_DEVICE_INDEX"
"""Set by the launcher (launcher/processes/worker.py): this worker's own GPU among those it sees, cuda:<n>."""


class RuntimeSetupError(Refusal, RuntimeError):
    """The requested device cannot be used here; the message is one line."""


@dataclass(frozen=True)
class Runtime:
    rank: int
    world_size: int
    device: torch.device
    label: str
    """How this process names itself in log lines: "GPU 3" or "CPU 0"."""
    ranks_per_node: int = 0
    """The ranks on each node (LOCAL_WORLD_SIZE: torchrun's and the launcher's); 0, the default,
    is every rank on one node. Ranks are node-major: rank = node_rank * ranks_per_node + local_rank."""

    def __post_init__(self) -> None:
        if not self.ranks_per_node:
            object.__setattr__(self, "ranks_per_node", self.world_size)  # frozen: set once, here
        if self.ranks_per_node < 1 or self.world_size % self.ranks_per_node:
            raise ValueError(f"{self.world_size} ranks do not make whole nodes of {self.ranks_per_node}")

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    @property
    def nodes(self) -> int:
        """How many nodes the ranks are on (1 unless LOCAL_WORLD_SIZE says fewer ranks per node than there are)."""
        return self.world_size // self.ranks_per_node

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name, "").strip()
    if not value:
        return default
    try:
        return int(value)
    except ValueError:
        raise RuntimeSetupError(f"environment variable {name}={value!r} is not an integer") from None


def choose_device(config: Config) -> torch.device:
    """Which GPU this process uses. Under the launcher: cuda:LAUNCHER_CUDA_DEVICE_INDEX (0 when
    it sees only its own GPU, LOCAL_RANK when it sees every run GPU of its node). With GPU_RANK
    set (alone on a GPU it was given) or one GPU visible: cuda:0. Under torchrun with several
    GPUs visible: cuda:LOCAL_RANK, so the ranks of a node get different GPUs (NCCL refuses two
    ranks on one). Alone with several visible: cuda:system.device_id (default 0)."""
    wanted = config.system.device
    if wanted == "cpu" or (wanted == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise RuntimeSetupError("system.device is cuda but no CUDA GPU is visible; use --set system.device=cpu")
    visible = torch.cuda.device_count()
    if CUDA_DEVICE_INDEX_VAR in os.environ:
        return _launcher_device(visible)
    if "GPU_RANK" in os.environ or visible == 1:
        return torch.device("cuda", 0)
    local_ranks = _env_int("LOCAL_WORLD_SIZE", 1) if "LOCAL_RANK" in os.environ else 1
    if local_ranks > 1:
        return _local_rank_device(config, visible)
    index = config.system.device_id or 0
    if index >= visible:
        raise RuntimeSetupError(f"system.device_id {index} does not exist; {visible} GPU(s) are visible")
    return torch.device("cuda", index)


def _visibility() -> str:
    """The variable that made the GPUs visible, with its value: ROCR_VISIBLE_DEVICES on ROCm (the
    launcher's AMD workers), CUDA_VISIBLE_DEVICES on CUDA."""
    name = "ROCR_VISIBLE_DEVICES" if torch.version.hip else "CUDA_VISIBLE_DEVICES"
    return f"{name}={os.environ.get(name, '')}"


def _launcher_device(visible: int) -> torch.device:
    """The GPU the launcher says is this worker's own."""
    index = _env_int(CUDA_DEVICE_INDEX_VAR, 0)
    if not 0 <= index < visible:
        raise RuntimeSetupError(
            f"{CUDA_DEVICE_INDEX_VAR}={index} names no GPU: {visible} GPU(s) are visible "
            f"({_visibility()}); unset it, or start this through the launcher"
        )
    return torch.device("cuda", index)


def _local_rank_device(config: Config, visible: int) -> torch.device:
    """torchrun started several processes on this node: one GPU each, by LOCAL_RANK."""
    local_rank, local_ranks = _env_int("LOCAL_RANK", 0), _env_int("LOCAL_WORLD_SIZE", 1)
    if config.system.device_id is not None:
        raise RuntimeSetupError(
            f"system.device_id pins one GPU but {local_ranks} processes run on this node "
            f"(LOCAL_WORLD_SIZE); set system.device_id=null so each takes GPU LOCAL_RANK"
        )
    if local_rank >= visible:
        raise RuntimeSetupError(
            f"LOCAL_RANK {local_rank} has no GPU of its own: {visible} GPU(s) are visible; "
            f"start at most {visible} processes per node (torchrun --nproc-per-node)"
        )
    return torch.device("cuda", local_rank)


def device_label(device: torch.device, rank: int) -> str:
    """GPU n with n the physical index, else CPU <rank>. The physical index is GPU_RANK
    (set by the launcher), else the device's entry in CUDA_VISIBLE_DEVICES, else its index."""
    if device.type != "cuda":
        return f"CPU {rank}"
    if os.environ.get("GPU_RANK"):
        return f"GPU {os.environ['GPU_RANK']}"
    visible = [v.strip() for v in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if v.strip()]
    if all(v.isdigit() for v in visible) and device.index < len(visible):
        return f"GPU {visible[device.index]}"  # cuda:i is the i-th GPU listed
    return f"GPU {device.index}"


def setup_logging(label: str, level: str) -> logging.Logger:
    """Lines `LEVEL | [GPU n] message` on stdout; the supervisor adds its prefix."""
    handler = logging.StreamHandler(sys.stdout)
    handler.setFormatter(logging.Formatter(f"%(levelname)s | [{label}] %(message)s"))
    logger = logging.getLogger("pretrain")
    logger.handlers[:] = [handler]
    logger.setLevel(level)
    logger.propagate = False
    return logger


def ranks_per_node(world_size: int) -> int:
    """LOCAL_WORLD_SIZE (default: world_size, one node), checked to divide world_size into whole
    nodes: the ranks of a job are spread evenly, node by node (torchrun and the launcher do so)."""
    local = _env_int("LOCAL_WORLD_SIZE", world_size)
    if local < 1 or world_size % local:
        raise RuntimeSetupError(
            f"LOCAL_WORLD_SIZE={local} does not divide WORLD_SIZE={world_size} into whole nodes; "
            "set it to the ranks on each node (the same on every node), or unset it for one node"
        )
    return local


def init_runtime(config: Config) -> Runtime:
    """Pick the device and join the process group when there is more than one rank."""
    rank, world_size = _env_int("RANK", 0), _env_int("WORLD_SIZE", 1)
    local_ranks = ranks_per_node(world_size)  # checked before any process group is joined
    device = choose_device(config)
    if device.type == "cuda":
        torch.cuda.set_device(device)
        # fp32 matmuls (the parts autocast leaves in fp32, and use_amp=false runs) on TF32
        # tensor cores: ~8x the fp32 rate for a 10-bit mantissa, which training tolerates.
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    if world_size > 1:
        # null: the worker may still choose offload (pretrain/build.py parallel_mode)
        backend = process_group_backend(device, host_tensors=config.training.cpu_offload is not False)
        dist.init_process_group(
            backend=backend,
            rank=rank,
            world_size=world_size,
            timeout=timedelta(seconds=config.system.collective_timeout),
            device_id=device if device.type == "cuda" else None,
        )
    return Runtime(rank=rank, world_size=world_size, device=device, label=device_label(device, rank), ranks_per_node=local_ranks)


def process_group_backend(device: torch.device, host_tensors: bool) -> str:
    """gloo on CPU; NCCL on GPUs, with gloo beside it when collectives may run on tensors in host
    memory (CPU offload keeps the shards there, and NCCL reduces no host tensor)."""
    if device.type != "cuda":
        return "gloo"
    return "cuda:nccl,cpu:gloo" if host_tensors else "nccl"


def shutdown(runtime: Runtime, peers_alive: bool) -> None:
    """Leave the process group. When every rank ends together (success, an agreed stop)
    each first waits for the others: gloo ranks that tear down while a peer still talks
    abort with SIGABRT. After a failure there is no barrier, since the peers may never arrive."""
    if dist.is_initialized():  # also the one-process group of FSDP with CPU offload (pretrain/distributed/parallel.py)
        if peers_alive and runtime.distributed:
            try:
                dist.barrier()
            except RuntimeError as error:
                if peer_gone(error) is None:
                    raise
                # A peer that passed the barrier can exit, closing its connection, before gloo here
                # has taken the barrier's last message: "Connection closed by peer" after the run
                # ended together. This rank's work is done (a peer that crashed instead reports its
                # own exit code to the launcher): leave the broken group to the process's exit.
                return
        elif runtime.distributed and "nccl" in str(dist.get_backend()):
            # After a failure NCCL's destroy can block on peers that will never come: leave the
            # group to the process's exit (the launcher tears the other ranks down).
            return
        dist.destroy_process_group()


def exit_process(code: int) -> NoReturn:
    """End a process that used torch.distributed, skipping interpreter finalization: there, gloo's
    worker threads can still be dropping a finished collective's last reference, which takes the
    GIL of an interpreter being torn down and aborts (SIGABRT, "terminate called without an
    active exception") a process that succeeded, even after destroy_process_group (seen in about
    1 of 10 two-rank CPU runs with torch 2.13; pytorch/pytorch#179291). Logs and the standard
    streams are flushed first."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def mean_across_ranks(value: torch.Tensor, runtime: Runtime) -> float:
    """The mean of a scalar over all ranks (gloo has no AVG, so sum and divide)."""
    if runtime.distributed:
        value = value.detach().clone()
        dist.all_reduce(value, op=dist.ReduceOp.SUM)
        value /= runtime.world_size
    return float(value)
