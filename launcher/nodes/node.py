"""Multi-node: which node this launcher is, and what one node tells the others when it stops.

Torch-free: the supervisor and the command line use these; launcher/nodes/rendezvous.py moves them
between machines through node 0's store.

Exit codes of a launcher that stopped because of another node (the node where it began exits
with its own worker's code, as on one machine):

    75   another node's worker failed first (or its launcher stopped in error); this node
         stopped its workers
    76   a node was lost: its launcher stopped answering (SIGKILLed, frozen, its machine gone);
         the lost node itself exits 76 too when it runs again (it was frozen or suspended)
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from typing import Literal, Protocol

from launcher.exit_codes import EXIT_NODE_LOST, EXIT_OTHER_NODE_FAILED
from launcher.nodes.slurm import SlurmError, SlurmJob
from pretrain.run.refusal import Refusal

DEFAULT_MASTER_PORT = 29500  # torchrun's
MAX_NODES = 65536
HOST_PATTERN = re.compile(r"^[A-Za-z0-9_.:\-\[\]%]+$")  # a name, IPv4 or IPv6 (bracketed or not)


class NodeSpecError(Refusal, ValueError):
    """Bad multi-node options: one line naming the option and the fix."""


@dataclass(frozen=True)
class NodeSpec:
    """This launcher's place in a job of nnodes launchers, and where node 0 listens."""

    nnodes: int
    node_rank: int
    master_addr: str
    master_port: int
    source: str = "flags"
    """Where the values came from: "flags" or "Slurm" (named in errors)."""
    launched_as: int | None = None
    """In a restart's round that renumbered the nodes (--min-nnodes): the rank it was launched with."""

    @property
    def is_master(self) -> bool:
        return self.node_rank == 0

    @property
    def own_rank(self) -> int:
        """The number in this node's own files (logs/node<r>/, workers.node<r>.json, its lock): the
        rank it was launched with, which no renumbering changes, so no node writes into another's."""
        return self.node_rank if self.launched_as is None else self.launched_as

    @property
    def endpoint(self) -> str:
        host = f"[{self.master_addr}]" if ":" in self.master_addr and not self.master_addr.startswith("[") else self.master_addr
        return f"{host}:{self.master_port}"


def node_spec(
    nnodes: int | None,
    node_rank: int | None,
    master_addr: str | None,
    master_port: int | None,
    env: Mapping[str, str],
) -> NodeSpec | None:
    """The job this launcher joins: the flags, else what Slurm says (explicit flags win); None
    for a launch on this machine alone (one node, no Slurm job of several nodes)."""
    try:
        slurm = SlurmJob.from_env(env)
    except SlurmError as error:
        if nnodes is None and node_rank is None:
            raise NodeSpecError(f"{error}; or give --nnodes and --node-rank yourself") from None
        slurm = None
    if slurm is not None and slurm.nnodes <= 1 and nnodes is None:
        slurm = None  # a one-node allocation is a launch on this machine
    if nnodes is None and slurm is None:
        if node_rank is not None or master_addr is not None or master_port is not None:
            raise NodeSpecError("--node-rank, --master-addr and --master-port need --nnodes N (the number of machines)")
        return None
    source = "Slurm" if slurm is not None and nnodes is None else "flags"
    count = nnodes if nnodes is not None else slurm.nnodes if slurm else 1
    rank = node_rank if node_rank is not None else slurm.node_rank if slurm else None
    addr = master_addr or (slurm.master_addr if slurm else None) or env.get("MASTER_ADDR")
    port = master_port  # the flag, else Slurm's, else MASTER_PORT, else torchrun's default
    if port is None and slurm is not None:
        port = slurm.master_port
    if port is None:
        port = _env_port(env)
    if port is None:
        port = DEFAULT_MASTER_PORT
    return check(count, rank, addr, port, source)


