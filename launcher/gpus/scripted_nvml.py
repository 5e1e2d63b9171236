"""A scripted GPU machine with the pynvml functions the launcher calls.

`LAUNCHER_SCRIPTED_GPUS=machine.json python -m launcher gpus` shows how the launcher would
judge that machine; the tests use it for every policy, and for real launcher processes
racing for GPUs. The file:

    {"driver": true,                      # false: NVML library not found
     "p2p": "nvlink",                     # how every two GPUs reach each other unless "links" says
                                          # otherwise: nvlink, pcie, none, or unsupported (NVML cannot say)
     "links": [{"gpus": [0, 1], "p2p": "pcie"}],
     "gpus": [{"name": "NVIDIA H100 80GB HBM3", "uuid": "GPU-...", "pci_bus_id": "00000000:18:00.0",
               "memory_total_mib": 81559, "memory_used_mib": 0,
               "utilization": [0, 100, 0],  # successive readings (cycled); null: not supported
               "lost": false,               # true: NVML says "GPU is lost" for it
               "processes": [{"pid": 4242, "memory_mib": 1024}],
               "mig": [{"slot": 0, "uuid": "MIG-...", "name": "...", "memory_total_mib": 9856,
                        "memory_used_mib": 0, "processes": []}]}]}

Every key is optional; the defaults make idle H100s joined by NVLink. Errors are pynvml's own
exception classes, so the launcher's handling of them is what runs against a real driver.
"""

from __future__ import annotations

import itertools
import json
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pretrain.run.refusal import Refusal

MIB = 1 << 20
GPU_KEYS = {"lost", "name", "uuid", "pci_bus_id", "memory_total_mib", "memory_used_mib", "utilization", "processes", "mig"}
MIG_KEYS = {"slot", "uuid", "name", "memory_total_mib", "memory_used_mib", "processes"}
MACHINE_KEYS = {"driver", "gpus", "p2p", "links"}
P2P_KINDS = ("nvlink", "pcie", "none", "unsupported")


class BadScript(Refusal, ValueError):
    """The scripted machine's file is missing or malformed (one line)."""


@dataclass(frozen=True)
class _Reading:
    """What nvmlDeviceGetUtilizationRates, GetMemoryInfo, GetPciInfo and the process list return."""

    gpu: int = 0
    memory: int = 0
    total: int = 0
    used: int = 0
    free: int = 0
    busId: str = ""
    pid: int = 0
    usedGpuMemory: int | None = None


@dataclass(eq=False)
class _Device:
    name: str
    uuid: str
    pci_bus_id: str
    memory_total: int
    memory_used: int
    utilization: Any  # an endless iterator of readings, or None: not supported
    processes: list[dict]
    migs: dict[int, _Device] = field(default_factory=dict)
    mig_mode: bool = False
    lost: bool = False


