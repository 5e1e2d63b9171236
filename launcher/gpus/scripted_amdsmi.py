"""A scripted AMD GPU machine with the `amdsmi` functions the launcher calls (launcher/gpus/amd.py).

The same file as a scripted NVIDIA machine (launcher/gpus/scripted_nvml.py: LAUNCHER_SCRIPTED_GPUS,
read again whenever it changes) with "vendor": "amd" at the top and AMD SMI's readings:

    {"vendor": "amd",
     "driver": true,                      # false: the amdsmi package is not installed
     "init_error": null,                  # "no_perm": amdsmi_init fails with AMDSMI_STATUS_NO_PERM
                                          # (/dev/kfd not open to this user); "driver_not_loaded"
     "p2p": "xgmi",                       # how every two GPUs reach each other unless "links" says
                                          # otherwise: xgmi, pcie, none, or unsupported (AMD SMI cannot say)
     "links": [{"gpus": [0, 1], "p2p": "pcie"}],
     "gpus": [{"name": "AMD Instinct MI300X", "uuid": "...",  # AMD SMI's UUID
               "unique_id": "0x8d1457e2c20f59d2",  # asic_serial: what ROCr's GPU-<hex> UUID is made of
               "pci_bus_id": "0000:05:00.0",
               "memory_total_mib": 196592, "memory_used_mib": 0,
               "utilization": [0, 100, 0],  # successive gfx_activity readings (cycled); null: N/A
               "lost": false,               # true: every reading fails as for a GPU off the bus
               "ecc_uncorrected": 0,        # amdsmi_get_gpu_total_ecc_count's uncorrectable_count
               "bad_pages": {"pending": 0, "retired": 0, "unreservable": 0},
               "throttle": [],              # violations active now: names of amd_common.THROTTLE_REASONS,
                                            # such as "ppt" (power cap), "socket_thermal"
               "pcie_width": 16, "pcie_max_width": 16,
               "processes": [{"pid": 4242, "memory_mib": 1024}],
               "kfd_nodes": [2],            # KFD node id of each of its handles (its partitions in
                                            # slot order), ROCr's device order; default: 2, 3... in
                                            # AMD SMI's order across the machine
               "partition": {"compute": "CPX", "memory": "NPS1"},  # SPX NPS1 unless it says
               "partitions": [{"uuid": "...", "memory_total_mib": 24574, "memory_used_mib": 0,
                               "utilization": [0], "processes": []}]}]}

Every key is optional; the defaults make healthy idle MI300X GPUs joined by XGMI. A GPU in a compute
partition mode other than SPX is listed as AMD SMI lists it: one processor handle per partition
(CPX: 8 on an MI300X), "partitions" describing each (those it leaves out are idle, and report the
whole memory pool they share as AMD SMI is taken to: the GPU's memory in NPS1, a quarter in NPS4).
A health key set to null is a reading AMD SMI does not support on that GPU
(AMDSMI_STATUS_NOT_SUPPORTED, or "N/A" in its dict). Errors are AmdSmiLibraryException with AMD
SMI's status codes (amd_common.STATUS), so amd.py's handling of them is what runs against the library.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from enum import IntEnum
from typing import Any

from launcher.gpus.amd_common import MEMORY_POOLS, PARTITION_COUNTS, STATUS, THROTTLE_REASONS
from launcher.gpus.scripted_common import MIB, ScriptedMachine, check_keys, count, links, mib, process_list, utilization

HEALTH_KEYS = {"ecc_uncorrected", "bad_pages", "throttle", "pcie_width", "pcie_max_width"}
GPU_KEYS = {
    "lost",
    "name",
    "uuid",
    "unique_id",
    "pci_bus_id",
    "memory_total_mib",
    "memory_used_mib",
    "utilization",
    "processes",
    "partition",
    "partitions",
    "kfd_nodes",
} | HEALTH_KEYS
PARTITION_KEYS = {"uuid", "memory_total_mib", "memory_used_mib", "utilization", "processes"}
MACHINE_KEYS = {"vendor", "driver", "init_error", "gpus", "p2p", "links"}
P2P_KINDS = ("xgmi", "pcie", "none", "unsupported")
INIT_ERRORS = {"no_perm": "NO_PERM", "driver_not_loaded": "DRIVER_NOT_LOADED"}


class AmdSmiException(Exception):
    """amdsmi's base exception class."""


