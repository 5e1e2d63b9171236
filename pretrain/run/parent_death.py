"""A child process that must not outlive its parent asks Linux to SIGKILL it when the parent
dies (prctl PR_SET_PDEATHSIG). The launcher's workers use it (a SIGKILLed launcher leaves no
worker behind), and so do the DataLoader workers of a training process (a killed rank's forked
workers would otherwise keep its sockets to the other ranks open). Standard library only."""

from __future__ import annotations

import ctypes
import os
import signal

PR_SET_PDEATHSIG = 1


def die_with_parent(parent_pid: int) -> None:
    """Call in the child, first thing: SIGKILL this process when parent_pid dies. Exits at once
    when the parent died already, before the request took effect. Does nothing where prctl is
    missing (not Linux): whoever tears the run down still kills the child."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):
        return
    if os.getppid() != parent_pid:
        os._exit(1)
