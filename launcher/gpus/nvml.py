"""What the NVIDIA GPUs of this machine are, how busy and how healthy they are, read through NVML
(the records themselves, common to every vendor, are launcher/gpus/devices.py's).

The one seam between the launcher and the hardware is `nvml_library()`: the nvidia-ml-py
package (imported as pynvml), or, when LAUNCHER_SCRIPTED_GPUS names a JSON file, a scripted
machine with the same functions (launcher/gpus/scripted_nvml.py), so every policy and every
error can be tried, and tested, on a machine without a GPU.
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from typing import Any

from launcher.gpus.devices import CLOCK_REASONS, Gpu, GpuProcess, Health, NoGpuDriver, PeerLink
from launcher.gpus.owners import owner as _owner
from pretrain.run.refusal import Refusal

SCRIPTED_GPUS_VAR = "LAUNCHER_SCRIPTED_GPUS"
UTILIZATION_WINDOW = 1.0  # seconds over which utilization is sampled
UTILIZATION_SAMPLES = 5


class NvmlFailure(Refusal):
    """NVML started but cannot list the GPUs (one line)."""


def nvml_library() -> Any:
    """pynvml, or the scripted machine that LAUNCHER_SCRIPTED_GPUS names."""
    script = os.environ.get(SCRIPTED_GPUS_VAR)
    if script:
        from launcher.gpus.scripted_nvml import ScriptedNvml

        return ScriptedNvml.from_file(script)
    try:
        import pynvml
    except ImportError as error:  # a broken install: requirements.txt has nvidia-ml-py
        raise NoGpuDriver(f"cannot import pynvml ({error}); install nvidia-ml-py") from None
    return pynvml


def discover(window: float | None = None, samples: int | None = None) -> list[Gpu]:
    """Every usable device, in NVML order, a MIG device right after its GPU; utilization
    is sampled `samples` times over `window` seconds (default UTILIZATION_*).

    Raises NoGpuDriver when NVML cannot start (no driver, library not found), NvmlFailure
    when it cannot count the GPUs. A GPU it cannot read is listed with its error."""
    window = UTILIZATION_WINDOW if window is None else window
    samples = UTILIZATION_SAMPLES if samples is None else samples
    nvml = nvml_library()
    try:
        nvml.nvmlInit()
    except nvml.NVMLError as error:
        if error.value in (nvml.NVML_ERROR_LIBRARY_NOT_FOUND, nvml.NVML_ERROR_DRIVER_NOT_LOADED):
            raise NoGpuDriver(str(error)) from None
        # A driver that is there but broken (library/driver version mismatch after an
        # upgrade, no permission) must not pass for a machine without GPUs.
        raise NvmlFailure(f"NVML cannot start ({error}); check `nvidia-smi`, or use --device cpu") from None
    try:
        handles = _device_handles(nvml)
        utilization = _sample_utilization(nvml, [h for _, h, _ in handles], window, samples)
        return [
            _describe(nvml, gpu_id, handle, mig, util) for (gpu_id, handle, mig), util in zip(handles, utilization, strict=True)
        ]
    finally:
        nvml.nvmlShutdown()


def _device_handles(nvml: Any) -> list[tuple[str, Any, Any]]:
    """(id, handle, kind) for each GPU and each MIG device; kind is "gpu", "mig" or
    "mig-parent", or the NVMLError NVML gave for a GPU it has no handle for."""
    try:
        count = nvml.nvmlDeviceGetCount()
    except nvml.NVMLError as error:
        raise NvmlFailure(f"NVML cannot count the GPUs ({error}); check `nvidia-smi`, or use --device cpu") from None
    handles = []
    for index in range(count):
        try:
            handle = nvml.nvmlDeviceGetHandleByIndex(index)
        except nvml.NVMLError as error:  # GPU is lost, no permission
            handles.append((str(index), None, error))
            continue
        migs = _mig_handles(nvml, handle)
        handles.append((str(index), handle, "mig-parent" if migs is not None else "gpu"))
        for slot, mig in migs or []:
            handles.append((f"{index}.{slot}", mig, "mig"))
    return handles


def _mig_handles(nvml: Any, handle: Any) -> list[tuple[int, Any]] | None:
    """The MIG devices of a GPU in MIG mode (slot, handle); None when MIG is off or unsupported."""
    try:
        current, _pending = nvml.nvmlDeviceGetMigMode(handle)
    except nvml.NVMLError:  # NotSupported: a GPU without MIG
        return None
    if current != nvml.NVML_DEVICE_MIG_ENABLE:
        return None
    devices: list[tuple[int, Any]] = []
    try:
        slots = nvml.nvmlDeviceGetMaxMigDeviceCount(handle)
    except nvml.NVMLError:  # no permission: the GPU is listed in MIG mode, with no device to use
        return devices
    for slot in range(slots):
        try:
            devices.append((slot, nvml.nvmlDeviceGetMigDeviceHandleByIndex(handle, slot)))
        except nvml.NVMLError:  # NotFound: an empty slot
            continue
    return devices


def _sample_utilization(nvml: Any, handles: list[Any], window: float, samples: int) -> list[float | None]:
    """Mean utilization of each device over `window` seconds: one reading is a single
    instant, and a training job between two steps reads 0%. None where unsupported (MIG)."""
    readings: list[list[float] | None] = [[] for _ in handles]
    for round_ in range(samples):
        if round_:
            time.sleep(window / max(1, samples - 1))
        for i, handle in enumerate(handles):
            if readings[i] is None or handle is None:
                readings[i] = None
                continue
            try:
                readings[i].append(float(nvml.nvmlDeviceGetUtilizationRates(handle).gpu))  # type: ignore[union-attr]
            except nvml.NVMLError:  # NotSupported (MIG devices, some boards), GPU lost
                readings[i] = None
    return [sum(r) / len(r) if r else None for r in readings]


def _describe(nvml: Any, gpu_id: str, handle: Any, kind: Any, utilization: float | None) -> Gpu:
    index = int(gpu_id.split(".")[0])
    if handle is not None:
        try:
            return _read(nvml, gpu_id, index, handle, kind, utilization)
        except nvml.NVMLError as error:
            kind = error
    return Gpu.unreadable(gpu_id, index, str(kind), lost=_is_lost(nvml, kind), mig="." in gpu_id)


def _is_lost(nvml: Any, error: Any) -> bool:
    """NVML's errors that say the GPU is failing (rather than that NVML cannot ask it)."""
    return error.value in (nvml.NVML_ERROR_GPU_IS_LOST, nvml.NVML_ERROR_RESET_REQUIRED)


