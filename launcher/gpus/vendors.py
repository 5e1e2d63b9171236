"""Which GPU vendor this machine has, detected, never configured: the backend module that reads its
GPUs (launcher/gpus/nvml.py for NVIDIA, launcher/gpus/amd.py for AMD through AMD SMI). Both have
`discover(window=None, samples=None)`, `HealthReader(gpus)` and `peer_links(gpus)`, and fill in the
same records (launcher/gpus/devices.py), so nothing past discovery asks which vendor it is, except
to name the variable that makes a GPU visible to a worker (Gpu.visibility_variable).

- A scripted machine (LAUNCHER_SCRIPTED_GPUS) says its vendor ("vendor": "nvidia" or "amd";
  nvidia unless it says otherwise).
- Otherwise NVIDIA is present when NVML starts (a driver is loaded; a driver that is there but
  broken counts as present, and discovery then says what is wrong with it), AMD when AMD SMI is
  installed (ROCm's amdsmi Python package, or the amd-smi command).
- Both present: the launch is refused unless --gpu-vendor says which; neither: NVML's "no driver"
  path, as before AMD existed (CPU workers where falling back is allowed, else one line).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from types import ModuleType

from launcher.gpus import nvml
from launcher.gpus.devices import Gpu, Vendor
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


def amd_present() -> bool:
    """AMD SMI is installed (its Python package or its command)."""
    return bool(_amd().available())


def present() -> list[Vendor]:
    """The vendors whose GPUs this machine has, as far as their libraries say."""
    scripted = scripted_vendor()
    if scripted is not None:
        return [scripted]
    found: list[Vendor] = []
    if nvidia_present():
        found.append("nvidia")
    if amd_present():
        found.append("amd")
    return found


def backend(requested: str | None) -> ModuleType:
    """The backend to discover GPUs with: the one --gpu-vendor names (requested), else the one
    vendor present. VendorError when both are present and requested is None, or when the one
    requested is not there; with neither present, NVML, whose discover() says there is no driver."""
    if requested is not None and requested not in VENDORS:
        raise VendorError(f"--gpu-vendor {requested!r} is not one of {', '.join(VENDORS)}")
    found = present()
    if requested is None:
        if len(found) > 1:
            raise VendorError(
                "this machine has both NVIDIA (NVML) and AMD (AMD SMI) GPUs; "
                "choose which this launch uses with --gpu-vendor nvidia|amd"
            )
        return module(found[0]) if found else nvml
    vendor: Vendor = "amd" if requested == "amd" else "nvidia"
    if vendor not in found:
        fix = AMD_SMI_MISSING if vendor == "amd" else "install the NVIDIA driver (nvidia-smi checks it), or use --device cpu"
        where = " on this scripted machine" if scripted_vendor() is not None else ""
        raise VendorError(f"--gpu-vendor {vendor}, but {LIBRARIES[vendor]} finds no {NAMES[vendor]} GPU driver{where}; {fix}")
    return module(vendor)
