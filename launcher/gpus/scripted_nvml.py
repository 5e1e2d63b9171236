"""A scripted GPU machine with the pynvml functions the launcher calls.

`LAUNCHER_SCRIPTED_GPUS=machine.json python -m launcher gpus` shows how the launcher would
judge that machine; the tests use it for every policy, for real launcher processes racing for
GPUs, and for GPUs that go bad during a run: the machine reads its file again whenever the file
changes (replace it atomically, with os.replace, so no reader sees half of it). The file:

    {"vendor": "nvidia",                  # the default; "amd": launcher/gpus/scripted_amdsmi.py's file
     "driver": true,                      # false: NVML library not found
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
               "throttle": [],              # clock reasons now: names of devices.CLOCK_REASONS,
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

import itertools
from dataclasses import dataclass, field
from typing import Any

from launcher.gpus.devices import CLOCK_REASONS
from launcher.gpus.scripted_common import (
    MIB,
    BadScript,
    ScriptedMachine,
    check_keys,
    count,
    links,
    mib,
    process_list,
    utilization,
)

__all__ = ["MIB", "BadScript", "ScriptedNvml"]
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
MACHINE_KEYS = {"vendor", "driver", "gpus", "p2p", "links"}
P2P_KINDS = ("nvlink", "pcie", "none", "unsupported")


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


class ScriptedNvml(ScriptedMachine):
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
        super().__init__(machine)

    def _load(self, machine: dict) -> None:
        check_keys(machine, MACHINE_KEYS, "the machine")
        if machine.get("vendor", "nvidia") != "nvidia":
            raise ValueError(f"vendor is {machine['vendor']!r}: this machine is not read through NVML")
        self.driver = bool(machine.get("driver", True))
        self.devices = [_gpu(i, spec) for i, spec in enumerate(machine.get("gpus", []))]
        self.links = links(machine, len(self.devices), P2P_KINDS, "nvlink")

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
    check_keys(spec, GPU_KEYS, where)
    readings = utilization(spec, where)
    device = _Device(
        name=str(spec.get("name", "NVIDIA H100 80GB HBM3")),
        uuid=str(spec.get("uuid", f"GPU-{index:08x}-0000-0000-0000-000000000000")),
        pci_bus_id=str(spec.get("pci_bus_id", f"00000000:{0x18 + 0x10 * index:02X}:00.0")),
        memory_total=mib(spec, "memory_total_mib", 81559, where),
        memory_used=mib(spec, "memory_used_mib", 0, where),
        utilization=None if readings is None else itertools.cycle(readings),
        processes=process_list(spec, where),
        mig_mode="mig" in spec,
        lost=spec.get("lost") is True,
        compute_capability=_capability(spec, where),
        **_health(spec, where),
    )
    for mig_spec in spec.get("mig", []):
        mig_where = f"{where}.mig[]"
        check_keys(mig_spec, MIG_KEYS, mig_where)
        if not isinstance(mig_spec.get("slot"), int):
            raise ValueError(f"{mig_where} needs a whole-number slot")
        slot = mig_spec["slot"]
        device.migs[slot] = _Device(
            name=str(mig_spec.get("name", f"{device.name} MIG 1g.10gb")),
            uuid=str(mig_spec.get("uuid", f"MIG-{index:08x}-{slot:04x}-0000-0000-000000000000")),
            pci_bus_id=device.pci_bus_id,
            memory_total=mib(mig_spec, "memory_total_mib", 9856, mig_where),
            memory_used=mib(mig_spec, "memory_used_mib", 0, mig_where),
            utilization=None,
            processes=process_list(mig_spec, mig_where),
        )
    return device


def _health(spec: dict, where: str) -> dict[str, Any]:
    """The health keys of a GPU's spec, checked; a key set to null stays None (not supported)."""
    health: dict[str, Any] = {}
    if "ecc_uncorrected" in spec:
        health["ecc_uncorrected"] = count(spec, "ecc_uncorrected", where, minimum=0)
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
            health[key] = count(spec, key, where, minimum=1)
    return health


def _capability(spec: dict, where: str) -> tuple[int, int] | None:
    capability = spec.get("compute_capability", [9, 0])
    if capability is None:
        return None
    if not (isinstance(capability, list) and len(capability) == 2 and all(type(n) is int and n >= 0 for n in capability)):
        raise ValueError(f"{where}.compute_capability must be [major, minor], such as [9, 0], or null")
    return (capability[0], capability[1])
