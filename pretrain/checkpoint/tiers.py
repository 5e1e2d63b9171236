"""Two checkpoint tiers: durable checkpoints in <run dir>/checkpoints every
training.checkpoint_interval steps, and frequent local ones every
training.local_checkpoint_interval steps in a directory on the node (by default
/dev/shm/pretrain-<user>/<run id>-<hash>/, memory), of which only the newest is kept. A restart or
`--resume auto` continues the newest complete checkpoint of either tier (newest()); a local one
only when every node has it (agreed_step()). The local tier is removed when the run ends. Where it
lives, whose it is and its removal: pretrain/checkpoint/local_dirs.py.

Which tier a step saves to is due()'s business; the writing is pretrain/checkpoint/async_save.py's
(it saves to a Tier: directory, keep, per_node). Standard library only: the launcher decides with
it before any worker (and torch) starts.

Every rank must save to the same tiers (a save is collective): under the launcher the launcher
decided (on every node alike) and names each node's directory to its workers (LOCAL_DIR_VAR), which
take it as it is; without the launcher the ranks agree (run_tiers' agree: off for all when any
rank's directory cannot hold it).

Several nodes: each node's directory is its own (memory is), under <local dir>/node<k>/ so that
nodes sharing a host do not mix. With the single-file format each node's LOCAL_RANK 0 writes the
whole model and optimizer there (Tier.per_node), each rank its own random generators. The sharded
(FSDP, HSDP) format cannot be resumed from per-node directories (DCP's metadata is written by one
rank for all shards, and under HSDP a shard every node holds is written by one node only): there
the local tier is off, said in one line.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from pretrain.checkpoint import local_dirs
from pretrain.checkpoint.files import (
    STEP_NAME,
    OLD,
    checkpoint_problem,
    is_complete,
    step_checkpoints,
)
from pretrain.checkpoint.local_dirs import discard_later, node_directory
from pretrain.run.files import runs_root
from pretrain.run.refusal import Refusal

if TYPE_CHECKING:
    from pretrain.config import Config, ModelConfig

__all__ = [
    "LOCAL_DIR_VAR",
    "LocalDirError",
    "NodePlace",
    "Tier",
    "agreed_step",
    "base_of",
    "checkpoint_bytes",
    "discard_later",
    "due",
    "durable_tier",
    "local_base",
    "local_dir_of",
    "newest",
    "node_directory",
    "on_this_node",
    "remove_run_local",
    "run_tiers",
    "steps_of",
    "take",
    "this_node",
]

LOCAL_DIR_VAR = "PRETRAIN_LOCAL_CHECKPOINTS"
"""Set by the launcher for its workers: this node's local checkpoints directory, decided (checked,
agreed by every node, owned): the workers take it as it is."""
ROOM_FOR = 2
"""Checkpoints the local directory must have room for: the one being written beside the last."""
BYTES_PER_PARAMETER = 12
"""fp32 weights and AdamW's two fp32 moments (Muon keeps less); the rest of a checkpoint is small."""
UNKNOWN_VOCAB = 1 << 16
"""The vocabulary assumed while the dataset has not fixed it yet (a byte tokenizer's is far smaller)."""

TierName = Literal["durable", "local"]


class LocalDirError(Refusal, ValueError):
    """The local checkpoint directory the user named cannot hold the local tier; one line."""


@dataclass(frozen=True)
class Tier:
    name: TierName
    directory: Path
    """The checkpoints directory: <run dir>/checkpoints, or the node's local directory."""
    keep: int
    """step_<N> checkpoints kept after a save (local: 1; durable: training.keep_checkpoints)."""
    per_node: bool
    """Local on several nodes: each node's LOCAL_RANK 0 is that node's main writer."""


def durable_tier(config: Config, run_dir: Path) -> Tier:
    return Tier("durable", run_dir / "checkpoints", config.training.keep_checkpoints, False)


def due(steps_done: int, config: Config) -> TierName | None:
    """The tier a checkpoint after steps_done steps goes to, None when none is due. Durable wins
    when both are (a durable checkpoint is never replaced by a local one). The last step and an
    epoch's end are fit()'s to save, durable."""
    t = config.training
    if steps_done <= 0:
        return None
    if t.checkpoint_interval and steps_done % t.checkpoint_interval == 0:
        return "durable"
    if t.local_checkpoint_interval and steps_done % t.local_checkpoint_interval == 0:
        return "local"
    return None