class AmdSmiLibraryException(AmdSmiException):
    """amdsmi's exception for a failed call: err_code is AMD SMI's status (amdsmi_exception.py)."""

    def __init__(self, err_code: int) -> None:
        super().__init__(err_code)
        self.err_code = abs(err_code)
        name = next((n for n, code in STATUS.items() if code == self.err_code), "UNKNOWN_ERROR")
        self.err_info = f"AMDSMI_STATUS_{name}"

    def __str__(self) -> str:
        return f"Error code:\n\t{self.err_code} | {self.err_info}"

    def get_error_code(self) -> int:
        return self.err_code

    def get_error_info(self) -> str:
        return self.err_info


class AmdSmiInitFlags(IntEnum):
    INIT_AMD_GPUS = 2


class AmdSmiMemoryType(IntEnum):
    VRAM = 0
    VIS_VRAM = 1
    GTT = 2


class AmdSmiMemoryPageStatus(IntEnum):
    RESERVED = 0
    PENDING = 1
    UNRESERVABLE = 2


class AmdSmiIoLinkType(IntEnum):
    UNDEFINED = 0
    PCIEXPRESS = 1
    XGMI = 2


@dataclass(frozen=True)
class _Handle:
    """One processor handle: a whole GPU, or one partition of a GPU in CPX, DPX... mode. Like
    AMD SMI's, it stays valid while the machine's file changes (a GPU going bad during a run)."""

    index: int
    slot: int


@dataclass(eq=False)
class _Part:
    """What one handle reads: a whole GPU's, or a partition's, own readings."""

    gpu: _Gpu
    slot: int
    uuid: str
    memory_total: int
    memory_used: int
    utilization: Any  # an endless iterator of readings, or None: N/A
    processes: list[dict]


@dataclass(eq=False)
class _Gpu:
    index: int
    name: str
    unique_id: str
    pci_bus_id: str
    compute_partition: str = "SPX"
    memory_partition: str = "NPS1"
    lost: bool = False
    ecc_uncorrected: int | None = 0
    """None (here and below): AMD SMI does not support the reading on this GPU."""
    bad_pages: dict[str, int] | None = field(default_factory=dict)
    throttle: frozenset[str] | None = frozenset()
    pcie_width: int | None = 16
    pcie_max_width: int | None = 16
    kfd_nodes: list[int] | None = None
    """The KFD node id of each part; None: 2, 3... in AMD SMI's order across the machine."""
    parts: list[_Part] = field(default_factory=list)


