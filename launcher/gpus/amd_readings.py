"""Single readings through an amdsmi library (ROCm's package, or the scripted AMD machine): one call
that may fail, may be missing from an older amdsmi, or may mean the GPU stopped answering; and one
GPU's health readings made of them (launcher/gpus/amd.py's discovery and run-time watch both read
them). What the readings are: amd.py's docstring.
"""

from __future__ import annotations

from typing import Any

from launcher.gpus.amd_common import LOST, THROTTLE_REASONS
from launcher.gpus.devices import Health


def code(error: BaseException) -> int | None:
    """The amdsmi_status_t of a failed AMD SMI call (amd_common.STATUS); None for any other error."""
    return getattr(error, "err_code", None)


def say(error: BaseException) -> str:
    """An AMD SMI error in one line (AmdSmiLibraryException's str spans two)."""
    info = getattr(error, "get_error_info", None)
    return str(info()) if callable(info) else " ".join(str(error).split())


def reading(amdsmi: Any, function: str, *args: Any, lost_too: bool = False) -> Any:
    """amdsmi.function(*args), or None where AMD SMI cannot tell: not supported, no permission, or
    a function this amdsmi does not have (an older ROCm's: amdsmi_get_gpu_kfd_info, the partition
    modes, violation status came later). An error that means the GPU stopped answering goes up,
    unless lost_too (then None as well)."""
    read = getattr(amdsmi, function, None)
    if read is None:
        return None
    try:
        return read(*args)
    except amdsmi.AmdSmiException as error:
        if code(error) in LOST and not lost_too:
            raise
        return None


def read_health(amdsmi: Any, handle: Any) -> Health:
    """The health readings of the GPU `handle` names. A reading AMD SMI cannot give is None; an
    error that means the GPU stopped answering goes up (discovery lists it with its error)."""
    ecc = reading(amdsmi, "amdsmi_get_gpu_total_ecc_count", handle)
    statuses = _page_statuses(amdsmi, reading(amdsmi, "amdsmi_get_gpu_bad_page_info", handle))
    pcie = reading(amdsmi, "amdsmi_get_pcie_info", handle) or {}
    uncorrectable = None if ecc is None else ecc.get("uncorrectable_count")
    return Health(
        ecc_uncorrected=uncorrectable if isinstance(uncorrectable, int) else None,
        retired_pages_pending=None if statuses is None else int(amdsmi.AmdSmiMemoryPageStatus.PENDING) in statuses,
        clock_reasons=_clock_reasons(amdsmi, handle),
        pcie_width=_number((pcie.get("pcie_metric") or {}).get("pcie_width")),
        pcie_max_width=_number((pcie.get("pcie_static") or {}).get("max_pcie_width")),
        pages_unretirable=None if statuses is None else statuses.count(int(amdsmi.AmdSmiMemoryPageStatus.UNRESERVABLE)),
    )


def _page_statuses(amdsmi: Any, pages: Any) -> list[int] | None:
    """The status of each bad page (AmdSmiMemoryPageStatus values): an older amdsmi says "No bad
    pages found." instead of an empty list; None where a page's status is not one of them (or the
    pages could not be read)."""
    if isinstance(pages, str) and "no bad pages" in pages.lower():
        return []
    if not isinstance(pages, list):
        return None
    names = {status.name: int(status) for status in amdsmi.AmdSmiMemoryPageStatus}
    statuses = []
    for page in pages:
        status = page.get("status") if isinstance(page, dict) else None
        if isinstance(status, int) and not isinstance(status, bool):  # an int, or the enum itself
            statuses.append(int(status))
        elif isinstance(status, str) and status.strip().upper() in names:
            statuses.append(names[status.strip().upper()])
        else:
            return None
    return statuses


def _number(value: Any) -> int | None:
    """AMD SMI's reading, or None for its "N/A" (and the maximum values it means N/A by)."""
    return value if isinstance(value, int) and not isinstance(value, bool) and 0 < value < 0xFFFF else None


def _clock_reasons(amdsmi: Any, handle: Any) -> frozenset[str] | None:
    """The clock reasons the violations active now mean; None where AMD SMI cannot say (before ROCm
    6.3 it has no amdsmi_get_violation_status; some boards answer N/A)."""
    status = reading(amdsmi, "amdsmi_get_violation_status", handle)
    if not isinstance(status, dict):
        return None
    flags = {name: status.get(f"active_{key}") for name, (key, _) in THROTTLE_REASONS.items()}
    if not any(isinstance(flag, bool) for flag in flags.values()):
        return None
    return frozenset(THROTTLE_REASONS[name][1] for name, flag in flags.items() if flag is True)
