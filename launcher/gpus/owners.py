"""Who owns a process that holds a GPU, for every vendor's reader (NVML and AMD SMI both report
host PIDs)."""

from __future__ import annotations

import psutil


def owner(pid: int) -> str | None:
    """The user running `pid`; None when it is not visible from here. NVML and AMD SMI report host
    PIDs: inside a container, other containers' processes are not there at all. (A PID that names
    an unrelated local process cannot be told apart.)"""
    try:
        return psutil.Process(pid).username()
    except (psutil.Error, KeyError):  # NoSuchProcess, AccessDenied; KeyError: uid without a name
        return None
