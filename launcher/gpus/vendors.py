"""Which GPU vendor this machine has, detected, never configured: the backend module that reads its
GPUs (launcher/gpus/nvml.py for NVIDIA, launcher/gpus/amd.py for AMD through AMD SMI). Both have
`discover(window=None, samples=None)`, `HealthReader(gpus)` and `peer_links(gpus)`, and fill in the
same records (launcher/gpus/devices.py), so nothing past discovery asks which vendor it is, except
to name the variable that makes a GPU visible to a worker (Gpu.visibility_variable).

- A scripted machine (LAUNCHER_SCRIPTED_GPUS) says its vendor ("vendor": "nvidia" or "amd";
  nvidia unless it says otherwise).
- Otherwise AMD is present when the kernel shows an AMD GPU (/dev/kfd, and a GPU node in the KFD
  topology: amdgpu is loaded and found one) and AMD SMI is installed (ROCm's amdsmi Python package
  that imports, or the amd-smi command). AMD SMI alone is not a GPU: it is installed on NVIDIA
  machines and CPU-only ones too, and a broken install (an amdsmi whose library is missing) is absent.
- NVIDIA: NVML is started to ask only where AMD is present too (only then is there a choice to make);
  otherwise NVML's discover() starts it once and says what it finds, a missing driver included.
- Both present: the launch is refused unless --gpu-vendor says which; neither: NVML's "no driver"
  path, as before AMD existed (CPU workers where falling back is allowed, else one line).
- --gpu-vendor whose driver is missing (the discovery finds no driver): one line naming the fix
  (missing()), never the generic "no GPU found" nor a fallback to CPU workers.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Sequence
from pathlib import Path
from types import ModuleType

from launcher.gpus import nvml
from launcher.gpus.devices import Gpu, NoGpuDriver, Vendor
from pretrain.run.refusal import Refusal

VENDORS: tuple[Vendor, ...] = ("nvidia", "amd")
"""--gpu-vendor's choices."""
NAMES: dict[Vendor, str] = {"nvidia": "NVIDIA", "amd": "AMD"}
LIBRARIES: dict[Vendor, str] = {"nvidia": "NVML", "amd": "AMD SMI"}
CHECKS: dict[Vendor, str] = {"nvidia": "`nvidia-smi`", "amd": "`amd-smi list`"}
"""The vendor's own command that shows what its driver sees."""
AMD_SMI_MISSING = (
    "install ROCm's amdsmi Python package (from the ROCm installation, e.g. /opt/rocm/share/amd_smi, "
    "not PyPI) or its amd-smi command, or use --device cpu"
)


class VendorError(Refusal, ValueError):
    """The vendor to use cannot be decided, or the one asked for is not there (one line, exit 2)."""


def _amd() -> ModuleType:
    # Imported when asked for: an NVIDIA machine never loads AMD SMI's reader.
    from launcher.gpus import amd

    return amd


def module(vendor: Vendor) -> ModuleType:
    """The backend that reads this vendor's GPUs."""
    return _amd() if vendor == "amd" else nvml


def of(gpus: Sequence[Gpu]) -> ModuleType:
    """The backend that read these GPUs (the run-time health watch and the links use it again)."""
    return module(gpus[0].vendor) if gpus else nvml


def scripted_vendor() -> Vendor | None:
    """The vendor of the scripted machine LAUNCHER_SCRIPTED_GPUS names ("vendor", nvidia unless it
    says amd); None without one. BadScript (one line) for a file that cannot be read."""
    path = os.environ.get(nvml.SCRIPTED_GPUS_VAR)
    if not path:
        return None
    from launcher.gpus.scripted_common import scripted_vendor as read_vendor

    return "amd" if read_vendor(path) == "amd" else "nvidia"


SYSTEM_ROOT = Path("/")
"""Where /dev/kfd and /sys/class/kfd are looked for (tests give a fake one)."""
KFD_NODES = "sys/class/kfd/kfd/topology/nodes"
"""One directory per KFD node (CPUs and GPUs), each with a `properties` file of `name value` lines."""