# --- where the local tier goes ------------------------------------------------------------


def local_root(config: Config) -> Path:
    """Where the runs' local tiers go: training.local_checkpoint_dir, else /dev/shm/pretrain-<user>/."""
    return local_dirs.local_root_of(config.training.local_checkpoint_dir)


def base_of(config: Config, run_dir: Path) -> Path:
    """The run's local tier, <local root>/<run id>-<hash of its path>/ (local_dirs.run_key)."""
    return local_root(config) / local_dirs.run_key(run_dir)


def checkpoint_bytes(model: ModelConfig) -> int:
    """A checkpoint's size, estimated from the model: weights and optimizer state in fp32."""
    from dataclasses import replace

    from pretrain.plan.gpu_memory import parameter_count

    sized = model if model.vocab_size is not None else replace(model, vocab_size=UNKNOWN_VOCAB)
    return parameter_count(sized) * BYTES_PER_PARAMETER


def local_base(config: Config, run_dir: Path, say: Callable[[str], None] | None = None) -> Path | None:
    """The run's local tier (base_of(), before any node's own part), checked, or None when the
    tier is off: training.local_checkpoint_interval 0, or the default /dev/shm missing, without
    room for ROOM_FOR checkpoints, or overlapping the runs (then said through say, one warning
    line). A directory the user named (training.local_checkpoint_dir) that is not writable, too
    small, or is, holds or is inside the run directory or the runs root (a tier's removal must
    never reach into a run): LocalDirError, one line."""
    t = config.training
    if not t.local_checkpoint_interval:
        return None
    need = ROOM_FOR * checkpoint_bytes(config.model)
    root, base = local_root(config), base_of(config, run_dir)
    if t.local_checkpoint_dir:
        if (clash := local_dirs.overlap(root, run_dir, runs_root())) is not None:
            raise LocalDirError(
                f"--local-checkpoint-dir {t.local_checkpoint_dir}: {clash}; name a directory of its own, outside the run "
                "directory and the runs root, or set training.local_checkpoint_interval=0"
            )
        if (unusable := _unusable(base, need)) is not None:
            raise LocalDirError(
                f"--local-checkpoint-dir {t.local_checkpoint_dir}: {unusable}; name a writable directory with room "
                f"for {_gib(need)} (two checkpoints), or set training.local_checkpoint_interval=0"
            )
        return base
    if not local_dirs.SHM.is_dir():
        problem: str | None = f"{local_dirs.SHM} does not exist"
    elif (clash := local_dirs.overlap(root, run_dir, runs_root())) is not None:
        problem = f"{root}: {clash}"
    else:
        if (problem := _unusable(base, need)) is not None:
            local_dirs.remove_empty(base)
    if problem is not None:
        if say is not None:
            say(
                f"warning: no local checkpoints ({problem}); only the durable ones every training.checkpoint_interval "
                f"steps; name a directory with room for {_gib(need)} with --local-checkpoint-dir"
            )
        return None
    return base


def _unusable(directory: Path, need: int) -> str | None:
    """Why directory cannot hold need bytes of checkpoints (None when it can): it is created
    if missing, and written to. What its checkpoints hold already counts as room (a restart's)."""
    try:
        directory.mkdir(parents=True, exist_ok=True)
        probe = directory / f".probe-{os.getpid()}"
        probe.write_bytes(b"")
        probe.unlink()
        free = shutil.disk_usage(directory).free + _used(directory)
    except OSError as error:
        return f"{directory} is not writable ({error.strerror or error})"
    if free < need:
        return f"{directory}: {_gib(free)} free, too small for two checkpoints of {_gib(need // ROOM_FOR)}"
    return None


def _used(directory: Path) -> int:
    total = 0
    for root, _dirs, files in os.walk(directory):
        for name in files:
            try:
                total += os.lstat(os.path.join(root, name)).st_size
            except OSError:
                pass
    return total


def _gib(n_bytes: int) -> str:
    return f"{n_bytes / (1 << 30):.2f} GiB" if n_bytes >= 1 << 30 else f"{n_bytes / (1 << 20):.1f} MiB"


