"""Which GPUs each worker sees: only its own, or every run GPU of its node.

NCCL reaches a GPU its process cannot see over NVLink (CUDA 10.1 and later), and RCCL over XGMI
(AMD's Infinity Fabric, counted here as NVLink is), but over PCIe its
peer-to-peer transport needs CUDA IPC, which needs the peer visible: a worker that sees only its
own GPU sends everything through host memory (NCCL's SHM transport) instead. So:

- every pair of the node's run GPUs joined by NVLink (or none able to go peer-to-peer, or NVML
  unable to say): each worker sees only its own GPU, `cuda:0`, as always;
- some pair reaching the other over PCIe only: each training worker sees the node's run GPUs,
  and only those, in local-rank order (the same list in every worker), and uses
  `cuda:LOCAL_RANK`. GPU_RANK, the `GPU<n>` label and the claims stay those of its own GPU.

A `-- COMMAND` keeps one GPU per worker unless LAUNCHER_GPU_VISIBILITY asks: the worker contract
has always said `cuda:0`, and a script written to it would put every rank on the first GPU.
`LAUNCHER_GPU_VISIBILITY=node` shows every worker, training or not, the node's run GPUs (as
torchrun does: for scripts that use `cuda:LOCAL_RANK`); `own` keeps one GPU per worker always.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from launcher.gpus.devices import Gpu, PeerLink
from launcher.gpus.request import DeviceError
from launcher.gpus.selection import mig_device

VISIBILITY_VAR = "LAUNCHER_GPU_VISIBILITY"
SETTINGS = ("auto", "own", "node")
PAIRS_SHOWN = 4
"""Pairs a line names before it says how many more there are."""


@dataclass(frozen=True)
class Visibility:
    shared: bool
    """Every worker sees the node's run GPUs, in local-rank order, and uses cuda:LOCAL_RANK."""
    line: str | None = None
    """What the launcher says about it; None with one GPU."""


def setting(environ: Mapping[str, str]) -> str:
    """LAUNCHER_GPU_VISIBILITY: auto (unset or empty), own or node."""
    value = environ.get(VISIBILITY_VAR, "").strip().lower() or "auto"
    if value not in SETTINGS:
        raise DeviceError(
            f"{VISIBILITY_VAR}={environ[VISIBILITY_VAR]!r} is not auto, own or node; "
            f"unset it for the launcher's choice (docs/gpus.md)"
        )
    return value


def choose(gpus: Sequence[Gpu], links: Mapping[tuple[str, str], PeerLink], own_command: bool, wanted: str) -> Visibility:
    """What the workers on these GPUs (this node's, in local-rank order) see; links as
    nvml.peer_links gives them; own_command: the workers run the user's `-- COMMAND`."""
    if len(gpus) < 2:
        return Visibility(shared=False)
    count = f"the {len(gpus)} run GPUs of this node"
    pcie = _pairs(links, "pcie")
    if wanted == "node":
        if any(mig_device(gpu) for gpu in gpus):
            raise DeviceError(
                f"{VISIBILITY_VAR}=node cannot show a MIG device beside other GPUs (CUDA uses one MIG device "
                f"per process); unset it"
            )
        return Visibility(True, f"{VISIBILITY_VAR}=node: each worker sees {count} and uses cuda:LOCAL_RANK")
    if wanted == "own":
        through_host = f"; {pcie} reach each other over PCIe only, so NCCL goes through host memory" if pcie else ""
        return Visibility(False, f"{VISIBILITY_VAR}=own: each worker sees only its own GPU{through_host}")
    alone = "each worker sees only its own GPU"
    if pcie and any(mig_device(gpu) for gpu in gpus):
        return Visibility(False, f"{pcie} reach each other over PCIe only, but a MIG device is in the run: {alone}")
    if pcie and own_command:
        return Visibility(
            False,
            f"{pcie} reach each other over PCIe only, but a -- COMMAND worker sees only its own GPU (cuda:0), "
            f"so NCCL goes through host memory; {VISIBILITY_VAR}=node shows each worker {count} "
            f"(then use cuda:LOCAL_RANK)",
        )
    if pcie:
        return Visibility(
            True,
            f"{pcie} reach each other over PCIe only: each worker sees {count} and uses cuda:LOCAL_RANK "
            f"(NCCL's peer-to-peer over PCIe needs to see the peer)",
        )
    if unknown := _pairs(links, "unknown"):
        reader = "AMD SMI" if gpus[0].vendor == "amd" else "NVML"
        return Visibility(False, f"{reader} cannot say how {unknown} reach each other: {alone}")
    if without := _pairs(links, "none"):
        return Visibility(False, f"{without} have no peer-to-peer path, so NCCL goes through host memory; {alone}")
    ids = ", ".join(gpu.id for gpu in gpus)
    if gpus[0].vendor == "amd":
        return Visibility(False, f"GPUs {ids} are joined by XGMI: {alone} (RCCL reaches the others over it)")
    return Visibility(False, f"GPUs {ids} are joined by NVLink: {alone} (NCCL reaches the others over it)")


def _pairs(links: Mapping[tuple[str, str], PeerLink], kind: PeerLink) -> str:
    """The pairs linked so, in words: "GPUs 0 and 1", "GPU pairs 0-2, 1-3", ... ("" for none)."""
    pairs = [pair for pair, link in links.items() if link == kind]
    if len(pairs) == 1:
        return f"GPUs {pairs[0][0]} and {pairs[0][1]}"
    named = ", ".join(f"{a}-{b}" for a, b in pairs[:PAIRS_SHOWN])
    more = f" and {len(pairs) - PAIRS_SHOWN} more" if len(pairs) > PAIRS_SHOWN else ""
    return f"GPU pairs {named}{more}" if pairs else ""
