"""A launch on several nodes, as the command line runs it: which node this is (flags, else
Slurm), joining the others, telling them when this launcher stops in error, and the last word
once this node's workers are gone. launcher/nodes/rendezvous.py moves the words between nodes."""

from __future__ import annotations

import argparse
import os
import signal
import socket
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from launcher.errors import UsageError
from launcher.exit_codes import EXIT_INTERRUPTED, EXIT_NODE_LOST, EXIT_OTHER_NODE_FAILED, by_signal
from launcher.nodes.node import Layout, NodeSpec, NodeStop, node_spec
from launcher.gpus.placement import Placement
from launcher.nodes.agreement import Member, differences
from launcher.nodes.rendezvous import LOSS_AFTER, Node, NodeInterrupted, NodeStopped, RendezvousError, join

DEFAULT_JOIN_TIMEOUT = 300.0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """torchrun's names, with dashes or underscores (docs/multinode.md)."""
    nodes = parser.add_argument_group("several machines", "one launcher per machine; under Slurm read from its variables")
    nodes.add_argument("--nnodes", type=int, metavar="N", help="machines in the job (default: 1, or SLURM_NNODES)")
    nodes.add_argument(
        "--node-rank",
        "--node_rank",
        dest="node_rank",
        type=int,
        metavar="R",
        help="this machine's number, 0 to N-1 (SLURM_NODEID)",
    )
    nodes.add_argument(
        "--master-addr",
        "--master_addr",
        dest="master_addr",
        metavar="HOST",
        help="node 0's address (the first host of SLURM_JOB_NODELIST)",
    )
    nodes.add_argument(
        "--master-port",
        "--master_port",
        dest="master_port",
        type=int,
        metavar="PORT",
        help="where node 0's launcher hosts the rendezvous "
        "(default: MASTER_PORT, else one derived from SLURM_JOB_ID, else 29500)",
    )
    nodes.add_argument(
        "--join-timeout",
        "--join_timeout",
        dest="join_timeout",
        type=float,
        default=DEFAULT_JOIN_TIMEOUT,
        metavar="S",
        help="seconds to wait for every node to join, and at a restart for its devices and a lost node "
        f"(default: {DEFAULT_JOIN_TIMEOUT:g})",
    )
    nodes.add_argument(
        "--node-timeout",
        "--node_timeout",
        dest="node_timeout",
        type=float,
        default=LOSS_AFTER,
        metavar="S",
        help=f"a node whose launcher is silent this long is lost and stops the job (default: {LOSS_AFTER:g}; "
        "raise it on a network that stalls for longer)",
    )

    nodes.add_argument(
        "--min-nnodes",
        "--min_nnodes",
        dest="min_nnodes",
        type=int,
        metavar="M",
        help="a restart (--max-restarts) whose lost nodes do not come back within --join-timeout goes on with "
        "at least M nodes, keeping the global batch (default: every node, else the job stops)",
    )


def check_restart_arguments(args: argparse.Namespace, nnodes: int) -> None:
    """--min-nnodes and --min-nproc as a job of nnodes nodes reads them: one line each."""
    low = args.min_nnodes
    if low is not None:
        if low < 1:
            raise UsageError(f"--min-nnodes must be at least 1 (got {low})")
        if args.max_restarts == 0:
            raise UsageError("--min-nnodes only applies to restarts: add --max-restarts N")
        if low > nnodes:
            raise UsageError(f"--min-nnodes {low} is more than this job's {nnodes} node(s) (--nnodes); give at most {nnodes}")
    if nnodes > 1 and args.min_nproc is not None:
        raise UsageError(
            "--min-nproc applies to one machine; on several nodes a restart keeps every node's worker count (see --min-nnodes)"
        )


def spec_from(nnodes: int | None, node_rank: int | None, master_addr: str | None, master_port: int | None) -> NodeSpec | None:
    """This launcher's node, from its options and (under Slurm) the environment; None on one machine."""
    return node_spec(nnodes, node_rank, master_addr, master_port, os.environ)


