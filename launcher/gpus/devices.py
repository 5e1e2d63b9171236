"""What the launcher knows of a GPU, whoever made it: the records that NVML (launcher/gpus/nvml.py)
and AMD SMI fill in the same way, so that selection, claims, health, placement and the GPU table
never ask which vendor a GPU is from, except to name the variable that makes it visible.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Vendor = Literal["nvidia", "amd"]
"""Who made a GPU, which decides how it is read (NVML, AMD SMI) and made visible to a worker."""

PeerLink = Literal["nvlink", "xgmi", "pcie", "none", "unknown"]
"""How two GPUs reach each other: NVLink (NVIDIA) or XGMI / Infinity Fabric (AMD) peer-to-peer,
PCIe peer-to-peer, no peer-to-peer at all (NCCL/RCCL go through host memory), or unknown (the
library cannot say: an old driver, a MIG device)."""


CLOCK_REASONS = {
    "gpu_idle": "GpuIdle",
    "applications_clocks": "ApplicationsClocksSetting",
    "sw_power_cap": "SwPowerCap",
    "hw_slowdown": "HwSlowdown",
    "sync_boost": "SyncBoost",
    "sw_thermal": "SwThermalSlowdown",
    "hw_thermal": "HwThermalSlowdown",
    "hw_power_brake": "HwPowerBrakeSlowdown",
    "display_clocks": "DisplayClockSetting",
}
"""Why a GPU's clocks are below their maximum, by the names the launcher (and a scripted machine)
uses for every vendor (AMD SMI's throttle reasons are mapped onto them, launcher/gpus/amd_common.py),
to the suffix of pynvml's bit constants (nvmlClocksEventReason<suffix>, called
nvmlClocksThrottleReason<suffix> before nvidia-ml-py 12.535). Bits not named here are ignored."""


class NoGpuDriver(Exception):
    """The vendor's library cannot be used: no driver, or the library is missing (NVML; AMD SMI)."""


@dataclass(frozen=True)
class GpuProcess:
    pid: int
    memory: int | None
    """Bytes of GPU memory it holds; None where the driver does not say."""
    user: str | None
    """Its owner; None when the process is not visible from here (another container's PID
    namespace, or gone) or its owner cannot be read."""


@dataclass(frozen=True)
class Health:
    """NVML's health readings of one GPU (a MIG device has its GPU's). None: NVML cannot tell
    (not supported by this GPU or driver, no permission), which never counts against a GPU."""

    ecc_uncorrected: int | None = None
    """Uncorrectable ECC errors since the driver loaded (the volatile counter)."""
    retired_pages_pending: bool | None = None
    """Memory pages waiting to be retired, which needs a GPU reset (GPUs before Ampere)."""
    remapping_pending: bool | None = None
    """A memory row waits to be remapped, which needs a GPU reset (Ampere and later)."""
    remapping_failed: bool | None = None
    """A row could not be remapped: the GPU is out of spare rows."""
    clock_reasons: frozenset[str] | None = None
    """Why the clocks are below their maximum now (CLOCK_REASONS names)."""
    pcie_width: int | None = None
    """Lanes of the PCIe link now."""
    pcie_max_width: int | None = None
    """Lanes the link can have."""
    lost: bool = False
    """NVML cannot reach the GPU: lost (fallen off the bus), or it needs a reset."""
    pages_unretirable: int | None = None
    """AMD: bad memory pages the driver could not retire (AMD SMI's unreservable bad pages), so
    memory known to be bad stays in use. (AMD's pending bad pages are retired_pages_pending;
    NVIDIA: None.)"""


@dataclass(frozen=True)
class Gpu:
    """One device a worker can be given: a whole GPU, or one MIG device of a GPU."""

    id: str
    """How users and logs name it: the NVML index ("3"), or index.slot for a MIG device ("0.1")."""
    index: int
    """NVML index of the physical GPU (the PCI bus order; CUDA_DEVICE_ORDER=PCI_BUS_ID gives CUDA the same)."""
    uuid: str
    name: str
    pci_bus_id: str
    memory_total: int
    memory_used: int
    utilization: float | None
    """Mean percent of time a kernel ran, over the sampling window; None when not supported."""
    processes: tuple[GpuProcess, ...]
    mig: bool = False
    """A MIG device (addressed by its UUID)."""
    mig_enabled: bool = False
    """A whole GPU in MIG mode: CUDA can only use its MIG devices, never the GPU itself."""
    error: str | None = None
    """Why NVML could not describe it (GPU is lost, no permission); such a GPU is never chosen."""
    health: Health = Health()
    """Its health readings (launcher/gpus/health.py judges them); all unknown where NVML could not describe it."""
    vendor: Vendor = "nvidia"
    """Who made it: how it was read, and which variable makes it visible to a worker (visible_id)."""
    runtime_index: int | None = None
    """The index its vendor's runtime numbers it by, where that differs from `index` and is known:
    on AMD, ROCr's device number (KFD node order, every compute partition a device), which a
    partition is made visible by and the launcher's own ROCR_VISIBLE_DEVICES indices mean. None:
    unknown (then the position among the listed devices stands in for it)."""
    compute_capability: tuple[int, int] | None = None
    """CUDA compute capability (major, minor) of its GPU (a MIG device: its GPU's): (9, 0) for an
    H100; None where NVML cannot tell. What training.float8 true needs (8.9+) is checked on it."""

    @classmethod
    def unreadable(cls, gpu_id: str, index: int, error: str, *, lost: bool = False, **known: object) -> Gpu:
        """A device its library lists but cannot describe (lost, no permission): listed with why,
        never chosen; known: what was read of it before the failure (vendor, mig, runtime_index)."""
        blank = {"uuid": "", "name": "?", "pci_bus_id": "?", "memory_total": 0, "memory_used": 0, "utilization": None}
        return cls(id=gpu_id, index=index, processes=(), error=error, health=Health(lost=lost), **blank, **known)  # type: ignore[arg-type]

    @property
    def memory_free(self) -> int:
        return max(0, self.memory_total - self.memory_used)

    @property
    def visibility_variable(self) -> str:
        """The variable that makes it visible to a worker: CUDA_VISIBLE_DEVICES on NVIDIA,
        ROCR_VISIBLE_DEVICES on AMD (ROCr's mask, applied before HIP's, HIP_VISIBLE_DEVICES or else
        CUDA_VISIBLE_DEVICES, which the worker's environment then drops: VISIBILITY_VARIABLES)."""
        return "ROCR_VISIBLE_DEVICES" if self.vendor == "amd" else "CUDA_VISIBLE_DEVICES"

    @property
    def visible_id(self) -> str:
        """What visibility_variable names it by. NVIDIA: its UUID (NVML lists GPUs that CUDA
        skips, lost or not accessible to this process, which would shift every CUDA index after
        them; a UUID always names the GPU that was chosen and claimed). AMD: its UUID where it is
        one ROCr takes (GPU-<hex>), else its id (a partition: placement.runtime_ids gives ROCr's index)."""
        if self.vendor == "amd" and not self.uuid.startswith("GPU-"):
            return self.id
        return self.uuid


VISIBILITY_VARIABLES = ("CUDA_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES")
"""Every variable that limits which GPUs a process sees, on either vendor (ROCm applies ROCR's, then
HIP's to what ROCR's left: HIP_VISIBLE_DEVICES, or CUDA_VISIBLE_DEVICES where that is unset or empty)."""