def _read(nvml: Any, gpu_id: str, index: int, handle: Any, kind: str, utilization: float | None) -> Gpu:
    memory = nvml.nvmlDeviceGetMemoryInfo(handle)
    parent = nvml.nvmlDeviceGetHandleByIndex(index) if kind == "mig" else handle
    return Gpu(
        id=gpu_id,
        index=index,
        uuid=_text(nvml.nvmlDeviceGetUUID(handle)),
        name=_text(nvml.nvmlDeviceGetName(handle)),
        pci_bus_id=_text(nvml.nvmlDeviceGetPciInfo(parent).busId),
        memory_total=int(memory.total),
        memory_used=int(memory.used),
        utilization=utilization,
        processes=_processes(nvml, handle),
        mig=kind == "mig",
        mig_enabled=kind == "mig-parent",
        health=read_health(nvml, parent),
        compute_capability=_compute_capability(nvml, parent),
    )


def _compute_capability(nvml: Any, handle: Any) -> tuple[int, int] | None:
    """nvmlDeviceGetCudaComputeCapability's (major, minor); None where NVML cannot tell."""
    read = getattr(nvml, "nvmlDeviceGetCudaComputeCapability", None)
    capability = None if read is None else _reading(nvml, read, handle)
    return None if capability is None else (int(capability[0]), int(capability[1]))


def read_health(nvml: Any, handle: Any) -> Health:
    """The health readings of the GPU `handle` names. A reading NVML cannot give is None; an
    error that means the GPU is lost goes up (discovery lists that GPU with its error)."""
    ecc = _reading(
        nvml, nvml.nvmlDeviceGetTotalEccErrors, handle, nvml.NVML_MEMORY_ERROR_TYPE_UNCORRECTED, nvml.NVML_VOLATILE_ECC
    )
    pending = _reading(nvml, nvml.nvmlDeviceGetRetiredPagesPendingStatus, handle)
    remapped = _reading(nvml, nvml.nvmlDeviceGetRemappedRows, handle)  # (corrected, uncorrected, pending, failure)
    return Health(
        ecc_uncorrected=None if ecc is None else int(ecc),
        retired_pages_pending=None if pending is None else pending == nvml.NVML_FEATURE_ENABLED,
        remapping_pending=None if remapped is None else bool(remapped[2]),
        remapping_failed=None if remapped is None else bool(remapped[3]),
        clock_reasons=_clock_reasons(nvml, handle),
        pcie_width=_reading(nvml, nvml.nvmlDeviceGetCurrPcieLinkWidth, handle),
        pcie_max_width=_reading(nvml, nvml.nvmlDeviceGetMaxPcieLinkWidth, handle),
    )


def _reading(nvml: Any, read: Any, *args: Any) -> Any:
    """read(*args), or None where NVML cannot tell (not supported, no permission, a driver
    without the function); an error that means the GPU is lost goes up."""
    try:
        return read(*args)
    except nvml.NVMLError as error:
        if _is_lost(nvml, error):
            raise
        return None


