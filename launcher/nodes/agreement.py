"""What the launchers of one job tell each other when they join (launcher/nodes/rendezvous.py),
and what they must agree on: one worker count per node, one device kind, one config (or command),
and the restart options, which every node reads alike (one budget, one backoff, one least count
of nodes: launcher/nodes/restart_rounds.py)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from launcher.supervise.restarts import DEFAULT_BACKOFF

RESTART_OPTIONS = ("--max-restarts", "--min-nnodes", "--restart-backoff")
NO_RESTARTS: dict[str, Any] = {"--max-restarts": 0}
"""A launch without --max-restarts (its other restart options then mean nothing)."""


@dataclass(frozen=True)
class Member:
    """What one launcher tells the others when it joins."""

    node: int
    host: str
    pid: int
    nproc: int
    device: str
    gpu_memory: int | None = None
    """The smallest of its GPUs' memory, in bytes (the job's smallest GPU decides DDP or FSDP)."""
    config: dict[str, Any] | None = None
    """The config as this node resolved it from its options (None for a `-- COMMAND`)."""
    restarts: dict[str, Any] | None = None
    """Its restart options by name (RESTART_OPTIONS); None: no restarts."""


def joined_line(nnodes: int, world_size: int, nproc: int) -> str:
    """What every node says once the job has formed; one node (a restart's round that went on
    alone, --min-nnodes 1) has no "all" and no "each"."""
    workers = f"{world_size} worker{'s' if world_size != 1 else ''}"
    if nnodes == 1:
        return f"the only node joined: {workers}"
    return f"all {nnodes} nodes joined: {workers}, {nproc} on each node"


def restart_options(max_restarts: int, min_nnodes: int | None, restart_backoff: float | None) -> dict[str, Any]:
    """As the nodes compare them: --restart-backoff not given is its default, so it agrees with one given as 1."""
    backoff = DEFAULT_BACKOFF if restart_backoff is None else restart_backoff
    return dict(zip(RESTART_OPTIONS, (max_restarts, min_nnodes, backoff), strict=True))


def disagreement(members: list[Member]) -> str | None:
    """Why the joined nodes cannot form one job, or None."""
    first = members[0]
    for other in members[1:]:
        if other.nproc != first.nproc:
            counts = ", ".join(f"node {m.node}: {m.nproc}" for m in members)
            return f"the nodes start different numbers of workers ({counts}); give every node the same --nproc or --gpus count"
        if other.device != first.device:
            return f"node 0 runs on {first.device} and node {other.node} on {other.device}; use one --device on every node"
        if other.config != first.config:
            keys = ", ".join(differences(first.config, other.config)[:5]) or "the command"
            return (
                f"node {other.node} ({other.host}) was given a different config from node 0 ({keys}); "
                "launch every node with the same options"
            )
        if problem := restarts_differ(first, other):
            return problem
    return None


def restarts_differ(first: Member, other: Member) -> str | None:
    """Node 0's restart options against another node's: the first that differs, both values named."""
    ours, theirs = first.restarts or NO_RESTARTS, other.restarts or NO_RESTARTS
    names = RESTART_OPTIONS if ours["--max-restarts"] and theirs["--max-restarts"] else RESTART_OPTIONS[:1]
    for name in names:
        if ours.get(name) != theirs.get(name):
            return (
                f"node {other.node} ({other.host}) was started {_with(name, theirs.get(name))} and node 0 "
                f"{_with(name, ours.get(name))}; give every node the same {name}"
            )
    return None


def _with(name: str, value: Any) -> str:
    given = value is not None and not (name == "--max-restarts" and value == 0)  # 0 is the default: restarts off
    return f"with {name} {value:g}" if given else f"without {name}"


def differences(a: Any, b: Any, prefix: str = "") -> list[str]:
    """The dotted keys where two configs (dicts of dicts) differ."""
    if isinstance(a, dict) and isinstance(b, dict):
        keys = sorted(set(a) | set(b))
        return [d for k in keys for d in differences(a.get(k), b.get(k), f"{prefix}{k}.")]
    return [] if a == b else [prefix.rstrip(".") or "the config"]