class ScriptedNvml:
    """Stands in for the pynvml module (the subset launcher/gpus/nvml.py uses)."""

    def __init__(self, machine: dict) -> None:
        import pynvml  # here, not at the top: the launcher imports this module on CPU-only setups too

        self._pynvml = pynvml
        self.NVMLError = pynvml.NVMLError
        for constant in (
            "NVML_DEVICE_MIG_ENABLE",
            "NVML_ERROR_LIBRARY_NOT_FOUND",
            "NVML_ERROR_DRIVER_NOT_LOADED",
            "NVML_P2P_CAPS_INDEX_NVLINK",
            "NVML_P2P_CAPS_INDEX_READ",
            "NVML_P2P_CAPS_INDEX_WRITE",
            "NVML_P2P_STATUS_OK",
        ):
            setattr(self, constant, getattr(pynvml, constant))
        _check_keys(machine, MACHINE_KEYS, "the machine")
        self.driver = bool(machine.get("driver", True))
        self.devices = [_gpu(i, spec) for i, spec in enumerate(machine.get("gpus", []))]
        self.links = _links(machine, len(self.devices))

    @classmethod
    def from_file(cls, path: str) -> ScriptedNvml:
        try:
            machine = json.loads(Path(path).read_text(encoding="utf-8"))
            if not isinstance(machine, dict):
                raise ValueError("the top level must be an object")
            return cls(machine)
        except (OSError, ValueError, TypeError, AttributeError, KeyError) as error:
            raise BadScript(f"scripted GPU machine {path}: {error}; fix the file or unset LAUNCHER_SCRIPTED_GPUS") from None

    def nvmlInit(self) -> None:
        if not self.driver:
            raise self._pynvml.NVMLError_LibraryNotFound()

    def nvmlShutdown(self) -> None:
        pass

    def nvmlDeviceGetCount(self) -> int:
        return len(self.devices)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> _Device:
        if not 0 <= index < len(self.devices):
            raise self._pynvml.NVMLError_InvalidArgument()
        if self.devices[index].lost:
            raise self._pynvml.NVMLError_GpuIsLost()
        return self.devices[index]

    def nvmlDeviceGetHandleByUUID(self, uuid: str) -> _Device:
        for device in self.devices:
            if device.uuid == uuid and not device.lost:
                return device
        raise self._pynvml.NVMLError_NotFound()

    def nvmlDeviceGetP2PStatus(self, a: _Device, b: _Device, capability: int) -> int:
        """OK for NVLink over NVLink, and for reads and writes over NVLink or PCIe; other
        capabilities (atomics, properties) are not scripted."""
        kind = self.links(self.devices.index(a), self.devices.index(b))
        if kind == "unsupported":
            raise self._pynvml.NVMLError_NotSupported()
        ok = kind == "nvlink" or (kind == "pcie" and capability != self._pynvml.NVML_P2P_CAPS_INDEX_NVLINK)
        return self._pynvml.NVML_P2P_STATUS_OK if ok else self._pynvml.NVML_P2P_STATUS_CHIPSET_NOT_SUPPORTED

    def nvmlDeviceGetUUID(self, device: _Device) -> str:
        return device.uuid

    def nvmlDeviceGetName(self, device: _Device) -> str:
        return device.name

    def nvmlDeviceGetPciInfo(self, device: _Device) -> _Reading:
        return _Reading(busId=device.pci_bus_id)

    def nvmlDeviceGetMemoryInfo(self, device: _Device) -> _Reading:
        return _Reading(total=device.memory_total, used=device.memory_used, free=max(0, device.memory_total - device.memory_used))

    def nvmlDeviceGetUtilizationRates(self, device: _Device) -> _Reading:
        if device.utilization is None or device.mig_mode:
            raise self._pynvml.NVMLError_NotSupported()
        return _Reading(gpu=next(device.utilization))

    def nvmlDeviceGetComputeRunningProcesses(self, device: _Device) -> list[_Reading]:
        return [
            _Reading(pid=int(p["pid"]), usedGpuMemory=None if p.get("memory_mib") is None else int(p["memory_mib"] * MIB))
            for p in device.processes
        ]

    def nvmlDeviceGetMigMode(self, device: _Device) -> list[int]:
        if not device.migs and not device.mig_mode:
            raise self._pynvml.NVMLError_NotSupported()
        return [int(device.mig_mode), int(device.mig_mode)]

    def nvmlDeviceGetMaxMigDeviceCount(self, device: _Device) -> int:
        return 7

    def nvmlDeviceGetMigDeviceHandleByIndex(self, device: _Device, slot: int) -> _Device:
        if slot not in device.migs:
            raise self._pynvml.NVMLError_NotFound()
        return device.migs[slot]


