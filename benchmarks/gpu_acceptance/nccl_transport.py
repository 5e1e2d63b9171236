"""What NCCL says it used between two GPUs, how fast an all-reduce went, and whether a worker
opened a CUDA context on another worker's GPU: the parts of the GPU acceptance's nccl-transport
check (benchmarks/gpu_acceptance/checks_nccl.py) that need no GPU, so the tests can hold them to real logs.

NVML names processes by their host pid, which inside a container is not the pid the process has
there. So the contexts are compared by GPU, not by pid: the processes NVML lists on each GPU
while the run's workers hold their GPUs, less those listed before they started, are the run's;
each run GPU must hold exactly one, and none of them may appear on a second GPU. That needs no
mapping from host pids to ours, so it holds in any pid namespace.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass

from benchmarks.gpu_acceptance.procs import compute_apps

CONNECTION = re.compile(
    r"Channel \d+(?:/\d+)? : \d+\[[0-9a-fA-F]+\] -> \d+\[[0-9a-fA-F]+\](?: \[(?:send|receive)\])? via (?P<via>.+?)\s*$"
)
"""NCCL_DEBUG=INFO's line for one connection: `Channel 00/0 : 0[0] -> 1[1] via P2P/CUMEM/read`."""
NVLS_CHANNELS = re.compile(r"\b(\d+) nvls channels\b")
"""`16 coll channels, 16 nvls channels, ...`: more than 0 when NVLink SHARP is set up."""
P2P_REFUSED = "Could not enable P2P"
"""NCCL wanted peer-to-peer between two GPUs and could not have it (it then uses SHM)."""


@dataclass(frozen=True)
class Transport:
    connections: Mapping[str, int]
    """How many connections NCCL logged per transport: "P2P/CUMEM", "P2P/IPC", "SHM", "NET/IB", ..."""
    nvls: bool
    """NVLink SHARP channels were set up (NVSwitch systems)."""
    p2p_refused: bool

    @property
    def peer_to_peer(self) -> bool:
        """GPU to GPU directly (P2P or NVLS), not through host memory or the network."""
        return self.nvls or any(kind.startswith("P2P") for kind in self.connections)

    def describe(self) -> str:
        parts = ["NVLS"] if self.nvls else []
        parts += [f"{kind} ({count} connection{'s' * (count != 1)})" for kind, count in sorted(self.connections.items())]
        refused = "; NCCL could not enable P2P" if self.p2p_refused else ""
        return (" + ".join(parts) or "no connection lines (is NCCL_DEBUG=INFO reaching the output?)") + refused


def transport_kind(via: str) -> str:
    """The transport of a connection from what follows "via": P2P/CUMEM/read -> P2P/CUMEM,
    SHM/direct/direct and (older NCCL) "direct shared memory" -> SHM, NET/IB/0/GDRDMA -> NET/IB."""
    if via.startswith("direct shared memory") or via.startswith("SHM"):
        return "SHM"
    parts = via.split("/")
    if parts[0] in ("P2P", "NET") and len(parts) > 1:
        return f"{parts[0]}/{parts[1]}"
    return parts[0]


def transport(log: str) -> Transport:
    """What the NCCL_DEBUG=INFO lines in log (under any prefix: the launcher's GPU<n>:) say."""
    kinds: Counter[str] = Counter()
    nvls = refused = False
    for line in log.splitlines():
        if match := CONNECTION.search(line):
            kinds[transport_kind(match["via"])] += 1
        elif channels := NVLS_CHANNELS.search(line):
            nvls = nvls or int(channels[1]) > 0
        refused = refused or P2P_REFUSED in line
    return Transport(dict(kinds), nvls, refused)


def bus_bandwidth(nbytes: int, seconds: float, ranks: int) -> float:
    """An all-reduce's bus bandwidth in GB/s, as nccl-tests reports it: the algorithm bandwidth
    (bytes / time) times 2 (ranks - 1) / ranks, the share of the data each link carries, so that
    it compares with the hardware's link speed whatever the number of ranks."""
    return nbytes / seconds * 2 * (ranks - 1) / ranks / 1e9


@dataclass(frozen=True)
class Contexts:
    """Which processes hold a CUDA context on which GPU, from NVML, for the run's processes only."""

    on_gpu: Mapping[str, frozenset[int]]
    """Each run GPU (by UUID): the host pids that appeared on it with the run."""
    elsewhere: Mapping[int, tuple[str, ...]]
    """A run pid that holds contexts on more than one GPU: the GPUs."""

    @property
    def ok(self) -> bool | None:
        """True: one process per run GPU, each on one GPU only. None: NVML lists none of them
        (a container that cannot see other pid namespaces' processes). False otherwise."""
        if not any(self.on_gpu.values()):
            return None
        return not self.elsewhere and all(len(pids) == 1 for pids in self.on_gpu.values())

    def describe(self, worker_pids: Collection[int] = ()) -> str:
        if self.ok is None:
            return "NVML lists no process of the run (not visible from this container)"
        counts = ", ".join(f"{len(pids)} on {gpu[:12]}" for gpu, pids in self.on_gpu.items())
        problems = [f"pid {pid} holds contexts on {', '.join(g[:12] for g in gpus)}" for pid, gpus in self.elsewhere.items()]
        run_pids = set().union(*self.on_gpu.values())
        same = (
            "host pids are the workers' own"
            if run_pids == set(worker_pids)
            else "host pids differ from the workers' (a container)"
        )
        return f"processes per GPU: {counts}; " + ("; ".join(problems) if problems else "none on a second GPU") + f"; {same}"


def run_contexts(
    before: Mapping[str, Collection[int]], during: Mapping[str, Collection[int]], run_gpus: Sequence[str]
) -> Contexts:
    """The run's contexts: NVML's compute processes per GPU (UUID -> host pids) while the workers
    ran, less those before they started. A pid new on a run GPU and also on any other GPU holds
    a context on a GPU that is not its own."""
    new = {gpu: frozenset(during.get(gpu, ())) - frozenset(before.get(gpu, ())) for gpu in {*during, *run_gpus}}
    on_gpu = {gpu: new[gpu] for gpu in run_gpus}
    run_pids = set().union(*on_gpu.values())
    holders = {pid: tuple(sorted(gpu for gpu, pids in new.items() if pid in pids)) for pid in sorted(run_pids)}
    return Contexts(on_gpu, {pid: gpus for pid, gpus in holders.items() if len(gpus) > 1})


def smi_processes(rows: Sequence[Sequence[str]]) -> dict[str, set[int]]:
    """nvidia-smi --query-compute-apps=gpu_uuid,pid rows as GPU UUID -> host pids (other rows,
    such as "No running processes found", are skipped)."""
    processes: dict[str, set[int]] = {}
    for gpu, pid in compute_apps(rows):
        processes.setdefault(gpu, set()).add(pid)
    return processes