class ScriptedAmdSmi(ScriptedMachine):
    """Stands in for the amdsmi module (the subset launcher/gpus/amd.py uses)."""

    AmdSmiException = AmdSmiException
    AmdSmiLibraryException = AmdSmiLibraryException
    AmdSmiInitFlags = AmdSmiInitFlags
    AmdSmiMemoryType = AmdSmiMemoryType
    AmdSmiMemoryPageStatus = AmdSmiMemoryPageStatus
    AmdSmiIoLinkType = AmdSmiIoLinkType

    def _load(self, machine: dict) -> None:
        check_keys(machine, MACHINE_KEYS, "the machine")
        if machine.get("vendor") != "amd":
            raise ValueError('an AMD machine needs "vendor": "amd"')
        self.installed = bool(machine.get("driver", True))
        init_error = machine.get("init_error")
        if init_error is not None and init_error not in INIT_ERRORS:
            raise ValueError(f"init_error must be one of {', '.join(INIT_ERRORS)}, or null")
        self.init_error = None if init_error is None else STATUS[INIT_ERRORS[init_error]]
        self.gpus = [_gpu(i, spec) for i, spec in enumerate(machine.get("gpus", []))]
        self.links = links(machine, len(self.gpus), P2P_KINDS, "xgmi")

    def _fail(self, status: str) -> Exception:
        return AmdSmiLibraryException(STATUS[status])

    def amdsmi_init(self, flag: Any = None) -> None:
        self._refresh()
        if self.init_error is not None:
            raise AmdSmiLibraryException(self.init_error)

    def amdsmi_shut_down(self) -> None:
        pass

    def amdsmi_get_processor_handles(self) -> list[_Handle]:
        self._refresh()
        return [_Handle(gpu.index, part.slot) for gpu in self.gpus for part in gpu.parts]

    def _alive(self, handle: _Handle) -> _Part:
        """What the handle reads now; a GPU off the bus answers every call with an I/O error (its
        sysfs files fail), one no longer in the file with not found."""
        self._refresh()
        if not (handle.index < len(self.gpus) and handle.slot < len(self.gpus[handle.index].parts)):
            raise self._fail("NOT_FOUND")
        part = self.gpus[handle.index].parts[handle.slot]
        if part.gpu.lost:
            raise self._fail("IO")
        return part

    def _reading(self, handle: _Handle, value: Any) -> Any:
        if value is None:
            raise self._fail("NOT_SUPPORTED")
        return value

    def _gpu(self, handle: _Handle) -> _Gpu:
        return self._alive(handle).gpu

    def amdsmi_get_gpu_kfd_info(self, handle: _Handle) -> dict[str, Any]:
        gpu = self._gpu(handle)
        node = 2 + sum(len(g.parts) for g in self.gpus[: handle.index]) + handle.slot
        node = node if gpu.kfd_nodes is None else gpu.kfd_nodes[handle.slot]
        return {"kfd_id": 1000 + node, "node_id": node, "current_partition_id": handle.slot}

    def amdsmi_get_gpu_asic_info(self, handle: _Handle) -> dict[str, Any]:
        gpu = self._gpu(handle)
        return {
            "market_name": gpu.name,
            "vendor_id": "0x1002",
            "vendor_name": "Advanced Micro Devices Inc. [AMD/ATI]",
            "device_id": "0x74a1",
            "asic_serial": gpu.unique_id,
            "num_compute_units": 304 // len(gpu.parts),
            "target_graphics_version": "gfx942",
        }

    def amdsmi_get_gpu_board_info(self, handle: _Handle) -> dict[str, Any]:
        return {"product_name": self._gpu(handle).name, "manufacturer_name": "AMD", "model_number": "N/A"}

    def amdsmi_get_gpu_device_uuid(self, handle: _Handle) -> str:
        return self._alive(handle).uuid

    def amdsmi_get_gpu_device_bdf(self, handle: _Handle) -> str:
        """A partition's BDF: its GPU's, with the partition in the function number."""
        bus = self._gpu(handle).pci_bus_id
        return f"{bus[:-1]}{handle.slot}" if handle.slot else bus

    def amdsmi_get_gpu_memory_total(self, handle: _Handle, kind: Any) -> int:
        """Only VRAM is scripted (the launcher reads no other kind)."""
        return self._alive(handle).memory_total

    def amdsmi_get_gpu_memory_usage(self, handle: _Handle, kind: Any) -> int:
        return self._alive(handle).memory_used

    def amdsmi_get_gpu_activity(self, handle: _Handle) -> dict[str, Any]:
        part = self._alive(handle)
        gfx = "N/A" if part.utilization is None else next(part.utilization)
        return {"gfx_activity": gfx, "umc_activity": 0, "mm_activity": "N/A"}

    def amdsmi_get_gpu_process_list(self, handle: _Handle) -> list[dict[str, Any]]:
        return [
            {
                "name": "python3",
                "pid": int(p["pid"]),
                "mem": 0 if p.get("memory_mib") is None else int(p["memory_mib"] * MIB),
                "engine_usage": {"gfx": 0, "enc": 0},
                "memory_usage": {
                    "gtt_mem": 0,
                    "cpu_mem": 0,
                    "vram_mem": 0 if p.get("memory_mib") is None else int(p["memory_mib"] * MIB),
                },
            }
            for p in self._alive(handle).processes
        ]

    def amdsmi_get_gpu_total_ecc_count(self, handle: _Handle) -> dict[str, int]:
        uncorrectable = self._reading(handle, self._gpu(handle).ecc_uncorrected)
        return {"correctable_count": 0, "uncorrectable_count": uncorrectable, "deferred_count": 0}

    def amdsmi_get_gpu_bad_page_info(self, handle: _Handle) -> list[dict[str, Any]]:
        pages = self._reading(handle, self._gpu(handle).bad_pages)
        statuses = {
            "retired": AmdSmiMemoryPageStatus.RESERVED,
            "pending": AmdSmiMemoryPageStatus.PENDING,
            "unreservable": AmdSmiMemoryPageStatus.UNRESERVABLE,
        }
        records = [status for kind, status in statuses.items() for _ in range(pages.get(kind, 0))]
        return [
            {"value": i, "page_address": 0x1000 * (i + 1), "page_size": 4096, "status": int(status)}
            for i, status in enumerate(records)
        ]

    def amdsmi_get_violation_status(self, handle: _Handle) -> dict[str, Any]:
        """Only the active_* flags are scripted; the accumulated counters read N/A."""
        active = self._reading(handle, self._gpu(handle).throttle)
        return {f"active_{key}": name in active for name, (key, _) in THROTTLE_REASONS.items()}

    def amdsmi_get_pcie_info(self, handle: _Handle) -> dict[str, Any]:
        gpu = self._gpu(handle)
        width, top = gpu.pcie_width, gpu.pcie_max_width
        return {
            "pcie_static": {"max_pcie_width": "N/A" if top is None else top, "max_pcie_speed": 32000},
            "pcie_metric": {"pcie_width": "N/A" if width is None else width, "pcie_speed": 32000},
        }

    def amdsmi_get_gpu_compute_partition(self, handle: _Handle) -> str:
        return self._gpu(handle).compute_partition

    def amdsmi_get_gpu_memory_partition(self, handle: _Handle) -> str:
        return self._gpu(handle).memory_partition

    def amdsmi_topo_get_link_type(self, a: _Handle, b: _Handle) -> dict[str, int]:
        kind = self.links(self._gpu(a).index, self._gpu(b).index)
        if kind == "unsupported":
            raise self._fail("NOT_SUPPORTED")
        link = AmdSmiIoLinkType.XGMI if kind == "xgmi" else AmdSmiIoLinkType.PCIEXPRESS
        return {"hops": 1 if kind == "xgmi" else 2, "type": int(link)}

    def amdsmi_is_P2P_accessible(self, a: _Handle, b: _Handle) -> bool:
        return self.links(self._gpu(a).index, self._gpu(b).index) in ("xgmi", "pcie")


