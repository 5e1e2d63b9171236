"""The variables torchrun gives each worker, with values that mean the same under this launcher,
so libraries that recognize torchrun (torch's own `is_torchelastic_launched`, Lightning's
TorchElasticEnvironment, torch's `@record` error files) recognize a launched worker too.

torch 2.13's agent (torch/distributed/elastic/agent/server/local_elastic_agent.py, its
multiprocessing/api.py and torch/distributed/launcher/api.py) sets, and this module means by them:

- RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE: the job's and the node's numbering.
- GROUP_RANK, GROUP_WORLD_SIZE: torchrun's worker group is one node's workers: the node's rank and
  the number of nodes.
- ROLE_NAME, ROLE_RANK, ROLE_WORLD_SIZE: every worker has torchrun's one default role, so its role
  rank and size are its global rank and the world size.
- MASTER_ADDR, MASTER_PORT: where the job's TCPStore is.
- TORCHELASTIC_USE_AGENT_STORE: "False". Under torchrun the agent hosts that store and every rank
  connects to it; here no launcher does (node 0's launchers talk on --master-port, another
  port): the rank-0 worker's init_process_group starts the store at MASTER_ADDR:MASTER_PORT, which
  is what torch's env:// does when the value is not "True".
- TORCHELASTIC_RUN_ID: the run's id, the run directory's name (the same on every node, as
  torchrun's --rdzv-id is).
- TORCHELASTIC_RESTART_COUNT, TORCHELASTIC_MAX_RESTARTS: from Restarts below, the one place they
  come from: with --max-restarts N, the attempt's number (0 for the first, 1 after the first
  restart, ...) and N, as torchrun's; without it, 0 and 0 (launcher/attempts.py,
  launcher/nodes/restart_rounds.py).
- TORCHELASTIC_ERROR_FILE: the worker's own path, where torch's
  `torch.distributed.elastic.multiprocessing.errors.record` writes its exception as JSON.
- TORCH_NCCL_ASYNC_ERROR_HANDLING: the user's, else "3". torchrun sets "1" (tear down after
  aborting the communicators); "3" is torch's own default (tear down without that abort, which
  can hang on a broken GPU or network) and what docs/failures.md describes. Either way a failed
  or timed-out NCCL collective ends the process.
- TORCHELASTIC_SIGNALS_TO_HANDLE: torchrun's setting for its own process, which its workers
  inherit; torch's default list, which is what a process without it uses anyway.
- OMP_NUM_THREADS: launcher/processes/worker.py's, cores / workers on the node (torchrun: 1 when unset).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from pathlib import Path

ROLE_NAME = "default"
"""torchrun's role for every worker unless `--role` says otherwise."""
NCCL_ASYNC_ERROR_HANDLING = "3"
SIGNALS_TO_HANDLE = "SIGTERM,SIGINT,SIGHUP,SIGQUIT"
"""torch's default for TORCHELASTIC_SIGNALS_TO_HANDLE (torchrun's --signals-to-handle)."""
ERROR_FILE_SUFFIX = ".error.json"


@dataclass(frozen=True)
class Restarts:
    """How many times the workers were restarted so far (the attempt's number, 0 for the first),
    and at most (--max-restarts): torchrun's TORCHELASTIC_RESTART_COUNT and TORCHELASTIC_MAX_RESTARTS."""

    count: int = 0
    maximum: int = 0


NO_RESTARTS = Restarts()
"""A run without --max-restarts, or the first attempt of none: 0 and 0."""


def run_id(run_dir: Path) -> str:
    """TORCHELASTIC_RUN_ID: the run directory's name, which every node of a job shares (node 0
    chooses the directory) and a resumed run keeps."""
    return run_dir.name


def error_file(logs_dir: Path, label: str) -> Path:
    """TORCHELASTIC_ERROR_FILE for the worker with this label, beside its log
    (logs/cpu0.log: logs/cpu0.error.json)."""
    return logs_dir / f"{label.lower()}{ERROR_FILE_SUFFIX}"


def fresh_error_file(path: Path) -> str:
    """path as TORCHELASTIC_ERROR_FILE, with any file an earlier launch of the run left there
    removed (as torchrun starts each attempt in an empty directory): what is there after this
    launch is this launch's error. One that cannot be removed is left: the worker cannot write
    there either, and torch's record then only warns."""
    with contextlib.suppress(OSError):
        path.unlink(missing_ok=True)
    return str(path)


def torchrun_variables(
    *,
    rank: int,
    local_rank: int,
    world_size: int,
    local_world_size: int,
    node_rank: int,
    nnodes: int,
    master_addr: str,
    master_port: int,
    run_id: str,
    error_file: str,
    restarts: Restarts = NO_RESTARTS,
) -> dict[str, str]:
    """The variables torchrun sets for each worker (it overwrites the ones the worker would
    inherit), as this launcher means them (the module's docstring says how)."""
    return {
        "RANK": str(rank),
        "LOCAL_RANK": str(local_rank),
        "WORLD_SIZE": str(world_size),
        "LOCAL_WORLD_SIZE": str(local_world_size),
        "GROUP_RANK": str(node_rank),
        "GROUP_WORLD_SIZE": str(nnodes),
        "ROLE_NAME": ROLE_NAME,
        "ROLE_RANK": str(rank),
        "ROLE_WORLD_SIZE": str(world_size),
        "MASTER_ADDR": master_addr,
        "MASTER_PORT": str(master_port),
        "TORCHELASTIC_USE_AGENT_STORE": str(False),
        "TORCHELASTIC_RUN_ID": run_id,
        "TORCHELASTIC_RESTART_COUNT": str(restarts.count),
        "TORCHELASTIC_MAX_RESTARTS": str(restarts.maximum),
        "TORCHELASTIC_ERROR_FILE": error_file,
    }


def torchrun_defaults() -> dict[str, str]:
    """The variables torchrun passes on from its own environment when set there, else sets:
    the user's value wins (OMP_NUM_THREADS is launcher/processes/worker.py's)."""
    return {
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": NCCL_ASYNC_ERROR_HANDLING,
        "TORCHELASTIC_SIGNALS_TO_HANDLE": SIGNALS_TO_HANDLE,
    }
