"""Collective bytes by link for benchmarks/efficiency.py: which collectives cross nodes.

Ranks are node-major (launcher/nodes/node.py: rank = node x ranks per node + local rank), so a
process group lies within one node iff all its global ranks have the same rank // ranks per node.
Every counted collective is attributed by its own group: a c10d op carries the ProcessGroup
(a TorchScript object at dispatch: ProcessGroup.unbox gives it back), a functional collective
(DTensor's) the name it was registered under (its schema's group_name argument). A group whose
ranks span more than one node is an inter-node link (the network), any other an intra-node one
(NVLink on a GPU node). One node: every link is intra-node, and nothing is resolved.

The minimum for each parallelism follows the payload convention of collective_bytes_per_token
(the gathered tensor of an all-gather, the input of a reduce-scatter, the buffer of an
all-reduce), per step, over the tokens one rank trains on per step:
- DDP: one all-reduce of the fp32 gradients (4 bytes a parameter), across nodes too;
- FSDP over every rank: one all-gather of every weight and one reduce-scatter of the fp32
  gradients, all of it across nodes on several;
- HSDP (sharded within a node, replicated across): the FSDP traffic stays within the node; across
  nodes only one all-reduce per step of the fp32 gradient shard each rank holds (4 bytes a
  parameter / ranks per node);
- each plus the finite check's all-reduce over every rank (32 bytes: four int64), which crosses
  nodes on several.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist

INTER, INTRA = "inter_node", "intra_node"
FINITE_CHECK_BYTES = 32
"""pretrain/numerics/debug.py agree_on_step: one all-reduce of four int64 per step, over every rank."""
NODES_QUICK: dict[tuple[str, str, int, str], bool] = {
    ("small", "dense", 2, "none"): False,
    ("small", "muon", 2, "none"): False,
    ("production", "dense", 2, "full"): False,
}
"""--quick with --nodes 2 (--ranks 2 per node): each row both ways, hsdp and fsdp, uncompiled (the
one-node --quick rows count the compiles): a small model, with Muon (whose orthogonalization
HSDP spreads within a node), and the issue's production-shaped pair (production's widths, 2
layers, 8 micro-batches per step), in about a minute on 2 cores."""
SHARDED_ACROSS_NODES = ("hsdp", "fsdp")
"""With --nodes above 1, every row runs once per mode, training.parallelism set explicitly."""

_group_ranks: dict[str, tuple[int, ...]] = {}
"""group name -> its global ranks (a group's ranks never change; resolving them on every
collective would cost more than the collective on a CPU)."""


def link_of(ranks: Iterable[int], ranks_per_node: int) -> str:
    """INTER when the global ranks (node-major) lie on more than one node, else INTRA."""
    return INTER if len({rank // ranks_per_node for rank in ranks}) > 1 else INTRA


def group_ranks(func: Any, args: tuple, kwargs: dict) -> tuple[int, ...] | None:
    """The global ranks of the process group a c10d or functional collective op runs on; None
    when it names none (then the caller assumes every rank)."""
    for arg in args:
        if isinstance(arg, torch.ScriptObject) and "ProcessGroup" in str(arg._type()):
            group = torch._C._distributed_c10d.ProcessGroup.unbox(arg)
            return _ranks(group.group_name, group)
    for i, argument in enumerate(func._schema.arguments):
        if argument.name == "group_name":
            name = args[i] if i < len(args) else kwargs.get("group_name")
            if isinstance(name, str):
                return _ranks(name, None)
    return None


def _ranks(name: str, group: Any) -> tuple[int, ...]:
    if name not in _group_ranks:
        c10d = dist.distributed_c10d
        group = group if group is not None else c10d._resolve_process_group(c10d.GroupName(name))
        _group_ranks[name] = tuple(dist.get_process_group_ranks(group))
    return _group_ranks[name]


def op_link(func: Any, args: tuple, kwargs: dict, ranks_per_node: int | None) -> str:
    """The link a collective op's payload travels: INTRA on one node (ranks_per_node None, or
    the whole world within it); a group it cannot name is taken to span every rank."""
    if ranks_per_node is None or not dist.is_initialized() or dist.get_world_size() <= ranks_per_node:
        return INTRA
    ranks = group_ranks(func, args, kwargs)
    return link_of(ranks if ranks is not None else range(dist.get_world_size()), ranks_per_node)


# --- the minimum, and the row's values ----------------------------------------------------------


def planned_mode(count: dict[str, Any], world: int) -> str:
    """The row's parallelism as planned: "ddp", "fsdp", "hsdp"; "none" for one rank."""
    return "none" if world == 1 else str(count["plan"].get("parallelism"))