def _gpu(index: int, spec: dict) -> _Gpu:
    where = f"gpus[{index}]"
    check_keys(spec, GPU_KEYS, where)
    compute, memory = _partition(spec, where)
    gpu = _Gpu(
        index=index,
        name=str(spec.get("name", "AMD Instinct MI300X")),
        unique_id=str(spec.get("unique_id", f"0x{0x8D1457E2C20F0000 + index:016X}")),
        pci_bus_id=str(spec.get("pci_bus_id", f"0000:{0x05 + 0x20 * index:02x}:00.0")),
        compute_partition=compute,
        memory_partition=memory,
        lost=spec.get("lost") is True,
        kfd_nodes=_kfd_nodes(spec, PARTITION_COUNTS[compute], where),
        **_health(spec, where),
    )
    total = mib(spec, "memory_total_mib", 196592, where)
    slots = PARTITION_COUNTS[compute]
    pool = total / MEMORY_POOLS[memory] if slots >= MEMORY_POOLS[memory] else total / slots
    partitions = spec.get("partitions", [])
    if "partitions" in spec and (compute == "SPX" or not isinstance(partitions, list) or len(partitions) > slots):
        raise ValueError(f"{where}.partitions must be a list of at most {slots} partitions of a GPU not in SPX mode")
    if slots == 1:
        gpu.parts.append(
            _Part(
                gpu,
                0,
                str(spec.get("uuid", f"{index:02x}ff74a1-0000-1000-8000-000000000000")),
                total,
                mib(spec, "memory_used_mib", 0, where),
                _cycle(utilization(spec, where)),
                process_list(spec, where),
            )
        )
        return gpu
    for slot in range(slots):
        part = partitions[slot] if slot < len(partitions) else {}
        part_where = f"{where}.partitions[{slot}]"
        check_keys(part, PARTITION_KEYS, part_where)
        gpu.parts.append(
            _Part(
                gpu,
                slot,
                str(part.get("uuid", f"{index:02x}ff74a1-0000-1000-80{slot:02x}-000000000000")),
                mib(part, "memory_total_mib", pool / MIB, part_where),
                mib(part, "memory_used_mib", 0, part_where),
                _cycle(utilization(part, part_where)),
                process_list(part, part_where),
            )
        )
    return gpu


