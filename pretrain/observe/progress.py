"""Progress lines: the step a training worker has just finished, for the launcher that supervises it.

The launcher judges a failure by the step the run reached (the same failure at the same step twice
in a row is not restarted again: launcher/supervise/restarts.py), and the step lines come only every
logging.log_interval steps. So, when the launcher names a marker in LAUNCHER_PROGRESS_MARK (the
worker contract, docs/design.md "Log format"), a worker writes "<marker><step>" on stdout after every
step; the launcher takes such lines in and writes them nowhere, neither to the console nor to a log.
One short write of a number the loop already has: no device sync, no measurable time. Without the
variable (run alone, under torchrun) nothing is written. Standard library only."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable

PROGRESS_VAR = "LAUNCHER_PROGRESS_MARK"
"""Set by the launcher's supervisor (launcher/supervise/restarts.py holds the same name)."""


def reporter() -> Callable[[int], None] | None:
    """What reports a finished step, or None where no launcher asks for it (or its marker would
    split the line)."""
    mark = os.environ.get(PROGRESS_VAR, "")
    if not mark or "\n" in mark or "\r" in mark:
        return None

    def report(step: int) -> None:
        # One write of a whole line: under the launcher stdout is unbuffered (PYTHONUNBUFFERED), so
        # it reaches the pipe in one piece, in order with the log lines written through sys.stdout.
        sys.stdout.write(f"{mark}{step}\n")
        sys.stdout.flush()  # nothing to do when unbuffered; else the line must not wait in a buffer

    return report