def check(nnodes: int, node_rank: int | None, master_addr: str | None, master_port: int, source: str) -> NodeSpec | None:
    if not 1 <= nnodes <= MAX_NODES:
        raise NodeSpecError(f"--nnodes must be between 1 and {MAX_NODES} (got {nnodes})")
    if nnodes == 1:
        if node_rank not in (None, 0):
            raise NodeSpecError(f"--node-rank {node_rank} is out of range for --nnodes 1 (node ranks are 0 to 0)")
        return None
    if node_rank is None:
        raise NodeSpecError(
            f"--nnodes {nnodes} needs --node-rank R (0 on the machine that hosts the rendezvous, 1 to {nnodes - 1} on the others)"
        )
    if not 0 <= node_rank < nnodes:
        raise NodeSpecError(f"--node-rank {node_rank} is out of range for --nnodes {nnodes} (node ranks are 0 to {nnodes - 1})")
    if not master_addr:
        raise NodeSpecError(f"--nnodes {nnodes} needs --master-addr HOST: the address of node 0, which every node can reach")
    if not HOST_PATTERN.fullmatch(master_addr):
        raise NodeSpecError(f"--master-addr {master_addr!r} is not a host name or an IP address")
    if not 1 <= master_port <= 65535:
        raise NodeSpecError(f"--master-port (or MASTER_PORT) must be between 1 and 65535 (got {master_port})")
    return NodeSpec(nnodes, node_rank, master_addr.strip("[]"), master_port, source)


def _env_port(env: Mapping[str, str]) -> int | None:
    value = env.get("MASTER_PORT", "").strip()
    if not value:
        return None
    if not re.fullmatch(r"[0-9]{1,5}", value):
        raise NodeSpecError(f"MASTER_PORT={value!r} is not a port number; unset it or pass --master-port")
    return int(value)


@dataclass(frozen=True)
class Layout:
    """Where this node's workers sit in the job: torchrun's numbering, node 0's workers first."""

    nproc: int
    node_rank: int = 0
    nnodes: int = 1
    master_addr: str = "127.0.0.1"
    """Where the rank-0 worker listens (node 0's address)."""

    @property
    def world_size(self) -> int:
        return self.nproc * self.nnodes

    def global_rank(self, local_rank: int) -> int:
        return self.node_rank * self.nproc + local_rank

    def label(self, local_label: str, local_rank: int) -> str:
        """A worker's prefix: GPU<id> names a GPU of this machine, the same on every node, so a job
        of several nodes puts the global rank in front (r10.GPU2); a CPU worker's number is its
        global rank already (CPU10)."""
        if self.nnodes == 1:
            return local_label
        if local_label.startswith("CPU"):
            return f"CPU{self.global_rank(local_rank)}"
        return f"r{self.global_rank(local_rank)}.{local_label}"


@dataclass(frozen=True)
class NodeStop:
    """Why the job stops, as the node where it began tells the others (the store's abort key).

    kind "failed": a worker of that node failed first (label, rank, exit_code and how say which
    and how); "error": its launcher stopped in error before or between its workers (detail says
    why); "lost": the node stopped answering (detail says how it was noticed). here: the stop
    is about the node that tells it (a node found lost, once it runs again), never sent."""

    node: int
    host: str
    kind: Literal["failed", "error", "lost"]
    detail: str = ""
    label: str | None = None
    rank: int | None = None
    exit_code: int | None = None
    here: bool = False

    @property
    def our_exit_code(self) -> int:
        """What a launcher that stopped because of this exits with."""
        return EXIT_NODE_LOST if self.kind == "lost" else EXIT_OTHER_NODE_FAILED

    def describe(self) -> str:
        node = f"node {self.node} ({self.host})" if self.host else f"node {self.node}"
        if self.kind == "failed":
            return f"{node} failed first: {self.label} (rank {self.rank}) {self.detail}"
        if self.kind == "lost":
            return f"this node, {node}, {self.detail}" if self.here else f"{node} was lost: {self.detail}"
        return f"{node} stopped in error: {self.detail}"

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str | bytes) -> NodeStop:
        try:
            data = json.loads(text)
            return cls(**data)
        except (ValueError, TypeError):
            return cls(node=-1, host="", kind="error", detail=f"an unreadable stop record {text!r}")


@dataclass(frozen=True)
class NodeInterrupt:
    """Another node's launcher was asked to stop gracefully (Ctrl-C, SIGTERM, SIGHUP): every
    node stops the same way, so the workers finish their step and save together."""

    node: int
    signum: int


class Peers(Protocol):
    """The other nodes, as the supervisor sees them (launcher/nodes/rendezvous.py's Node)."""

    def on_stop(self, emit: Callable[[NodeStop | NodeInterrupt], None]) -> None:
        """Call emit when another node stops the job (or is lost), or is asked to stop gracefully."""

    def report_interrupt(self, signum: int) -> None:
        """Tell the other nodes this node was asked to stop gracefully."""

    def interrupted(self) -> NodeInterrupt | None:
        """Whether a node was asked to stop gracefully (asked now, from the store)."""

    def report_failure(self, label: str, rank: int, exit_code: int, how: str) -> NodeStop | None:
        """Tell the other nodes this node's worker failed; the earlier stop if one came first."""