@dataclass(frozen=True)
class NodePlace:
    """Where a worker's node sits in the job (the worker contract's GROUP_WORLD_SIZE, GROUP_RANK and
    LOCAL_WORLD_SIZE; one node when they are not set)."""

    nodes: int = 1
    node_rank: int = 0
    per_node: int = 1
    """Workers per node."""

    @property
    def ranks(self) -> range | None:
        """The ranks whose random generators the node's local checkpoints hold; None: every rank's."""
        return None if self.nodes <= 1 else range(self.node_rank * self.per_node, (self.node_rank + 1) * self.per_node)


def this_node(env: Mapping[str, str] | None = None) -> NodePlace:
    env = os.environ if env is None else env
    try:
        return NodePlace(
            int(env.get("GROUP_WORLD_SIZE") or 1), int(env.get("GROUP_RANK") or 0), int(env.get("LOCAL_WORLD_SIZE") or 1)
        )
    except ValueError:
        return NodePlace()


def run_tiers(
    config: Config,
    run_dir: Path,
    sharded: bool,
    say: Callable[[str], None] | None = None,
    agree: Callable[[bool], bool] | None = None,
    environ: Mapping[str, str] | None = None,
) -> dict[TierName, Tier]:
    """A worker's tiers by name (CheckpointWriter's): durable always, local when it is on, on this
    worker's node (the worker contract's environment, this_node()). Under the launcher
    (LOCAL_DIR_VAR set) the directory it decided, unchecked: a check here could turn the tier off on
    one rank alone, whose saves would then leave the others waiting. Without it, every rank
    checks and agree (every rank's answer -> whether all can) decides for all; each node's first
    rank then takes the directory (owner.json; local checkpoints later than the one resumed, all
    of them on a fresh start, removed)."""
    env = os.environ if environ is None else environ
    place = this_node(env)
    found: dict[TierName, Tier] = {"durable": durable_tier(config, run_dir)}
    if not config.training.local_checkpoint_interval:
        return found
    if sharded and place.nodes > 1:
        if say is not None:
            say(sharded_off_line(place.nodes))
        return found
    if decided := env.get(LOCAL_DIR_VAR):
        found["local"] = Tier("local", Path(decided), 1, place.nodes > 1)
        return found
    base = local_base(config, run_dir, say)
    if agree is not None and not agree(base is not None):
        if base is not None:
            if say is not None:
                say("warning: no local checkpoints: another rank's local directory cannot hold them; only the durable ones")
            local_dirs.remove_empty(base)
        return found
    if base is None:
        return found
    directory = node_directory(base, place.nodes, place.node_rank)
    if int(env.get("LOCAL_RANK") or 0) == 0:
        take(directory, run_dir, config.training.resume)
    found["local"] = Tier("local", directory, 1, place.nodes > 1)
    return found


def take(directory: Path, run_dir: Path, resume: str, pid: int | None = None) -> None:
    """Make directory run_dir's local checkpoints directory on this node, owned by process pid
    (default: this one): a foreign one's checkpoints removed, owner.json written, and the
    checkpoints later than the one resume names (a path; "" for a fresh start: every one) removed."""
    if not local_dirs.owned_by(directory, run_dir):
        discard_later(directory, -1)
    local_dirs.claim(directory, run_dir, pid)
    if (steps := local_dirs.resumed_steps(resume)) is not None:
        discard_later(directory, steps)


def sharded_off_line(nodes: int) -> str:
    return (
        f"warning: no local checkpoints: the sharded (FSDP, HSDP) format on {nodes} nodes cannot be resumed from "
        "per-node directories; only the durable ones every training.checkpoint_interval steps"
    )


# --- which checkpoint a resume takes --------------------------------------------------------


def steps_of(checkpoint: Path) -> int:
    """The steps a checkpoint directory's name says (step_<N>), -1 for another name."""
    match = STEP_NAME.fullmatch(checkpoint.name.removesuffix(OLD))
    return int(match[1]) if match else -1