def minimum_bytes(count: dict[str, Any], row: Any) -> dict[str, float]:
    """The fewest bytes per token each kind of collective needs for the row's parallelism (every link)."""
    nodes = getattr(row, "nodes", 1)
    if nodes * row.ranks == 1:
        return {}
    tokens, parameters = count["true_tokens_per_step"], count["parameters"]
    mode = count["plan"].get("parallelism")
    if mode == "ddp":
        return {"all_reduce": (4 * parameters + FINITE_CHECK_BYTES) / tokens}
    across = 4 * parameters / row.ranks if mode == "hsdp" and nodes > 1 else 0  # the gradient shard's all-reduce
    return {
        "all_gather": count["gather_bytes"] / tokens,
        "reduce_scatter": 4 * parameters / tokens,
        "all_reduce": (across + FINITE_CHECK_BYTES) / tokens,
    }


def inter_node_minimum(count: dict[str, Any], row: Any) -> float:
    """The fewest bytes per token that must cross nodes: 0 on one node; HSDP's all-reduces only
    (the gradient shard's and the finite check's); all of DDP's or FSDP's."""
    if getattr(row, "nodes", 1) == 1:
        return 0.0
    minimum = minimum_bytes(count, row)
    return minimum["all_reduce"] if count["plan"].get("parallelism") == "hsdp" else sum(minimum.values())


def link_values(row: Any, count: dict[str, Any], eager: list[dict[str, Any]], scale: float) -> dict[str, Any]:
    """The row's keys by link: nodes, parallelism, the bytes per token that cross nodes (and by
    kind), their minimum, and those that stay within a node; each rank's bytes scaled by scale
    (the true model's parameters over the run's) and averaged over the ranks, as
    collective_bytes_per_token is."""
    nodes, tokens = getattr(row, "nodes", 1), count["true_tokens_per_step"]
    by_link: dict[str, dict[str, float]] = {INTER: {}, INTRA: {}}
    for r in eager:
        for link, per_kind in r.get("collective_bytes_by_link_per_step", {}).items():
            for kind, value in per_kind.items():
                by_link[link][kind] = by_link[link].get(kind, 0.0) + value * scale / tokens / len(eager)
    return {
        "nodes": nodes,
        "parallelism": planned_mode(count, nodes * row.ranks),
        "inter_node_bytes_per_token": sum(by_link[INTER].values()) if eager else None,
        "inter_node_minimum_bytes_per_token": inter_node_minimum(count, row),
        "intra_node_bytes_per_token": sum(by_link[INTRA].values()) if eager else None,
        "inter_node_bytes_by_kind": by_link[INTER] if eager else None,
    }


def by_link(per_step: dict[str, float]) -> dict[str, dict[str, float]]:
    """{"inter_node/all_reduce": b, ...} -> {"inter_node": {"all_reduce": b}, "intra_node": {...}}."""
    nested: dict[str, dict[str, float]] = {INTER: {}, INTRA: {}}
    for key, value in per_step.items():
        link, kind = key.split("/", 1)
        nested[link][kind] = value
    return nested


def node_env(rank: int, nodes: int, ranks_per_node: int) -> dict[str, str]:
    """The numbering torchrun gives a worker (launcher/processes/torchrun_env.py), node-major, as
    if each group of ranks_per_node ranks were a node of its own."""
    world = nodes * ranks_per_node
    node, local = divmod(rank, ranks_per_node)
    return {
        "RANK": str(rank),
        "WORLD_SIZE": str(world),
        "LOCAL_RANK": str(local),
        "LOCAL_WORLD_SIZE": str(ranks_per_node),
        "GROUP_RANK": str(node),
        "GROUP_WORLD_SIZE": str(nodes),
        "ROLE_RANK": str(rank),
        "ROLE_WORLD_SIZE": str(world),
    }
