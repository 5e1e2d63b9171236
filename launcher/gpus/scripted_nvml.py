"""A scripted GPU machine with the pynvml functions the launcher calls.

`LAUNCHER_SCRIPTED_GPUS=machine.json python -m launcher gpus` shows how the launcher would
judge that machine; the tests use it for every policy, for real launcher processes racing for
GPUs, and for GPUs that go bad during a run: the machine reads its file again whenever the file
changes (replace it atomically, with os.replace, so no reader sees half of it). The file:

    {"driver": true,                      # false: NVML library not found
     "p2p": "nvlink",                     # how every two GPUs reach each other unless "links" says
                                          # otherwise: nvlink, pcie, none, or unsupported (NVML cannot say)
     "links": [{"gpus": [0, 1], "p2p": "pcie"}],
     "gpus": [{"name": "NVIDIA H100 80GB HBM3", "uuid": "GPU-...", "pci_bus_id": "00000000:18:00.0",
               "memory_total_mib": 81559, "memory_used_mib": 0,
               "utilization": [0, 100, 0],  # successive readings (cycled); null: not supported
               "lost": false,               # true: NVML says "GPU is lost" for it
               "ecc_uncorrected": 0,         # volatile uncorrectable ECC errors
               "retired_pages_pending": false,
               "remapped_rows": {"pending": false, "failure": false},
               "throttle": [],              # clock reasons now: names of nvml.CLOCK_REASONS,
                                            # such as "gpu_idle", "sw_power_cap", "hw_thermal"
               "pcie_width": 16, "pcie_max_width": 16,  # PCIe lanes now, and at most
               "compute_capability": [9, 0],  # CUDA compute capability (an A100: [8, 0]; null: unknown)
               "processes": [{"pid": 4242, "memory_mib": 1024}],
               "mig": [{"slot": 0, "uuid": "MIG-...", "name": "...", "memory_total_mib": 9856,
                        "memory_used_mib": 0, "processes": []}]}]}

Every key is optional; the defaults make healthy idle H100s joined by NVLink. A health key set
to null is a reading NVML does not support on that GPU (NVMLError_NotSupported). Errors are
pynvml's own exception classes, so the launcher's handling of them is what runs against a real driver.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import math
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from launcher.gpus.nvml import CLOCK_REASONS
from pretrain.run.refusal import Refusal

MIB = 1 << 20
HEALTH_KEYS = {"ecc_uncorrected", "retired_pages_pending", "remapped_rows", "throttle", "pcie_width", "pcie_max_width"}
GPU_KEYS = {
    "lost",
    "name",
    "uuid",
    "pci_bus_id",
    "memory_total_mib",
    "memory_used_mib",
    "utilization",
    "processes",
    "mig",
    "compute_capability",
} | HEALTH_KEYS
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
    ecc_uncorrected: int | None = 0
    """None (here and below): NVML does not support the reading on this GPU."""
    retired_pages_pending: bool | None = False
    remapped_rows: tuple[bool, bool] | None = (False, False)
    """(pending, failure)."""
    throttle: frozenset[str] | None = frozenset()
    pcie_width: int | None = 16
    pcie_max_width: int | None = 16
    compute_capability: tuple[int, int] | None = (9, 0)
    """None: NVML cannot tell (NotSupported)."""


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
            "NVML_ERROR_FUNCTION_NOT_FOUND",
            "NVML_ERROR_GPU_IS_LOST",
            "NVML_ERROR_RESET_REQUIRED",
            "NVML_FEATURE_ENABLED",
            "NVML_MEMORY_ERROR_TYPE_UNCORRECTED",
            "NVML_VOLATILE_ECC",
            "NVML_P2P_CAPS_INDEX_NVLINK",
            "NVML_P2P_CAPS_INDEX_READ",
            "NVML_P2P_CAPS_INDEX_WRITE",
            "NVML_P2P_STATUS_OK",
        ):
            setattr(self, constant, getattr(pynvml, constant))
        self._clock_bits = {name: getattr(pynvml, f"nvmlClocksEventReason{suffix}") for name, suffix in CLOCK_REASONS.items()}
        for name, suffix in CLOCK_REASONS.items():
            setattr(self, f"nvmlClocksEventReason{suffix}", self._clock_bits[name])
            setattr(self, f"nvmlClocksThrottleReason{suffix}", self._clock_bits[name])
        self._path: str | None = None
        """The file it was read from, read again when it changes (None: a machine given as a dict)."""
        self._signature: tuple[int, int, int] | None = None
        self._load(machine)

    def _load(self, machine: dict) -> None:
        _check_keys(machine, MACHINE_KEYS, "the machine")
        self.driver = bool(machine.get("driver", True))
        self.devices = [_gpu(i, spec) for i, spec in enumerate(machine.get("gpus", []))]
        self.links = _links(machine, len(self.devices))

    @classmethod
    def from_file(cls, path: str) -> ScriptedNvml:
        signature = _signature(path)  # before reading: a change made while it is read is seen next time
        with _script_errors(path):
            machine = cls(_read_json(path))
        machine._path, machine._signature = path, signature
        return machine

    def _refresh(self) -> None:
        """Read the file again if it changed since it was read (a GPU going bad during a run)."""
        if self._path is None:
            return
        signature = _signature(self._path)
        if signature != self._signature:
            with _script_errors(self._path):
                self._load(_read_json(self._path))
            self._signature = signature

    def nvmlInit(self) -> None:
        self._refresh()
        if not self.driver:
            raise self._pynvml.NVMLError_LibraryNotFound()

    def nvmlShutdown(self) -> None:
        pass

    def nvmlDeviceGetCount(self) -> int:
        self._refresh()
        return len(self.devices)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> _Device:
        self._refresh()
        if not 0 <= index < len(self.devices):
            raise self._pynvml.NVMLError_InvalidArgument()
        if self.devices[index].lost:
            raise self._pynvml.NVMLError_GpuIsLost()
        return self.devices[index]

    def nvmlDeviceGetHandleByUUID(self, uuid: str) -> _Device:
        self._refresh()
        for device in self.devices:
            if device.uuid == uuid:
                if device.lost:
                    raise self._pynvml.NVMLError_GpuIsLost()
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

    def nvmlDeviceGetTotalEccErrors(self, device: _Device, error_type: int, counter_type: int) -> int:
        """Only the volatile uncorrectable count is scripted; other counters are not supported."""
        wanted = (self._pynvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, self._pynvml.NVML_VOLATILE_ECC)
        return self._health(device, device.ecc_uncorrected if (error_type, counter_type) == wanted else None)

    def nvmlDeviceGetRetiredPagesPendingStatus(self, device: _Device) -> int:
        pending = self._health(device, device.retired_pages_pending)
        return self._pynvml.NVML_FEATURE_ENABLED if pending else self._pynvml.NVML_FEATURE_DISABLED

    def nvmlDeviceGetRemappedRows(self, device: _Device) -> tuple[int, int, int, int]:
        """(corrected rows, uncorrected rows, pending, failure), as pynvml returns them."""
        pending, failure = self._health(device, device.remapped_rows)
        return (0, 0, int(pending), int(failure))

    def nvmlDeviceGetCurrentClocksEventReasons(self, device: _Device) -> int:
        return self._clock_mask(device)

    def nvmlDeviceGetCurrentClocksThrottleReasons(self, device: _Device) -> int:
        """The name before nvidia-ml-py 12.535."""
        return self._clock_mask(device)

    def _clock_mask(self, device: _Device) -> int:
        return sum(self._clock_bits[name] for name in self._health(device, device.throttle))

    def nvmlDeviceGetCudaComputeCapability(self, device: _Device) -> tuple[int, int]:
        return self._health(device, device.compute_capability)

    def nvmlDeviceGetCurrPcieLinkWidth(self, device: _Device) -> int:
        return self._health(device, device.pcie_width)

    def nvmlDeviceGetMaxPcieLinkWidth(self, device: _Device) -> int:
        return self._health(device, device.pcie_max_width)

    def _health(self, device: _Device, reading: Any) -> Any:
        """A health reading as NVML gives it: lost, not supported (None in the script), or the value."""
        if device.lost:
            raise self._pynvml.NVMLError_GpuIsLost()
        if reading is None:
            raise self._pynvml.NVMLError_NotSupported()
        return reading

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
        compute_capability=_capability(spec, where),
        **_health(spec, where),
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


def _health(spec: dict, where: str) -> dict[str, Any]:
    """The health keys of a GPU's spec, checked; a key set to null stays None (not supported)."""
    health: dict[str, Any] = {}
    if "ecc_uncorrected" in spec:
        health["ecc_uncorrected"] = _count(spec, "ecc_uncorrected", where, minimum=0)
    if "retired_pages_pending" in spec:
        pending = spec["retired_pages_pending"]
        if pending is not None and not isinstance(pending, bool):
            raise ValueError(f"{where}.retired_pages_pending must be true, false or null")
        health["retired_pages_pending"] = pending
    if "remapped_rows" in spec:
        rows = spec["remapped_rows"]
        shape = f'{where}.remapped_rows must be {{"pending": true|false, "failure": true|false}} or null'
        if rows is not None:
            if not (
                isinstance(rows, dict) and set(rows) <= {"pending", "failure"} and all(isinstance(v, bool) for v in rows.values())
            ):
                raise ValueError(shape)
            rows = (rows.get("pending", False), rows.get("failure", False))
        health["remapped_rows"] = rows
    if "throttle" in spec:
        reasons = spec["throttle"]
        if reasons is not None and not (isinstance(reasons, list) and all(r in CLOCK_REASONS for r in reasons)):
            raise ValueError(f"{where}.throttle must be a list of {', '.join(CLOCK_REASONS)}, or null")
        health["throttle"] = None if reasons is None else frozenset(reasons)
    for key in ("pcie_width", "pcie_max_width"):
        if key in spec:
            health[key] = _count(spec, key, where, minimum=1)
    return health