def newest(
    durable_dir: Path,
    local_dir: Path | None,
    world_size: int | None,
    say: Callable[[str], None] | None = None,
    ranks: Iterable[int] | None = None,
) -> Path | None:
    """The newest complete checkpoint of either tier for a resume on world_size ranks; ties go to
    the durable one. A local checkpoint newer than the one chosen but damaged is passed over,
    said through say with what is resumed instead. ranks: those whose random generators the
    local directory holds (a node's, on several nodes; None: every rank's)."""
    durable = _latest(durable_dir, world_size)
    local, passed = _latest_local(local_dir, world_size, ranks, durable) if local_dir is not None else (None, [])
    chosen = local if local is not None and (durable is None or steps_of(local) > steps_of(durable)) else durable
    if say is not None:
        if chosen is None:
            instead = "no other checkpoint to resume: starting at step 0"
        else:
            instead = f"resuming from the {'local' if chosen == local else 'durable'} {chosen}"
        for path, problem in passed:
            say(f"warning: local checkpoint {path} is damaged ({problem}); {instead}")
    return chosen


def _latest(checkpoints_dir: Path, world_size: int | None, ranks: Iterable[int] | None = None) -> Path | None:
    chosen = list(ranks) if ranks is not None else None
    for _, path in reversed(step_checkpoints(checkpoints_dir)):
        if chosen is None and is_complete(path, world_size):
            return path
        if chosen is not None and checkpoint_problem(path, world_size, chosen) is None:
            return path
    return None


def _latest_local(
    local_dir: Path, world_size: int | None, ranks: Iterable[int] | None, durable: Path | None
) -> tuple[Path | None, list[tuple[Path, str]]]:
    """The newest complete local checkpoint newer than durable (None: none), and the damaged
    ones passed over on the way, each with its first problem."""
    chosen = list(ranks) if ranks is not None else None
    floor = steps_of(durable) if durable is not None else -1
    passed: list[tuple[Path, str]] = []
    for steps, path in reversed(step_checkpoints(local_dir)):
        if steps <= floor:
            break
        problem = checkpoint_problem(path, world_size, chosen)
        if problem is None:
            return path, passed
        if any(path.iterdir()):
            passed.append((path, problem.split("; ")[0]))
    return None, passed


def local_steps(local_dir: Path | None, world_size: int | None, ranks: Iterable[int] | None = None) -> int | None:
    """The steps of the node's newest complete local checkpoint (a node's report), None: none."""
    if local_dir is None:
        return None
    found = _latest(local_dir, world_size, ranks)
    return steps_of(found) if found is not None else None


def agreed_step(durable_steps: int | None, reports: list[int | None]) -> int | None:
    """The local step every node resumes (each node's report: its newest complete local step), or
    None for the durable checkpoint: only when every node has the same one, newer than the durable."""
    if not reports or any(report is None for report in reports) or len(set(reports)) != 1:
        return None
    step = reports[0]
    assert step is not None
    return step if durable_steps is None or step > durable_steps else None


def on_this_node(checkpoint: Path, local_dir: Path | None) -> Path:
    """A local checkpoint node 0 chose (under its node<k>/), as this node's own copy in local_dir
    (this node's directory); any other checkpoint as it is."""
    if local_dir is None or not local_dir.name.startswith("node"):
        return checkpoint
    parent = checkpoint.parent
    if parent.name.startswith("node") and parent.parent.resolve() == local_dir.parent.resolve():
        return local_dir / checkpoint.name
    return checkpoint


def local_dir_of(config: Config, run_dir: Path, place: NodePlace) -> Path | None:
    """Where this node's local checkpoints of the run are (without checking room: for reading), or
    None without a local tier, or when the directory is not the run's (its owner.json names
    another run directory, or none)."""
    if not config.training.local_checkpoint_interval:
        return None
    directory = node_directory(base_of(config, run_dir), place.nodes, place.node_rank)
    return directory if local_dirs.owned_by(directory, run_dir) else None


# --- housekeeping -------------------------------------------------------------------------


def remove_run_local(config: Config, run_dir: Path) -> None:
    """Remove the run's local tier on this node, if it has one, at the run's end (whatever the
    end): what the tier put in base_of() (every node<k>/ of the run in it: the others are on other
    machines, or ending too), then the directories it made once empty. Never raises."""
    if config.training.local_checkpoint_interval:
        local_dirs.remove_tier(base_of(config, run_dir), run_dir)