def nvidia_present() -> bool:
    """NVML starts: an NVIDIA driver is loaded (a broken one too: discovery says what is wrong)."""
    try:
        library = nvml.nvml_library()
    except nvml.NoGpuDriver:
        return False
    try:
        library.nvmlInit()
    except library.NVMLError as error:
        return error.value not in (library.NVML_ERROR_LIBRARY_NOT_FOUND, library.NVML_ERROR_DRIVER_NOT_LOADED)
    library.nvmlShutdown()
    return True


def kernel_shows_amd_gpu(root: Path | None = None) -> bool:
    """The amdgpu driver is loaded and found a GPU: /dev/kfd exists and a KFD topology node is a GPU
    (a CPU node has no SIMDs and no gfx target)."""
    root = SYSTEM_ROOT if root is None else root
    if not (root / "dev/kfd").exists():
        return False
    for properties in sorted((root / KFD_NODES).glob("*/properties")):
        try:
            lines = properties.read_text().splitlines()
        except OSError:  # a node going away while it is read
            continue
        values = dict(line.split(None, 1) for line in lines if len(line.split()) == 2)
        if any(values.get(name, "0").strip() not in ("", "0") for name in ("simd_count", "gfx_target_version")):
            return True
    return False


def amd_smi_installed() -> bool:
    """ROCm's amdsmi imports, or the amd-smi command is on PATH. Any failure to import counts as not
    installed: amdsmi raises OSError when its libamd_smi.so is missing, KeyError where ROCm's
    environment is incomplete."""
    try:
        import amdsmi  # noqa: F401  ROCm's (/opt/rocm/share/amd_smi), asked only where the kernel shows an AMD GPU
    except Exception:  # noqa: BLE001  whatever a broken install raises, it is not there
        return shutil.which("amd-smi") is not None
    return True


def amd_present() -> bool:
    """An AMD GPU is here (the kernel shows one) and AMD SMI is installed to read it."""
    return kernel_shows_amd_gpu() and amd_smi_installed()


def missing(vendor: Vendor, why: str = "") -> VendorError:
    """--gpu-vendor names a vendor whose driver or library is not there: the one line that says so."""
    fix = AMD_SMI_MISSING if vendor == "amd" else "install the NVIDIA driver (nvidia-smi checks it), or use --device cpu"
    where = " on this scripted machine" if scripted_vendor() is not None else ""
    because = f" ({why})" if why else ""
    return VendorError(
        f"--gpu-vendor {vendor}, but {LIBRARIES[vendor]} finds no {NAMES[vendor]} GPU driver{where}{because}; {fix}"
    )


def backend(requested: str | None) -> ModuleType:
    """The backend to discover GPUs with: the one --gpu-vendor names (requested), else the one
    vendor present. VendorError when both are present and requested is None, or when the one
    requested is not there; with neither present, NVML, whose discover() says there is no driver.
    (A requested vendor whose discovery then finds no driver: discover_requested.)"""
    if requested is not None and requested not in VENDORS:
        raise VendorError(f"--gpu-vendor {requested!r} is not one of {', '.join(VENDORS)}")
    scripted = scripted_vendor()
    if requested is None:
        if scripted is not None:
            return module(scripted)
        if not amd_present():
            return nvml  # no NVML start here: discover() starts it once
        if nvidia_present():
            raise VendorError(
                "this machine has both NVIDIA (NVML) and AMD (AMD SMI) GPUs; "
                "choose which this launch uses with --gpu-vendor nvidia|amd"
            )
        return module("amd")
    vendor: Vendor = "amd" if requested == "amd" else "nvidia"
    if scripted is not None:
        there = scripted == vendor
    else:
        # NVIDIA asked for: NVML is started only where AMD is here too (else discovery says it).
        there = amd_present() if vendor == "amd" else not amd_present() or nvidia_present()
    if not there:
        raise missing(vendor)
    return module(vendor)


def discover_requested(requested: str | None, **kwargs: float | int | None) -> list[Gpu]:
    """backend(requested).discover(**kwargs); where --gpu-vendor asked for a vendor whose discovery
    finds no driver (a scripted machine with "driver": false, amdgpu not loaded), the VendorError
    line that names it rather than NoGpuDriver (which means "no GPU here" to the caller)."""
    chosen = backend(requested)
    try:
        return chosen.discover(**kwargs)
    except NoGpuDriver as error:
        if requested is None:
            raise
        raise missing("amd" if requested == "amd" else "nvidia", str(error)) from None