def _capability(spec: dict, where: str) -> tuple[int, int] | None:
    capability = spec.get("compute_capability", [9, 0])
    if capability is None:
        return None
    if not (isinstance(capability, list) and len(capability) == 2 and all(type(n) is int and n >= 0 for n in capability)):
        raise ValueError(f"{where}.compute_capability must be [major, minor], such as [9, 0], or null")
    return (capability[0], capability[1])


def _count(spec: dict, key: str, where: str, minimum: int) -> int | None:
    value = spec[key]
    if value is not None and not (isinstance(value, int) and not isinstance(value, bool) and value >= minimum):
        raise ValueError(f"{where}.{key} must be a whole number of at least {minimum}, or null")
    return value


def _read_json(path: str) -> dict:
    machine = json.loads(Path(path).read_text(encoding="utf-8"))
    if not isinstance(machine, dict):
        raise ValueError("the top level must be an object")
    return machine


@contextlib.contextmanager
def _script_errors(path: str) -> Iterator[None]:
    """A file that cannot be read, or describes no machine, is one BadScript line naming it."""
    try:
        yield
    except (OSError, ValueError, TypeError, AttributeError, KeyError) as error:
        raise BadScript(f"scripted GPU machine {path}: {error}; fix the file or unset LAUNCHER_SCRIPTED_GPUS") from None


def _signature(path: str | None) -> tuple[int, int, int] | None:
    """What tells a changed file: its mtime, its inode (os.replace makes a new one) and size."""
    if path is None:
        return None
    try:
        stat = os.stat(path)
    except OSError:
        return None
    return (stat.st_mtime_ns, stat.st_ino, stat.st_size)


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