def _clock_reasons(nvml: Any, handle: Any) -> frozenset[str] | None:
    """The CLOCK_REASONS now set. nvmlDeviceGetCurrentClocksEventReasons is the name since
    nvidia-ml-py 12.535 and drivers 535; older ones have only ...ClocksThrottleReasons."""
    mask = None
    for name in ("nvmlDeviceGetCurrentClocksEventReasons", "nvmlDeviceGetCurrentClocksThrottleReasons"):
        read = getattr(nvml, name, None)
        if read is None:
            continue
        try:
            mask = read(handle)
            break
        except nvml.NVMLError as error:
            if _is_lost(nvml, error):
                raise
            if error.value != nvml.NVML_ERROR_FUNCTION_NOT_FOUND:  # NotSupported: the older name says no more
                return None
    if mask is None:
        return None
    return frozenset(name for name, suffix in CLOCK_REASONS.items() if mask & _clock_bit(nvml, suffix))


def _clock_bit(nvml: Any, suffix: str) -> int:
    bit = getattr(nvml, f"nvmlClocksEventReason{suffix}", None)
    return int(getattr(nvml, f"nvmlClocksThrottleReason{suffix}", 0) if bit is None else bit)


class HealthReader:
    """The health of a run's devices, read again and again with NVML started once (nvmlInit can
    take a while; the run-time watch, launcher/gpus/health.py, reads every few seconds). Only the
    health readings, never the process list or utilization, so each reading is cheap."""

    def __init__(self, gpus: Sequence[Gpu]) -> None:
        """Start NVML: NoGpuDriver or NvmlFailure where it cannot."""
        self._gpus = list(gpus)
        self._nvml = nvml_library()
        try:
            self._nvml.nvmlInit()
        except self._nvml.NVMLError as error:
            raise NvmlFailure(f"NVML cannot start ({error})") from None

    def read(self) -> dict[str, Health]:
        """Each device's readings by id (a MIG device: its GPU's); Health(lost=True) for a GPU
        NVML says is lost. Any other NVML error goes up."""
        return {gpu.id: self._read(gpu) for gpu in self._gpus}

    def _read(self, gpu: Gpu) -> Health:
        nvml = self._nvml
        try:
            handle = nvml.nvmlDeviceGetHandleByIndex(gpu.index) if gpu.mig else nvml.nvmlDeviceGetHandleByUUID(gpu.uuid)
            return read_health(nvml, handle)
        except nvml.NVMLError as error:
            if _is_lost(nvml, error):
                return Health(lost=True)
            raise

    def close(self) -> None:
        self._nvml.nvmlShutdown()


def _processes(nvml: Any, handle: Any) -> tuple[GpuProcess, ...]:
    try:
        running = nvml.nvmlDeviceGetComputeRunningProcesses(handle)
    except nvml.NVMLError:  # NoPermission, NotSupported
        return ()
    return tuple(
        GpuProcess(int(p.pid), None if p.usedGpuMemory is None else int(p.usedGpuMemory), _owner(int(p.pid))) for p in running
    )


def _text(value: str | bytes) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else value


def peer_links(gpus: Sequence[Gpu]) -> dict[tuple[str, str], PeerLink]:
    """How each pair of these devices reaches the other, keyed by their ids in the order given
    (("0", "1"), never ("1", "0")). NVLink when NVML's NVLink peer-to-peer status is OK; else
    PCIe when peer reads or writes are OK (through the PCIe fabric); else none. A MIG device, or
    a pair NVML cannot judge, is unknown; so is every pair when NVML cannot start."""
    pairs = [(a, b) for i, a in enumerate(gpus) for b in gpus[i + 1 :]]
    if not pairs:
        return {}
    nvml = nvml_library()
    try:
        nvml.nvmlInit()
    except nvml.NVMLError:
        return {(a.id, b.id): "unknown" for a, b in pairs}
    try:
        handles = {gpu.id: _handle_by_uuid(nvml, gpu) for gpu in gpus}
        return {(a.id, b.id): _link(nvml, handles[a.id], handles[b.id]) for a, b in pairs}
    finally:
        nvml.nvmlShutdown()


def _handle_by_uuid(nvml: Any, gpu: Gpu) -> Any:
    """The handle of a whole GPU (None for a MIG device, or one NVML cannot find)."""
    if gpu.mig or not gpu.uuid:
        return None
    try:
        return nvml.nvmlDeviceGetHandleByUUID(gpu.uuid)
    except nvml.NVMLError:
        return None


def _link(nvml: Any, a: Any, b: Any) -> PeerLink:
    if a is None or b is None:
        return "unknown"
    try:
        if nvml.nvmlDeviceGetP2PStatus(a, b, nvml.NVML_P2P_CAPS_INDEX_NVLINK) == nvml.NVML_P2P_STATUS_OK:
            return "nvlink"
        for direction in (nvml.NVML_P2P_CAPS_INDEX_READ, nvml.NVML_P2P_CAPS_INDEX_WRITE):
            if nvml.nvmlDeviceGetP2PStatus(a, b, direction) == nvml.NVML_P2P_STATUS_OK:
                return "pcie"
    except nvml.NVMLError:  # NotSupported: a driver too old to say
        return "unknown"
    return "none"
