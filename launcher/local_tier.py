"""The local checkpoint tier on this node (pretrain/checkpoint/tiers.py), as the launcher handles it:
decided before any worker starts (a directory the user named that cannot hold it: one line, exit 2;
the default without room: off, one warning line, and the workers get it off), on several nodes
the same for every node (off for all when any node cannot hold it), taken for the run (owner.json,
the checkpoints of an abandoned continuation removed), named to the workers, and removed when the
launch ends, whatever the end. At each launch's start the local tiers of this user's runs that
ended without removing theirs (a launcher killed by SIGKILL) are removed."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from pretrain import config as cfg
from pretrain.checkpoint import local_dirs, tiers

if TYPE_CHECKING:
    from launcher.nodes.rendezvous import Node

USABLE = "local_tier/{rank}"
"""after/<key> of the round: whether a node's local directory can hold the tier (every node's read)."""


def decide(config: cfg.Config, run_dir: Path, node: Node | None, say: Callable[[str], None] | None) -> cfg.Config:
    """The workers' config with the local tier decided on this node, for an attempt resuming
    training.resume (a path, or "" for a fresh start): as it was when the tier is usable on every
    node, training.local_checkpoint_interval 0 when it is off (said through say). After the plan
    (training.parallelism chosen, the vocabulary known: the checkpoint's size). The tier taken:
    this node's directory owned by this launcher, its checkpoints later than the one resumed
    removed (every one on a fresh start: another continuation's, never to be resumed)."""
    wanted = bool(config.training.local_checkpoint_interval)
    local_dirs.sweep_stale(
        [local_dirs.default_root(), tiers.local_root(config)], tiers.base_of(config, run_dir) if wanted else None
    )
    nodes = node.spec.nnodes if node is not None else 1
    usable: Path | None = None
    if wanted and nodes > 1 and config.training.parallelism in cfg.SHARDED_MODES:  # HSDP's format is FSDP's
        if say is not None:
            say(tiers.sharded_off_line(nodes))
    elif wanted:
        usable = tiers.local_base(config, run_dir, say)
    # Every node answers, the tier wanted or not: a node whose plan turned it off must turn it off for all.
    if node is not None and nodes > 1 and not every_node(node, usable is not None, say):
        if usable is not None:
            local_dirs.remove_empty(usable)
        usable = None
    if usable is None:
        return off(config) if wanted else config
    directory = node_dir(config, run_dir, node, checked=False)
    assert directory is not None
    tiers.take(directory, run_dir, config.training.resume)
    return config


def every_node(node: Node, usable: bool, say: Callable[[str], None] | None) -> bool:
    """Several nodes: whether every node's local directory can hold the tier (each node posts its
    own answer and waits for the others', as long as the job goes on): the workers of every node
    must save to the same tiers, so one node without room turns it off for all."""
    from launcher.nodes.rendezvous import POLL_INTERVAL

    node.post(USABLE.format(rank=node.rank), {"usable": usable})
    answers: dict[int, bool] = {}
    while len(answers) < node.spec.nnodes:
        for rank in range(node.spec.nnodes):
            if rank not in answers and (said := node.read(USABLE.format(rank=rank))) is not None:
                answers[rank] = bool(said.get("usable"))
        if len(answers) < node.spec.nnodes:
            node.check_going()  # a node that stopped (a refusal while it prepared) stops the wait
            time.sleep(POLL_INTERVAL / 2)
    unable = [rank for rank, answer in sorted(answers.items()) if not answer]
    if unable and usable and say is not None:
        which = ", ".join(str(rank) for rank in unable)
        say(f"warning: no local checkpoints on any node: node(s) {which} cannot hold them; only the durable ones")
    return not unable


def off(config: cfg.Config) -> cfg.Config:
    return dataclasses.replace(config, training=dataclasses.replace(config.training, local_checkpoint_interval=0))


def node_dir(config: cfg.Config, run_dir: Path, node: Node | None, checked: bool = True) -> Path | None:
    """This node's local checkpoints directory (None without a local tier; checked: also when it is
    not the run's, for reading)."""
    place = tiers.NodePlace(node.spec.nnodes, node.rank, node.nproc) if node is not None else tiers.NodePlace()
    if checked:
        return tiers.local_dir_of(config, run_dir, place)
    if not config.training.local_checkpoint_interval:
        return None
    return tiers.node_directory(tiers.base_of(config, run_dir), place.nodes, place.node_rank)


def env(config: cfg.Config, run_dir: Path, node: Node | None) -> dict[str, str]:
    """The workers' environment for the local tier decided (tiers.LOCAL_DIR_VAR): they take it as
    it is, so that no rank turns it off alone."""
    directory = node_dir(config, run_dir, node, checked=False)
    return {tiers.LOCAL_DIR_VAR: str(directory)} if directory is not None else {}


def remove(config: cfg.Config, run_dir: Path) -> None:
    """The run's local tier on this node, at the launch's end."""
    tiers.remove_run_local(config, run_dir)


# --- several nodes: the local step every node has ------------------------------------------

REPORT = "local_step/{rank}"
"""after/<key> of the round: a node's newest complete local step (node 0 reads every node's)."""


def report(node: Node, config: cfg.Config, run_dir: Path | None, first_world: int) -> int | None:
    """Post this node's newest complete local step for the restart node 0 plans (None: none, or
    the job's layout changed since it was written: other ranks on this node then, first_world
    workers then). run_dir: the run's, once it has one (nothing to report before the first
    attempt, nor for a command)."""
    if run_dir is None or not config.training.local_checkpoint_interval:
        return None
    steps = None
    if node.world_size == first_world and node.rank == node.spec.own_rank:
        place = tiers.NodePlace(node.spec.nnodes, node.rank, node.nproc)
        steps = tiers.local_steps(tiers.local_dir_of(config, run_dir, place), node.world_size, place.ranks)
    node.post(REPORT.format(rank=node.rank), {"steps": steps})
    return steps


def choice(
    node: Node, config: cfg.Config, run_dir: Path, first_world: int, say: Callable[[str], None]
) -> Callable[[Path | None, int], Path | None]:
    """Node 0's Attempts.local_choice for the restart it plans (agreed)."""
    return lambda durable, _world_size: agreed(node, config, run_dir, durable, first_world, say)


def agreed(
    node: Node, config: cfg.Config, run_dir: Path, durable: Path | None, first_world: int, say: Callable[[str], None]
) -> Path | None:
    """Node 0: the local checkpoint every node resumes (this node's path to it; the workers of the
    others take their own copy), or None for the durable one: only when every node reports the
    same step, newer than durable's. A node that does not report within node.loss_after counts as
    having none."""
    if not config.training.local_checkpoint_interval:
        return None
    from launcher.nodes.rendezvous import POLL_INTERVAL

    report(node, config, run_dir, first_world)
    deadline = time.monotonic() + node.loss_after
    reports: dict[int, int | None] = {}
    while len(reports) < node.spec.nnodes:
        for rank in range(node.spec.nnodes):
            if rank not in reports and (said := node.read(REPORT.format(rank=rank))) is not None:
                reports[rank] = said.get("steps")
        if len(reports) < node.spec.nnodes:
            if time.monotonic() >= deadline:
                break
            time.sleep(POLL_INTERVAL / 2)
    steps = [reports.get(rank) for rank in range(node.spec.nnodes)]
    durable_steps = tiers.steps_of(durable) if durable is not None else None
    step = tiers.agreed_step(durable_steps, steps)
    if step is None:
        if any(s is not None and (durable_steps is None or s > durable_steps) for s in steps):
            each = ", ".join(f"node {rank}: {'none' if s is None else f'step_{s}'}" for rank, s in enumerate(steps))
            say(f"the nodes' newest local checkpoints differ ({each}): resuming from the durable one")
        return None
    directory = node_dir(config, run_dir, node)
    return directory / f"step_{step}" if directory is not None else None
