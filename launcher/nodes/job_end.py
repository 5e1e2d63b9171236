"""How a job of several nodes' attempt ended, as node 0 reads it for the restart rules
(launcher/nodes/restart_rounds.py): every node posts its own end (after/end/<node>), and node 0
takes the job's."""

from __future__ import annotations

import dataclasses
import time
from dataclasses import asdict
from typing import Any

from launcher.exit_codes import EXIT_NODE_LOST, EXIT_OTHER_NODE_FAILED
from launcher.nodes.rendezvous import Node
from launcher.supervise.restarts import AttemptEnd


def end_record(end: AttemptEnd) -> dict[str, Any]:
    return asdict(end)


def read_end(node: Node, rank: int) -> AttemptEnd | None:
    try:
        record = node.read(f"end/{rank}")
    except Exception:
        return None
    return None if record is None else AttemptEnd(**{**record, "tail": tuple(record["tail"])})


def all_ends(node: Node) -> dict[int, AttemptEnd]:
    """Node 0: the end every node of the round has posted, by its rank."""
    return {n: end for n in range(node.spec.nnodes) if (end := read_end(node, n)) is not None}


def posted_ends(node: Node, seconds: float, poll: float = 0.05) -> dict[int, AttemptEnd]:
    """Node 0: all_ends, once the node whose failure stopped the job has posted its end too (at
    most seconds). That node posts it as soon as its workers are gone: after settle() that is
    always so, but a stop signal can end node 0's wait for the attempt before it (on a loaded
    machine), and without it the job's end would read as that node's launcher failing
    (EXIT_OTHER_NODE_FAILED)."""
    deadline = time.monotonic() + seconds
    while True:
        ends, first = all_ends(node), node.first_stop()
        waiting = first is not None and first.kind == "failed" and first.node != node.rank and first.node not in ends
        if not waiting or time.monotonic() >= deadline:
            return ends
        time.sleep(poll)


def job_end(node: Node, ends: dict[int, AttemptEnd]) -> AttemptEnd:
    """Node 0: the job's attempt as the restart rules read it, with the last step any node's
    workers printed, and a stop asked for on any node (Slurm's SIGTERM, Ctrl-C), which is never
    undone, whichever node's end the job's is."""
    steps = [end.step for end in ends.values() if end.step is not None]
    asked = any(end.stopped for end in ends.values())
    return dataclasses.replace(deciding_end(node, ends), step=max(steps) if steps else None, stopped=asked)


def deciding_end(node: Node, ends: dict[int, AttemptEnd]) -> AttemptEnd:
    """A lost node (it outranks what followed), else the end of the node whose word stopped the
    job, else the first failing node's (a graceful stop: every node's)."""
    first = node.first_stop()
    lost = next(iter(node.lost.values()), None) or (first if first is not None and first.kind == "lost" else None)
    if lost is not None:
        return AttemptEnd(EXIT_NODE_LOST, worker=f"node {lost.node}", how=f"lost: {lost.detail}", lost_node=True)
    if first is not None and first.node in ends:
        return ends[first.node]
    if first is not None:  # its launcher stopped in error: nothing to restart
        return AttemptEnd(EXIT_OTHER_NODE_FAILED, how=first.describe())
    failed = [end for _, end in sorted(ends.items()) if end.exit_code != 0]
    return (failed or [ends.get(0, AttemptEnd(0))])[0]