def _cycle(readings: list[int] | None) -> Any:
    return None if readings is None else itertools.cycle(readings)


def _partition(spec: dict, where: str) -> tuple[str, str]:
    partition = spec.get("partition", {})
    check_keys(partition, {"compute", "memory"}, f"{where}.partition")
    compute, memory = partition.get("compute", "SPX"), partition.get("memory", "NPS1")
    if compute not in PARTITION_COUNTS or memory not in MEMORY_POOLS:
        raise ValueError(
            f'{where}.partition must be {{"compute": {"|".join(PARTITION_COUNTS)}, "memory": {"|".join(MEMORY_POOLS)}}}'
        )
    return compute, memory


def _kfd_nodes(spec: dict, handles: int, where: str) -> list[int] | None:
    nodes = spec.get("kfd_nodes")
    if nodes is not None and not (
        isinstance(nodes, list) and len(nodes) == handles and all(type(n) is int and n >= 0 for n in nodes)
    ):
        raise ValueError(f"{where}.kfd_nodes must be a list of {handles} KFD node ids, one per partition")
    return nodes


def _health(spec: dict, where: str) -> dict[str, Any]:
    """The health keys of a GPU's spec, checked; a key set to null stays None (not supported)."""
    health: dict[str, Any] = {}
    if "ecc_uncorrected" in spec:
        health["ecc_uncorrected"] = count(spec, "ecc_uncorrected", where, minimum=0)
    if "bad_pages" in spec:
        pages = spec["bad_pages"]
        kinds = ("pending", "retired", "unreservable")
        if pages is not None and not (
            isinstance(pages, dict) and set(pages) <= set(kinds) and all(type(n) is int and n >= 0 for n in pages.values())
        ):
            raise ValueError(f'{where}.bad_pages must be {{"pending": N, "retired": N, "unreservable": N}} or null')
        health["bad_pages"] = pages
    if "throttle" in spec:
        reasons = spec["throttle"]
        if reasons is not None and not (isinstance(reasons, list) and all(r in THROTTLE_REASONS for r in reasons)):
            raise ValueError(f"{where}.throttle must be a list of {', '.join(THROTTLE_REASONS)}, or null")
        health["throttle"] = None if reasons is None else frozenset(reasons)
    for key in ("pcie_width", "pcie_max_width"):
        if key in spec:
            health[key] = count(spec, key, where, minimum=1)
    return health