def join_job(
    spec: NodeSpec,
    placement: Placement,
    identity: dict[str, Any],
    timeout: float,
    say: Callable[[str], None],
    loss_after: float = LOSS_AFTER,
    namespace: str = "",
    hosted: Any = None,
    restarts: dict[str, Any] | None = None,
) -> Node:
    """Join the other nodes; identity is what every node must agree on (the config, or the command),
    and so are restarts (launcher/nodes/agreement.py's restart_options; None: no restarts).
    namespace and hosted: a restart's round (launcher/nodes/restart_rounds.py)."""
    gpu_memory = min(gpu.memory_total for gpu in placement.gpus) if placement.device == "cuda" and placement.gpus else None
    member = Member(
        node=spec.node_rank,
        host=socket.gethostname(),
        pid=os.getpid(),
        nproc=placement.world_size,
        device=placement.device,
        gpu_memory=gpu_memory,
        config=identity,
        restarts=restarts,
    )
    return join(spec, member, timeout, say, loss_after, namespace, hosted)


def layout(node: Node | None, placement: Placement) -> Layout:
    if node is None:
        return Layout(placement.world_size)
    return Layout(placement.world_size, node.rank, node.spec.nnodes, node.spec.master_addr)


@contextmanager
def telling_others(node: Node) -> Iterator[None]:
    """An error that stops this launcher stops the other nodes too: they say which node and why,
    instead of waiting for workers that never come."""
    try:
        yield
    except (NodeStopped, NodeInterrupted):
        node.finish(EXIT_NODE_LOST, 0)
        raise
    except (KeyboardInterrupt, SystemExit) as stopped:
        # Ctrl-C, or SIGTERM / SIGHUP (sigterm_as_exit) before the supervisor took over: every
        # node stops the same way, as it would once the workers run.
        code = EXIT_INTERRUPTED if isinstance(stopped, KeyboardInterrupt) else int(stopped.code or 0)
        for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            if code == by_signal(signum):
                node.report_interrupt(signum)
        node.finish(code, node.loss_after)
        raise
    except BaseException as error:
        detail = (str(error).splitlines() or [type(error).__name__])[0] or type(error).__name__
        node.publish_stop(NodeStop(node.rank, node.member.host, "error", detail))
        node.finish(2, node.loss_after)
        raise


def settle(node: Node, code: int, wait: float, say: Callable[[str], None]) -> int:
    """After this node's workers are gone: say so to the others (node 0 waits for them) and
    learn which nodes were lost. A lost node outranks this node's own outcome: had a failure
    here come first, the lost node would have heard it and finished; collectives failing, and
    failures following, are what a dead node does to the others. Returns the exit code."""
    node.finish(code, wait)
    if code == 0 and (failed := {n: c for n, c in node.others_done.items() if c != 0}):
        # Node 0's workers finished, and another node failed afterwards: the job did not succeed.
        for other, its_code in sorted(failed.items()):
            say(f"node {other} ({node.host_of(other)}) failed after this node's workers had finished (exit code {its_code})")
        say(f"exit code {EXIT_OTHER_NODE_FAILED}: another node failed")
        return EXIT_OTHER_NODE_FAILED
    if not node.lost or code == 0:
        return code
    if code == EXIT_NODE_LOST and node.stopped is not None and node.stopped.kind == "lost":
        return code  # the supervisor has named it
    for stop in node.lost.values():
        say(stop.describe())
    say(f"this node's outcome (exit code {code}) followed it; exit code {EXIT_NODE_LOST}: a node was lost")
    return EXIT_NODE_LOST


def agree_on_config(node: Node, config: dict[str, Any]) -> None:
    """Node 0 shares the config as it prepared it; every other node checks it prepared the same
    (the same dataset, run length and parallelism): ranks that disagree would not train one model."""
    if node.spec.is_master:
        node.share("config", config)
        return
    if keys := differences(node.receive("config"), config):
        raise RendezvousError(
            f"this node prepared a different config from node 0 ({', '.join(keys[:5])}); "
            "give every node the same options and the same dataset"
        )