def _gpu(index: int, spec: dict) -> _Device:
    where = f"gpus[{index}]"
    _check_keys(spec, GPU_KEYS, where)
    utilization = spec.get("utilization", [0])
    if utilization is not None and not (isinstance(utilization, list) and all(_is_number(u) for u in utilization)):
        raise ValueError(f"{where}.utilization must be a list of percentages or null")
    device = _Device(
        name=str(spec.get("name", "NVIDIA H100 80GB HBM3")),
        uuid=str(spec.get("uuid", f"GPU-{index:08x}-0000-0000-0000-000000000000")),
        pci_bus_id=str(spec.get("pci_bus_id", f"00000000:{0x18 + 0x10 * index:02X}:00.0")),
        memory_total=_mib(spec, "memory_total_mib", 81559, where),
        memory_used=_mib(spec, "memory_used_mib", 0, where),
        utilization=None if utilization is None else itertools.cycle([int(u) for u in utilization] or [0]),
        processes=_process_list(spec, where),
        mig_mode="mig" in spec,
        lost=spec.get("lost") is True,
    )
    for mig_spec in spec.get("mig", []):
        mig_where = f"{where}.mig[]"
        _check_keys(mig_spec, MIG_KEYS, mig_where)
        if not isinstance(mig_spec.get("slot"), int):
            raise ValueError(f"{mig_where} needs a whole-number slot")
        slot = mig_spec["slot"]
        device.migs[slot] = _Device(
            name=str(mig_spec.get("name", f"{device.name} MIG 1g.10gb")),
            uuid=str(mig_spec.get("uuid", f"MIG-{index:08x}-{slot:04x}-0000-0000-000000000000")),
            pci_bus_id=device.pci_bus_id,
            memory_total=_mib(mig_spec, "memory_total_mib", 9856, mig_where),
            memory_used=_mib(mig_spec, "memory_used_mib", 0, mig_where),
            utilization=None,
            processes=_process_list(mig_spec, mig_where),
        )
    return device


def _links(machine: dict, count: int) -> Callable[[int, int], str]:
    """How GPU i reaches GPU j: the "links" entry naming both, else the machine's "p2p"."""
    default = machine.get("p2p", "nvlink")
    if default not in P2P_KINDS:
        raise ValueError(f"p2p must be one of {', '.join(P2P_KINDS)}, not {default!r}")
    pairs: dict[frozenset[int], str] = {}
    links = machine.get("links", [])
    shape = f'links must be a list of {{"gpus": [i, j], "p2p": KIND}}: two GPU indices, KIND one of {", ".join(P2P_KINDS)}'
    if not isinstance(links, list):
        raise ValueError(shape)
    for link in links:
        _check_keys(link, {"gpus", "p2p"}, "links[]")
        gpus = link.get("gpus")
        if not (
            isinstance(gpus, list)
            and len(gpus) == 2
            and all(isinstance(i, int) and 0 <= i < count for i in gpus)
            and gpus[0] != gpus[1]
            and link.get("p2p") in P2P_KINDS
        ):
            raise ValueError(shape)
        pairs[frozenset(gpus)] = link["p2p"]
    return lambda i, j: pairs.get(frozenset((i, j)), default)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _mib(spec: dict, key: str, default: float, where: str) -> int:
    value = spec.get(key, default)
    if not _is_number(value) or value < 0:
        raise ValueError(f"{where}.{key} must be a number of MiB, not {value!r}")
    return int(value * MIB)


def _process_list(spec: dict, where: str) -> list[dict]:
    processes = spec.get("processes", [])
    for process in processes if isinstance(processes, list) else [None]:
        if not (
            isinstance(process, dict)
            and isinstance(process.get("pid"), int)
            and process["pid"] > 0
            and (process.get("memory_mib") is None or _is_number(process["memory_mib"]))
        ):
            raise ValueError(f'{where}.processes must be a list of {{"pid": N, "memory_mib": M}}')
    return processes


def _check_keys(spec: Any, allowed: set[str], where: str) -> None:
    if not isinstance(spec, dict):
        raise ValueError(f"{where} must be an object")
    unknown = set(spec) - allowed
    if unknown:
        raise ValueError(f"{where} has unknown key(s) {', '.join(sorted(unknown))}")
